"""The ``seekspeed`` section of a DeepSpeed JSON config as typed dataclasses (parsed by
ds_ext.schema, strictly: an unknown key or a value out of range is an error naming it).
A recipe's own sections (DeepSeek-V3.2's ``dsa``) live with the recipe
(RecipeSpec.sections); ds_ext.config parses them with these."""

import difflib
import typing
from dataclasses import dataclass, field

from .errors import ConfigError
from .pipe import LAYER_OVERLAP_SCHEDULES, schedule_spec

OVERLAP_CHOICES = ("auto", "layer", "none")
GRAD_NORM_CHOICES = ("deepspeed", "exact")
MUON_UPDATE_CHOICES = ("auto", "compiled", "eager")

SECTION = "seekspeed"


@dataclass(kw_only=True)
class RecipeSection:
    name: str = "deepseek_v3"
    preset: str = "tiny"
    overrides: dict = field(default_factory=dict)


DATA_FORMATS = ("auto", "text", "json", "parquet", "saved", "megatron")
# bytes of a text/json file that are not UTF-8: stop ("strict"), decode as U+FFFD ("replace"),
# leave out the documents that have any ("skip")
ENCODING_ERRORS = ("strict", "replace", "skip")


def _check_choices(where, section, **allowed):
    """A one-line error for the first field of ``section`` whose value is not among its ``allowed``."""
    for name, options in allowed.items():
        if getattr(section, name) not in options:
            raise ConfigError(f"{where}.{name} {getattr(section, name)!r} is not one of {list(options)}")


@dataclass(kw_only=True)
class MixtureSource:
    """One source of a ``data.mixture`` (the tiered pipeline): its rows take ``weight``
    of every epoch, whatever its size (a small source repeats, a large one is cut)."""
    source: str
    weight: float = 1.0
    format: str = "auto"
    text_field: str = "text"
    max_documents: int | None = None
    encoding_errors: str | None = None      # null: data.encoding_errors

    def check(self, where):
        if self.weight <= 0:
            raise ConfigError(f"{where}.weight must be positive, got {self.weight}")
        _check_choices(where, self, format=DATA_FORMATS, encoding_errors=ENCODING_ERRORS + (None,))


@dataclass(kw_only=True)
class DataSection:
    # "stdlib": demo corpus from this Python's standard library sources (offline);
    # otherwise a local file, directory of files, or a datasets.save_to_disk directory.
    source: str = "stdlib"
    format: str = "auto"
    text_field: str = "text"
    # "byte": bytes 0-255 plus an end-of-document token 256; or a local tokenizer path
    tokenizer: str = "byte"
    seq_len: int = 128
    num_proc: int = 1
    max_documents: int | None = None
    # text/json files: bytes that are not UTF-8 stop the run ("strict"), become U+FFFD
    # ("replace") or leave their document out ("skip"); the count is in the data summary
    encoding_errors: str = "strict"
    # "causal": attention sees every earlier token of the packed row; "document": only the
    # earlier tokens of its own document (documents end with the tokenizer's eos token)
    attention: str = "causal"
    # "memory": each data rank tokenises its share into RAM; "tiered": packed shards on disk
    # (built once), one global order, read through a hot/cold tier (ds_ext/data/tiers.py)
    pipeline: str = "memory"
    # tiered
    cache_dir: str | None = None      # the cold tier: where packed shards are built/read (default: the cache)
    hot_dir: str | None = None        # local fast directory for the hot tier (null: read the cold tier directly)
    hot_budget_mb: float = 1024.0
    hot_scope: str = "node"           # "node": one hot tier and budget per node; "rank": one per data rank
    policy: str = "next-use"          # hot-tier eviction: "next-use" (farthest next use) or "lru"
    prefetch: bool = True             # fetch the shards the known order needs next, in the background
    prefetch_batches: int = 2         # with prefetch: micro-batches assembled ahead of the step (0: none)
    rows_per_shard: int = 2048
    shuffle_window: int = 4           # shards whose rows are shuffled together
    part_mb: float = 256.0            # the build's unit of work: about this much source data per part
    # tiered: several sources with weights (replaces source/format/text_field/max_documents)
    mixture: list[MixtureSource] = field(default_factory=list)

    def check(self, where):
        _check_choices(where, self, format=DATA_FORMATS, pipeline=("memory", "tiered"), policy=("next-use", "lru"),
                       hot_scope=("node", "rank"),
                       attention=("causal", "document"), encoding_errors=ENCODING_ERRORS)
        for name in ("rows_per_shard", "shuffle_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be >= 1, got {getattr(self, name)}")
        if self.prefetch_batches < 0:
            raise ConfigError(f"{where}.prefetch_batches must be >= 0 (0: no micro-batch read-ahead), got "
                              f"{self.prefetch_batches}")
        if self.hot_budget_mb <= 0:
            raise ConfigError(f"{where}.hot_budget_mb must be positive, got {self.hot_budget_mb}")
        if self.part_mb <= 0:
            raise ConfigError(f"{where}.part_mb must be positive, got {self.part_mb}")
        if self.pipeline != "tiered" and "megatron" in [self.format] + [m.format for m in self.mixture]:
            raise ConfigError(f"{where}.format \"megatron\" (token ids already) needs {where}.pipeline \"tiered\": "
                              f"set it (the memory pipeline tokenises text)")
        if self.seq_len < 2:
            raise ConfigError(f"{where}.seq_len must be >= 2, got {self.seq_len}")
        if self.num_proc < 1:
            raise ConfigError(f"{where}.num_proc must be >= 1, got {self.num_proc}")
        if self.max_documents is not None and self.max_documents < 1:
            raise ConfigError(f"{where}.max_documents must be >= 1 or null, got {self.max_documents}")
        if self.mixture and self.pipeline != "tiered":
            raise ConfigError(f"{where}.mixture needs {where}.pipeline \"tiered\"; set it, or use one source")

    def sources(self):
        """(DataSection of one source, weight) for every source of this section."""
        import dataclasses
        if not self.mixture:
            return [(self, 1.0)]
        return [(dataclasses.replace(self, source=m.source, format=m.format, text_field=m.text_field,
                                     max_documents=m.max_documents, mixture=[],
                                     encoding_errors=m.encoding_errors or self.encoding_errors), m.weight)
                for m in self.mixture]


@dataclass(kw_only=True)
class TrainSection:
    steps: int
    seed: int = 1234
    log_interval: int = 10

    def check(self, where):
        if self.steps < 1:
            raise ConfigError(f"{where}.steps must be >= 1, got {self.steps}")
        if self.log_interval < 1:
            raise ConfigError(f"{where}.log_interval must be >= 1, got {self.log_interval}")


@dataclass(kw_only=True)
class CheckpointSection:
    dir: str | None = None
    interval_steps: int = 0         # 0: no step interval
    interval_seconds: float = 0.0   # also save when this much wall-clock time has passed (0: off)
    save_final: bool = True
    # "deepspeed": DeepSpeed's torch.save engine, synchronous; "async-zstd": snapshot, then
    # compress and write in the background, committed atomically (ds_ext/checkpoint)
    engine: str = "deepspeed"
    # async-zstd
    keep_last: int = 0              # keep the newest N committed checkpoints (0: all)
    when_busy: str = "wait"         # the previous save is still writing: "wait" for it or "skip" this one
    on_error: str = "stop"          # a save failed (disk full...): "stop" training or "continue"
    compression: str = "zstd"       # "zstd" or "none"
    zstd_level: int = 3
    zstd_threads: int = 0           # zstd worker threads (0: compress on the writer thread)
    byte_group: bool = True         # regroup float bytes before compression (exponents together)
    verify: str = "full"            # on resume: "full" (sha256 of every file) or "size"

    def check(self, where):
        if self.dir is not None and not self.dir.strip():
            raise ConfigError(f"{where}.dir must be a path or null (no checkpoints), got an empty string")
        if self.interval_steps < 0:
            raise ConfigError(f"{where}.interval_steps must be >= 0 (0 = no step interval), got {self.interval_steps}")
        if self.interval_seconds < 0:
            raise ConfigError(f"{where}.interval_seconds must be >= 0 (0 = off), got {self.interval_seconds}")
        _check_choices(where, self, engine=("deepspeed", "async-zstd"), when_busy=("wait", "skip"),
                       on_error=("stop", "continue"), compression=("zstd", "none"), verify=("full", "size"))
        if self.keep_last < 0:
            raise ConfigError(f"{where}.keep_last must be >= 0 (0 keeps all), got {self.keep_last}")
        if self.keep_last and self.engine != "async-zstd":
            raise ConfigError(f"{where}.keep_last needs engine \"async-zstd\" (DeepSpeed's engine has no "
                              f"retention); set {where}.engine or remove keep_last")
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"{where}.zstd_level must be in 1..22, got {self.zstd_level}")
        if self.zstd_threads < 0:
            raise ConfigError(f"{where}.zstd_threads must be >= 0, got {self.zstd_threads}")


# the MoE layers' token dispatchers (recipes/layers/dispatch.py)
MOE_DISPATCHERS = ("deduplicated", "every-copy")


@dataclass(kw_only=True)
class MoeSection:
    # auxiliary-loss-free balancing: bias step per optimizer step (DeepSeek-V3: 0.001; 0 = off)
    bias_update_speed: float = 0.001
    # sequence-wise balance loss weight (DeepSeek-V3: 0.0001; 0 = off)
    balance_loss_alpha: float = 0.0001
    # routed experts sharded over this many data-parallel ranks of each stage
    expert_parallel_size: int = 1
    # how tokens reach their experts (recipes/layers/dispatch.py): "deduplicated" sends a
    # token once per destination rank and sums its experts' outputs there; "every-copy"
    # sends each of its top-k copies
    dispatcher: str = "deduplicated"
    # the dispatched rows' dtype: unset (the activation dtype) or "fp8" (e4m3, an fp32 scale
    # per 128 channels; the combine stays in the activation dtype)
    dispatch_dtype: str | None = None

    def check(self, where):
        for name in ("bias_update_speed", "balance_loss_alpha"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name} must be >= 0 (0 turns it off), got {getattr(self, name)}")
        if self.expert_parallel_size < 1:
            raise ConfigError(f"{where}.expert_parallel_size must be >= 1, got {self.expert_parallel_size}")
        _check_choices(where, self, dispatcher=MOE_DISPATCHERS)


@dataclass(kw_only=True)
class TopologySection:
    # which DeepSpeed axis varies fastest over the ranks: "pipe-data" (DeepSpeed's: data-parallel
    # groups on consecutive ranks), "data-pipe" (pipeline stages on consecutive ranks), "auto"
    placement: str = "pipe-data"
    # where the bandwidth matrix comes from: "launcher" (nodes as the launcher numbers them,
    # speeds below), "hostfile", "nvidia-smi" (topo -m inside each node), "probe" (measured)
    bandwidth: str = "launcher"
    hostfile: str | None = None
    # with "hostfile", under a launcher other than DeepSpeed's (whose choice the ranks read from its
    # --world_info): the deepspeed launcher's --include / --exclude / --num_nodes / --num_gpus, same syntax
    include: str | None = None
    exclude: str | None = None
    num_nodes: int | None = None
    num_gpus: int | None = None
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 25.0
    probe_mbytes: int = 4
    # a rank's sustained compute (TFLOP/s), to tell when a pipeline link is slower than the compute it feeds
    compute_tflops: float = 400.0
    # a rank's memory bandwidth (GB/s): the memory-bound passes in the per-layer costs that
    # pipeline.partition "balanced" cuts by (ds_ext/planner/)
    memory_gbps: float = 3350.0

    def check(self, where):
        from ds_ext.topology.placement import PLACEMENTS
        if self.placement not in PLACEMENTS + ("auto",):
            raise ConfigError(f"{where}.placement {self.placement!r} is not one of {list(PLACEMENTS) + ['auto']}")
        sources = ("launcher", "hostfile", "nvidia-smi", "probe")
        if self.bandwidth not in sources:
            raise ConfigError(f"{where}.bandwidth {self.bandwidth!r} is not one of {list(sources)}")
        if self.bandwidth == "hostfile" and not self.hostfile:
            raise ConfigError(f"{where}.bandwidth is \"hostfile\" but {where}.hostfile is not set")
        filters = [k for k in ("include", "exclude", "num_nodes", "num_gpus") if getattr(self, k) is not None]
        if filters and self.bandwidth != "hostfile":
            raise ConfigError(f"{where}.{filters[0]} filters the hostfile, but {where}.bandwidth is "
                              f"{self.bandwidth!r}: remove it or set bandwidth to \"hostfile\"")
        for name in ("num_nodes", "num_gpus"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name} must be >= 1 (or null: not given), got {getattr(self, name)}")
        for name in ("intra_node_gbps", "inter_node_gbps", "compute_tflops", "memory_gbps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name} must be positive, got {getattr(self, name)}")
        if self.probe_mbytes < 1:
            raise ConfigError(f"{where}.probe_mbytes must be >= 1, got {self.probe_mbytes}")


@dataclass(kw_only=True)
class CommSection:
    # the data-parallel gradient reduction: "none" (DeepSpeed's own, untouched), "fp32" (dense
    # through seekspeed's chunked/hierarchical path), "bf16"/"fp16" (cast), "int8", "int4", "sign",
    # "topk", "powersgd"
    compressor: str = "none"
    # what crosses the group after warmup_steps: "gradient" (the averaged gradient) or "momentum"
    # (Adam/AdamW only: the second moment frozen after the dense warm-up, each rank's momentum
    # compressed with error feedback on the worker and the server side, as 1-bit Adam does)
    target: str = "gradient"
    # topk
    ratio: float = 0.01
    selection: str = "sampled"      # "exact" (torch.topk) or "sampled" (DGC threshold from a sample)
    sample_ratio: float = 0.01
    momentum: float = 0.0           # DGC momentum correction (for SGD without momentum of its own)
    kernel: str = "auto"            # top-k's sampled selection and sign's codec on CPU: "fused" (C++ passes,
    #                                 built on first use), "torch" (torch ops), "auto" (fused when it builds)
    # powersgd
    rank: int = 4
    # int8, int4, sign: entries per scale; unset: the compressor's own (int4 64, the others 256)
    block_size: int | None = None
    # all lossy compressors
    error_feedback: bool = True
    # sign, int4: the dtype their error-feedback residuals are kept in between steps, "fp32"
    # or "bf16" (half the bytes; each residual rounded to 8 significant bits, the part error
    # feedback then does not carry forward: docs/compression.md)
    residual_dtype: str = "fp32"
    warmup_steps: int = 0           # dense optimizer steps before compressing
    # target momentum: 0/1 Adam's variance schedule (Lu et al. 2022; DeepSpeed's ZeroOneAdam
    # names). var_update_scaler (its kappa; 16 there): the variance is refreshed by a dense step
    # every interval-th step, the interval starting at 1 and doubling after every kappa
    # refreshes, until var_freeze_step; null: frozen for good after warmup_steps (1-bit Adam)
    var_update_scaler: int | None = None
    var_freeze_step: int = 100000
    # the refresh interval stops doubling at this many steps (null: 0/1 Adam's, unbounded)
    var_update_max_interval: int | None = None
    # what a refresh's gradient crosses the wire as: fp32 (0/1 Adam's dense step), or bf16,
    # int8 or int4 without error feedback (v needs g^2, not the last bits of g)
    refresh_compressor: str = "fp32"
    # how far a refresh moves the variance: "refresh" (0/1 Adam: v <- b2 v + (1 - b2) g^2, one
    # step's decay however long since the last), or "elapsed" (v <- b2^k v + (1 - b2^k) g^2 after
    # k steps: the moving average kept in steps, as dense Adam's, not in refreshes)
    var_refresh_decay: str = "refresh"
    # target momentum under gradient clipping: the norm of the step's averaged gradient, needed
    # before the exchange, as "rms" (the root mean square of the ranks' own norms: no bytes, an
    # upper bound, so it clips harder than DeepSpeed's dense clip) or "sketch" (a count sketch of
    # clip_sketch_buckets fp32 entries all-reduced per reduce call: an unbiased estimate, relative
    # standard deviation about sqrt(2 / buckets) of the squared norm; ds_ext/comm/norm_sketch.py)
    clip_norm: str = "rms"
    clip_sketch_buckets: int = 1024
    # target momentum: between the variance's updates, scale the frozen variance by how far
    # dense Adam's would have moved: the averaged clipped gradient's squared norm tracked as v
    # is (beta2), now over its value at the last dense step; true: one factor for every
    # element (the clip norm's, clip_norm); "tensor": one per parameter tensor, from a count
    # sketch of var_rescale_buckets fp32 entries per tensor (exact for smaller tensors) in the
    # clip sketch's all-reduce. Needs clip_norm "sketch" (the average's norm, unbiased)
    var_rescale: bool | typing.Literal["tensor"] = False
    var_rescale_buckets: int = 32
    min_numel: int = 16384          # smaller tensors go dense
    # parameter-name patterns (fnmatch) reduced dense whatever the compressor; unset: the
    # compressor's own list (powersgd: the embedding and output head, whose gradients are
    # sums over tokens and not low-rank; the others: none)
    dense_params: list[str] | None = None
    # arrangement
    chunk_mb: float = 16.0          # fp32 MB of gradient per chunk; chunks are pipelined
    pipeline_depth: int = 2         # chunks in flight
    hierarchical: bool = False      # dense inside a node, compressed across nodes on the rails
    # --resume from a checkpoint whose compression settings differ from these (or that holds no
    # compression state): "refuse", or "restart" (drop the saved state, warn, and begin again with
    # warmup_steps dense steps)
    on_mismatch: str = "refuse"

    @property
    def resolved_block_size(self):
        """block_size, or the compressor's default when unset: int4 64 (at 256 its runs
        ended +0.6 % behind dense AdamW, at 64 -0.2 %: docs/compression.md), the others 256."""
        from ds_ext.comm.traffic import default_block_size
        return self.block_size if self.block_size is not None else default_block_size(self.compressor)

    def check(self, where):
        from ds_ext.comm.compressors import COMPRESSORS
        if self.compressor not in COMPRESSORS:
            close = difflib.get_close_matches(str(self.compressor), COMPRESSORS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}.compressor {self.compressor!r} is unknown{hint}; choose one of "
                              f"{list(COMPRESSORS)}")
        if self.target not in ("gradient", "momentum"):
            raise ConfigError(f"{where}.target {self.target!r} is not one of ['gradient', 'momentum']")
        if self.on_mismatch not in ("refuse", "restart"):
            raise ConfigError(f"{where}.on_mismatch {self.on_mismatch!r} is not one of ['refuse', 'restart']")
        if self.target == "momentum":
            if self.compressor == "none":
                raise ConfigError(f"{where}.target 'momentum' needs a compressor (sign, int4, int8, topk, powersgd, or "
                                  f"fp32 for the dense reference); compressor 'none' is DeepSpeed's own reduction")
            if self.warmup_steps < 1 and self.var_update_scaler is None:
                raise ConfigError(f"{where}.target 'momentum' freezes Adam's second moment after warmup_steps dense "
                                  f"steps, and warmup_steps is {self.warmup_steps}: a variance from no gradients is "
                                  f"zero; set warmup_steps >= 1 (1-bit Adam warms up for 15-25 % of training), or "
                                  f"var_update_scaler (0/1 Adam's schedule, which starts with dense steps)")
            if self.momentum > 0:
                raise ConfigError(f"{where}.momentum (DGC's correction) and target 'momentum' both keep a momentum; "
                                  f"set momentum 0 (Adam's own momentum is the one sent)")
        if self.var_update_scaler is not None:
            if self.target != "momentum":
                raise ConfigError(f"{where}.var_update_scaler refreshes Adam's frozen variance, which only target "
                                  f"'momentum' freezes; set target 'momentum' or remove var_update_scaler")
            if self.var_update_scaler < 1:
                raise ConfigError(f"{where}.var_update_scaler {self.var_update_scaler}: the refresh interval doubles "
                                  f"after every var_update_scaler refreshes, so it must be >= 1 (0/1 Adam: 16); "
                                  f"remove it to freeze the variance after warmup_steps")
            if self.var_update_max_interval is not None and self.var_update_max_interval < 1:
                raise ConfigError(f"{where}.var_update_max_interval {self.var_update_max_interval}: the refresh "
                                  f"interval's cap must be >= 1 steps; remove it to let the interval double without "
                                  f"bound (0/1 Adam)")
            if self.var_freeze_step < 1:
                raise ConfigError(f"{where}.var_freeze_step {self.var_freeze_step}: the last step the variance may be "
                                  f"refreshed at must be >= 1 (0/1 Adam: the end of the lr warm-up)")
        if self.refresh_compressor not in ("fp32", "bf16", "int8", "int4"):
            raise ConfigError(f"{where}.refresh_compressor {self.refresh_compressor!r} is not one of ['fp32', 'bf16', "
                              f"'int8', 'int4'] (a refresh's gradient feeds the variance: a sign or a top-k of it "
                              f"would zero most of v)")
        if self.var_refresh_decay not in ("refresh", "elapsed"):
            raise ConfigError(f"{where}.var_refresh_decay {self.var_refresh_decay!r} is not one of ['refresh', "
                              f"'elapsed']")
        if self.var_refresh_decay != "refresh" and self.var_update_scaler is None:
            raise ConfigError(f"{where}.var_refresh_decay decays the variance at 0/1 Adam's refreshes, and "
                              f"var_update_scaler is unset (no refreshes): set var_update_scaler or remove "
                              f"var_refresh_decay")
        if self.refresh_compressor != "fp32" and self.var_update_scaler is None:
            raise ConfigError(f"{where}.refresh_compressor compresses 0/1 Adam's variance refreshes, and "
                              f"var_update_scaler is unset (no refreshes): set var_update_scaler or remove "
                              f"refresh_compressor")
        if self.var_update_max_interval is not None and self.var_update_scaler is None:
            raise ConfigError(f"{where}.var_update_max_interval caps 0/1 Adam's refresh interval, and var_update_scaler "
                              f"is unset (no refreshes): set var_update_scaler or remove var_update_max_interval")
        if self.clip_norm not in ("rms", "sketch"):
            raise ConfigError(f"{where}.clip_norm {self.clip_norm!r} is not one of ['rms', 'sketch']")
        if self.clip_norm == "sketch" and self.target != "momentum":
            raise ConfigError(f"{where}.clip_norm 'sketch' estimates the norm target 'momentum' clips by before its "
                              f"exchange; target {self.target!r} clips the averaged gradient, exactly, as DeepSpeed "
                              f"does: remove clip_norm or set target 'momentum'")
        if self.var_rescale and self.target != "momentum":
            raise ConfigError(f"{where}.var_rescale rescales the variance target 'momentum' freezes; set target "
                              f"'momentum' or remove var_rescale")
        if self.var_rescale and self.clip_norm != "sketch":
            raise ConfigError(f"{where}.var_rescale tracks the averaged gradient's squared norm, and clip_norm 'rms' "
                              f"gives the ranks' mean squared norm on momentum steps (above the average's by their "
                              f"noise, so the variance would jump at every switch from dense steps): set clip_norm "
                              f"'sketch'")
        if self.var_rescale_buckets < 8:
            raise ConfigError(f"{where}.var_rescale_buckets {self.var_rescale_buckets}: each tensor's sketched squared "
                              f"norm has a relative standard deviation of about sqrt(2 / buckets) a step, 50 % under "
                              f"8; use 32 (25 % a step, which the tracked average divides by about "
                              f"sqrt((1 + beta2) / (1 - beta2)))")
        if self.clip_sketch_buckets < 16:
            raise ConfigError(f"{where}.clip_sketch_buckets {self.clip_sketch_buckets}: the sketched squared norm's "
                              f"relative standard deviation is about sqrt(2 / buckets), so fewer than 16 leaves it "
                              f"over 35 %; use 1024 (2.2 % on the norm for 4 KB a reduce call)")
        from ds_ext.comm.traffic import RESIDUAL_BYTES, TWO_PHASE
        if self.residual_dtype not in RESIDUAL_BYTES:
            raise ConfigError(f"{where}.residual_dtype {self.residual_dtype!r} is not one of {list(RESIDUAL_BYTES)}")
        if self.residual_dtype == "bf16":
            if self.compressor not in TWO_PHASE:
                raise ConfigError(f"{where}.residual_dtype 'bf16' is for the residuals of {' and '.join(TWO_PHASE)} "
                                  f"(derived and tested there); compressor {self.compressor!r} keeps its own in fp32: "
                                  f"set residual_dtype 'fp32' or compressor 'sign'/'int4'")
            if not self.error_feedback:
                raise ConfigError(f"{where}.residual_dtype 'bf16' with error_feedback false: there is no residual to "
                                  f"keep; remove residual_dtype or set error_feedback true")
        if not 0 < self.ratio <= 1:
            raise ConfigError(f"{where}.ratio must be in (0, 1] (the fraction of entries top-k keeps), "
                              f"got {self.ratio}")
        if self.selection not in ("exact", "sampled"):
            raise ConfigError(f"{where}.selection {self.selection!r} is not one of ['exact', 'sampled']")
        if self.kernel not in ("auto", "fused", "torch"):
            raise ConfigError(f"{where}.kernel {self.kernel!r} is not one of ['auto', 'fused', 'torch']")
        if not 0 < self.sample_ratio <= 1:
            raise ConfigError(f"{where}.sample_ratio must be in (0, 1], got {self.sample_ratio}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"{where}.momentum must be in [0, 1) (0 turns momentum correction off), "
                              f"got {self.momentum}")
        if self.rank < 1:
            raise ConfigError(f"{where}.rank must be >= 1 (the PowerSGD approximation rank), got {self.rank}")
        if self.block_size is None:
            self.block_size = self.resolved_block_size
        if self.block_size < 1:
            raise ConfigError(f"{where}.block_size must be >= 1, got {self.block_size}")
        if self.compressor in ("sign", "int4") and self.block_size % 8:
            raise ConfigError(f"{where}.block_size {self.block_size} must be a multiple of 8 for {self.compressor} "
                              f"(its codes are packed into bytes); leave it unset for the compressor's default")
        for name in ("warmup_steps", "min_numel"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name} must be >= 0, got {getattr(self, name)}")
        if self.chunk_mb <= 0:
            raise ConfigError(f"{where}.chunk_mb must be positive, got {self.chunk_mb}")
        for pattern in self.dense_params or ():
            if not pattern.strip():
                raise ConfigError(f"{where}.dense_params holds an empty pattern; give parameter-name patterns such "
                                  f"as '*embed_tokens.weight', or [] to compress every parameter")
        if self.pipeline_depth < 1:
            raise ConfigError(f"{where}.pipeline_depth must be >= 1, got {self.pipeline_depth}")


@dataclass(kw_only=True)
class MtpSection:
    # weight of the MTP loss (DeepSeek-V3: 0.3, later 0.1); used when the recipe has num_mtp_layers = 1
    loss_weight: float = 0.3

    def check(self, where):
        if self.loss_weight < 0:
            raise ConfigError(f"{where}.loss_weight must be >= 0, got {self.loss_weight}")


@dataclass(kw_only=True)
class ReportSection:
    # where metrics.csv, the plots and profiles go; default: <checkpoint.dir>/report
    dir: str | None = None
    plots: bool = True              # PNG curves, communication breakdown and pipeline timeline at the end
    # a torch.profiler window over optimizer steps, "FIRST:LAST" (--profile overrides)
    profile: str | None = None

    def check(self, where):
        if self.profile is not None:
            from ds_ext.profile.window import parse_window
            parse_window(self.profile, flag=f"{where}.profile")


@dataclass(kw_only=True)
class SeekspeedSection:
    recipe: RecipeSection = field(default_factory=RecipeSection)
    schedule: str = "1f1b"
    # F&B chunks of dualpipev-zb/dualpipe interleaved per layer ("layer"), or not ("none");
    # "auto": "layer" when the model has MoE layers and expert_parallel_size > 1
    overlap: str = "auto"
    # data-parallel gradient reduction issued per virtual stage as soon as the schedule is done
    # with it, waited for at ReduceGrads (ds_ext/pipe/grad_overlap.py)
    overlap_grad_reduce: bool = False
    # the global gradient norm (clipping, the logged norm): DeepSpeed's ("deepspeed"), or
    # one that does not depend on the layout ("exact", ds_ext/grad_norm.py)
    grad_norm: str = "deepspeed"
    # DeepSpeed's Muon update: torch.compile'd as DeepSpeed ships it ("compiled"), run
    # eagerly ("eager"), or "auto": eager on the CPU accelerator, compiled elsewhere
    # (ds_ext/muon.py); optimizer.type Muon only
    muon_update: str = "auto"
    moe: MoeSection = field(default_factory=MoeSection)
    mtp: MtpSection = field(default_factory=MtpSection)
    topology: TopologySection = field(default_factory=TopologySection)
    comm: CommSection = field(default_factory=CommSection)
    # a transformers-format directory (config.json + safetensors) to start from
    init_from: str | None = None
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    report: ReportSection = field(default_factory=ReportSection)

    def check(self, where):
        schedule_spec(self.schedule, where=f"{where}.schedule")
        _check_choices(where, self, overlap=OVERLAP_CHOICES, grad_norm=GRAD_NORM_CHOICES,
                       muon_update=MUON_UPDATE_CHOICES)

    # the recipes' own sections ({name: parsed section}, RecipeSpec.sections), set by load_config
    recipe_config: dict = field(default_factory=dict, init=False)

    def recipe_sections(self):
        """The recipe-specific sections this config sets (RecipeSpec.train_options checks
        that the recipe reads them)."""
        return [name for name, value in self.recipe_config.items()
                if not hasattr(value, "is_set") or value.is_set()]

    def recipe_section(self, name, cls):
        """The parsed recipe section ``name`` (a ``cls``), its defaults when unset."""
        return self.recipe_config.get(name) or cls()

    def resolve_overlap(self, *, has_moe, where="seekspeed"):
        """The overlap mode this run uses ("layer" or "none"); an explicit "layer" that
        the schedule or the model cannot use is refused."""
        ep = self.moe.expert_parallel_size
        interleaves = schedule_spec(self.schedule, where=f"{where}.schedule").layer_overlap
        if self.overlap == "auto":
            return "layer" if interleaves and has_moe and ep > 1 else "none"
        if self.overlap == "layer":
            if not interleaves:
                raise ConfigError(f"{where}.overlap 'layer' interleaves F&B chunks, which only schedules "
                                  f"{' and '.join(LAYER_OVERLAP_SCHEDULES)} run; schedule {self.schedule!r} takes "
                                  f"'none' (its all-to-alls still overlap the shared expert)")
            if not has_moe or ep == 1:
                raise ConfigError(f"{where}.overlap 'layer' hides expert-parallel all-to-alls, and this run has none "
                                  f"({'no MoE layers' if not has_moe else 'moe.expert_parallel_size 1'}): set overlap "
                                  f"'none' or raise moe.expert_parallel_size")
        return self.overlap
