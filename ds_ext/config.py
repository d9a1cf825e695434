"""The project's section of a DeepSpeed JSON config, validated strictly, and the
parallel layout (pipeline x data parallel, batch arithmetic) it implies.

One JSON file holds DeepSpeed's own keys plus ``"seekspeed": {...}``:

    "seekspeed": {
      "recipe":     {"name": "deepseek_v3", "preset": "tiny", "overrides": {...}},
      "schedule":   "1f1b" | "dualpipev" | "dualpipev-zb" | "dualpipe",
      "overlap":    "auto" | "layer" | "none",
      "overlap_grad_reduce": false | true,
      "moe":        {"bias_update_speed": 0.001, "balance_loss_alpha": 0.0001},
      "data":       {"source": "stdlib", "tokenizer": "byte", "seq_len": 128, ...},
      "train":      {"steps": 300, "seed": 1234, "log_interval": 10},
      "checkpoint": {"dir": "runs/tiny", "interval_steps": 100},
      "topology":   {"placement": "auto", "bandwidth": "launcher", ...},
      "comm":       {"compressor": "topk", "ratio": 0.01, "hierarchical": true, ...},
      "report":     {"dir": null, "plots": true, "profile": "10:12"}
    }

``overlap_grad_reduce`` (Megatron's name): each virtual stage's data-parallel gradient
reduction is issued asynchronously once the schedule has run that stage's last backward
(and, under the zero-bubble schedules, its last W) of the step, and waited for at
ReduceGrads, so it runs while the rest of the pipeline drains (ds_ext/pipe/grad_overlap.py).
Dense, it is bitwise DeepSpeed's own reduction; ZeRO stage 1 with
``zero_optimization.overlap_comm`` true and a ``communication_data_type`` wider than the
gradients under ZeRO 1 are refused.

Pipeline degree, partitioning and activation checkpointing use DeepSpeed's own
``"pipeline"`` section (``stages``, ``partition``, ``activation_checkpoint_interval``);
batch sizes use DeepSpeed's ``train_batch_size`` / ``train_micro_batch_size_per_gpu``
/ ``gradient_accumulation_steps``, resolved by DeepSpeed's own config code.
"""

import difflib
import json
import os
import sys
from dataclasses import dataclass, field

from .errors import ConfigError
from .pipe import LAYER_OVERLAP_SCHEDULES, check_micro_batches, check_schedule, schedule_spec
from .schema import from_dict

OVERLAP_CHOICES = ("auto", "layer", "none")

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


@dataclass(kw_only=True)
class MoeSection:
    # auxiliary-loss-free balancing: bias step per optimizer step (DeepSeek-V3: 0.001; 0 = off)
    bias_update_speed: float = 0.001
    # sequence-wise balance loss weight (DeepSeek-V3: 0.0001; 0 = off)
    balance_loss_alpha: float = 0.0001
    # routed experts sharded over this many data-parallel ranks of each stage
    expert_parallel_size: int = 1

    def check(self, where):
        for name in ("bias_update_speed", "balance_loss_alpha"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name} must be >= 0 (0 turns it off), got {getattr(self, name)}")
        if self.expert_parallel_size < 1:
            raise ConfigError(f"{where}.expert_parallel_size must be >= 1, got {self.expert_parallel_size}")


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
    # pipeline.partition "balanced" cuts by (ds_ext/profile/plan.py)
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
    warmup_steps: int = 0           # dense optimizer steps before compressing
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
        ended +0.6 % behind dense AdamW, at 64 -0.2 %: README), the others 256."""
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
            if self.warmup_steps < 1:
                raise ConfigError(f"{where}.target 'momentum' freezes Adam's second moment after warmup_steps dense "
                                  f"steps, and warmup_steps is {self.warmup_steps}: a variance from no gradients is "
                                  f"zero; set warmup_steps >= 1 (1-bit Adam warms up for 15-25 % of training)")
            if self.momentum > 0:
                raise ConfigError(f"{where}.momentum (DGC's correction) and target 'momentum' both keep a momentum; "
                                  f"set momentum 0 (Adam's own momentum is the one sent)")
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


DSA_STAGES = ("warmup", "sparse")


@dataclass(kw_only=True)
class DsaSection:
    """DeepSeek Sparse Attention training (recipes with a lightning indexer: deepseek_v32),
    as the DeepSeek-V3.2 report trains it. Unset fields take the recipe's defaults."""
    # "warmup": dense attention, only the indexer learns (KL to the main attention over all keys);
    # "sparse": attention over the indexer's top-k keys, the indexer learns from the KL over them
    stage: str | None = None
    # weight of the indexer's KL loss (it trains only the indexer: its input is detached)
    indexer_loss_weight: float | None = None

    def check(self, where):
        if self.stage is not None and self.stage not in DSA_STAGES:
            raise ConfigError(f"{where}.stage {self.stage!r} is not one of {list(DSA_STAGES)}")
        if self.indexer_loss_weight is not None and not self.indexer_loss_weight > 0:
            raise ConfigError(f"{where}.indexer_loss_weight must be > 0 (the indexer learns only from it), got "
                              f"{self.indexer_loss_weight}")

    def is_set(self):
        return self.stage is not None or self.indexer_loss_weight is not None


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
    moe: MoeSection = field(default_factory=MoeSection)
    mtp: MtpSection = field(default_factory=MtpSection)
    dsa: DsaSection = field(default_factory=DsaSection)
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
        _check_choices(where, self, overlap=OVERLAP_CHOICES)

    def recipe_sections(self):
        """The recipe-specific sections this config sets (RecipeSpec.train_options checks
        that the recipe reads them)."""
        return [name for name in ("dsa",) if getattr(self, name).is_set()]

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


@dataclass(kw_only=True)
class Layout:
    """How ``world_size`` ranks split into pipeline stages and data-parallel replicas,
    and the batch arithmetic DeepSpeed will use."""
    world_size: int
    pipe_stages: int
    data_parallel: int
    micro_batch: int
    grad_accum: int
    train_batch: int
    seq_len: int
    schedule: str

    @property
    def tokens_per_step(self):
        return self.train_batch * self.seq_len

    def describe(self):
        return (f"{self.world_size} ranks = {self.pipe_stages} pipeline stages x {self.data_parallel} data-parallel; "
                f"global batch {self.train_batch} = micro-batch {self.micro_batch} x {self.grad_accum} accumulation "
                f"x {self.data_parallel} replicas; {self.tokens_per_step:,} tokens/step; schedule {self.schedule}")


@dataclass(kw_only=True)
class RunConfig:
    path: str
    ds: dict          # the whole JSON, passed to deepspeed.initialize unchanged but for resolved batch keys
    section: SeekspeedSection
    layout: Layout
    warnings: list
    # DeepSpeed's op builders its optimizer for this config loads (ds_keys.check): the
    # trainer loads them under ds_ext.ops.build_guard before DeepSpeed does
    compiled_ops: tuple = ()


def mixed_precision(ds):
    """Whether the DeepSpeed config trains in bf16 or fp16."""
    return bool(ds.get("bf16", {}).get("enabled", False) or ds.get("fp16", {}).get("enabled", False))


def fp32_grad_accumulation(ds):
    """Whether DeepSpeed accumulates gradients in fp32: fp32 training, or
    ``data_types.grad_accum_dtype: fp32`` under bf16/fp16."""
    return not mixed_precision(ds) or _grad_accum_is_fp32(ds)


def _grad_accum_is_fp32(ds):
    """``data_types.grad_accum_dtype`` names fp32 in any of DeepSpeed's spellings
    (fp32, float32, float, torch.float32); resolve_layout has checked it is one."""
    from deepspeed.runtime.config import DtypeEnum
    value = ds.get("data_types", {}).get("grad_accum_dtype")
    return value is not None and DtypeEnum(value) is DtypeEnum.fp32


def _dtypes(ds):
    """(weights' dtype, gradient accumulation dtype), as DeepSpeed's get_data_types
    resolves them: each "fp32", "bf16" or "fp16"."""
    from deepspeed.runtime.config import DtypeEnum
    model = ("fp16" if ds.get("fp16", {}).get("enabled", False) else
             "bf16" if ds.get("bf16", {}).get("enabled", False) else "fp32")
    value = ds.get("data_types", {}).get("grad_accum_dtype")
    return model, model if value is None else DtypeEnum(value).name


def check_precision(ds, *, schedule, zero):
    """The weights' and accumulation dtypes DeepSpeed and the schedule can train with."""
    model, accum = _dtypes(ds)
    spec = schedule_spec(schedule)
    if model == "bf16" and ds["bf16"].get("immediate_grad_update") is True and spec.zero_bubble:
        raise ConfigError(f"bf16.immediate_grad_update true does not work with schedule {schedule}: its W slots add "
                          f"the deferred weight gradients outside autograd, where the BF16 optimizer's hooks never "
                          f"see them: set bf16.immediate_grad_update false, or use schedule 1f1b or dualpipev")
    if accum == model:
        return
    bf16_optimizer = (model, accum) == ("bf16", "fp32")
    if zero == 0:
        raise ConfigError(f"data_types.grad_accum_dtype {accum} with {model} weights needs ZeRO stage 1 (DeepSpeed's "
                          f"stage 0 accumulates in the weights' dtype only and stops with 'unsupported mix'): set "
                          f"zero_optimization.stage 1{' (BF16 optimizer)' if bf16_optimizer else ''} or remove "
                          f"data_types.grad_accum_dtype")
    spec.check_precision(model=model, accum=accum)


def read_json(path):
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} does not exist: pass --deepspeed with a path such as "
                          f"ds_configs/tiny_cpu.json")
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg})") from None


def load_config(path, *, world_size, overrides=None):
    """Read, validate and resolve a config for ``world_size`` ranks.

    ``overrides`` maps dotted paths in the seekspeed section to values (for example
    ``{"train.steps": 5}``) so command-line flags never repeat numbers from the JSON.
    """
    ds = read_json(path)
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: the top level must be an object")
    if SECTION not in ds:
        raise ConfigError(f"{path}: no {SECTION!r} section: add one (see ds_configs/tiny_cpu.json)")
    raw = json.loads(json.dumps(ds[SECTION]))
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[leaf] = value
    section = from_dict(SeekspeedSection, raw, where=SECTION)
    ds[SECTION] = raw
    _fill_auto(ds, section)
    layout, warnings, compiled_ops = resolve_layout(ds, world_size=world_size, section=section, path=path)
    return RunConfig(path=path, ds=ds, section=section, layout=layout, warnings=warnings, compiled_ops=compiled_ops)


_AUTO_SCHEDULER_PARAMS = {"total_num_steps"}


def _fill_auto(ds, section):
    """``"auto"`` in the scheduler means "from seekspeed.train", so the step count
    lives in one place."""
    params = _object(ds, "scheduler", path="config").get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f"scheduler.params must be an object, got {params!r}")
    for key, value in params.items():
        if value == "auto":
            if key not in _AUTO_SCHEDULER_PARAMS:
                raise ConfigError(f"scheduler.params.{key}: \"auto\" is only understood for "
                                  f"{sorted(_AUTO_SCHEDULER_PARAMS)}; give a number")
            params[key] = section.train.steps


# DeepSpeed's own "pipeline" keys (deepspeed/runtime/config.py get_pipeline_config)
PIPELINE_KEYS = ("stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                 "grad_partitioned", "use_reentrant")

# Top-level keys DeepSpeed reads through .keys() or outside DeepSpeedConfig, which the
# recording dict below cannot see.
_TOP_LEVEL_KEYS = {"optimizer", "scheduler", "activation_checkpointing", "flops_profiler", "aio", "autotuning",
                   "tensorboard", "wandb", "csv_monitor", "comet", "data_efficiency", "torch_autocast",
                   "zero_optimization", "elasticity", "compression_training", "weight_quantization",
                   "sequence_parallel_size", "checkpoint", "data_types", "fp16", "bf16", "amp"}


def _object(ds, key, *, path):
    """ds[key] as a dict ({} when absent); anything else is a one-line error."""
    value = ds.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {key!r} must be an object, got {value!r}")
    return value


def pipeline_stages(ds, *, path="config"):
    pipeline = _object(ds, "pipeline", path=path)
    unknown = sorted(set(pipeline) - set(PIPELINE_KEYS))
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, PIPELINE_KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{path}: pipeline.{key} is not a DeepSpeed pipeline key{hint}; allowed: {list(PIPELINE_KEYS)}")
    stages = pipeline.get("stages", 1)
    if stages == "auto" or not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError(f"{path}: pipeline.stages must be a positive integer (the pipeline degree), "
                          f"got {stages!r}")
    interval = pipeline.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
        raise ConfigError(f"{path}: pipeline.activation_checkpoint_interval must be an integer >= 0 "
                          f"(0 = off, N = checkpoint every N layers), got {interval!r}")
    partition = pipeline.get("partition", "best")
    if not isinstance(partition, str):
        raise ConfigError(f"{path}: pipeline.partition must be a string such as 'type:DecoderLayerPipe', "
                          f"got {partition!r}")
    return stages


def _deepspeed_batch_config(param_dict, data_parallel):
    """DeepSpeed's own config parser, resolving batch sizes for ``data_parallel``
    replicas whether or not a process group exists yet."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class _Resolver(DeepSpeedConfig):

        def _configure_train_batch_size(self):
            self.world_size = data_parallel
            super()._configure_train_batch_size()

    return _Resolver(param_dict)


class _RecordingDict(dict):
    """Records which top-level keys DeepSpeed's config parser looks up."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen = set()

    def get(self, key, *default):
        self.seen.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


def check_momentum_target(ds, comm, where="seekspeed.comm"):
    """``target: "momentum"`` sends Adam's momentum: the config's optimizer must be
    Adam or AdamW (install.check_momentum_optimizer checks the instance too)."""
    if comm.target != "momentum":
        return
    opt = ds.get("optimizer") or {}
    kind = str(opt.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"{where}.target 'momentum' freezes Adam's second moment and sends its momentum, and the "
                          f"optimizer is {opt.get('type') or 'none (a client optimizer)'!s}: set optimizer.type to "
                          f"AdamW (or Adam), or set {where}.target 'gradient'")
    params = opt.get("params") or {}
    if kind == "adam" and params.get("weight_decay") and params.get("adam_w_mode") is False:
        raise ConfigError(f"{where}.target 'momentum' with Adam's L2 weight decay (adam_w_mode false: the decay goes "
                          f"into the gradient, so into the momentum each rank sends): use AdamW or weight_decay 0")
    if (ds.get("zero_optimization") or {}).get("offload_optimizer"):
        raise ConfigError(f"{where}.target 'momentum' replaces the step of the Adam DeepSpeed runs on the device; "
                          f"zero_optimization.offload_optimizer runs DeepSpeedCPUAdam's instead: remove the offload or "
                          f"set {where}.target 'gradient'")


def check_overlap_grad_reduce(ds, section, *, zero):
    """The combinations ``seekspeed.overlap_grad_reduce`` cannot run, refused in one line."""
    if not section.overlap_grad_reduce:
        return
    zero_cfg = ds.get("zero_optimization", {})
    if zero == 1 and zero_cfg.get("overlap_comm") is True:
        raise ConfigError("seekspeed.overlap_grad_reduce with zero_optimization.overlap_comm true: ZeRO's own "
                          "overlap reduces from backward hooks, which a pipeline never runs at the boundary; set "
                          "zero_optimization.overlap_comm false (seekspeed overlaps the reduction itself)")


def resolve_layout(ds, *, world_size, section, path="config"):
    """The parallel layout, the warnings about keys DeepSpeed will ignore and the op
    builders DeepSpeed's optimizer loads.

    Batch sizes are resolved by DeepSpeed's own ``DeepSpeedConfig`` for the
    data-parallel size, so what is checked here is what the engine will do.
    """
    stages = pipeline_stages(ds, path=path)
    if world_size % stages:
        raise ConfigError(f"world size {world_size} is not divisible by pipeline.stages {stages}: "
                          f"launch a multiple of {stages} ranks or change pipeline.stages")
    dp = world_size // stages
    for key in ("zero_optimization", "scheduler", "optimizer", "bf16", "fp16", "data_types"):
        _object(ds, key, path=path)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = ds.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{path}: {key} must be a positive integer, got {value!r}")
    from . import ds_keys
    ds_keys.check_pydantic_sections(ds)
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    if zero not in (0, 1) or isinstance(zero, bool):
        raise ConfigError(f"zero_optimization.stage {zero!r} cannot be used with DeepSpeed's pipeline engine: "
                          f"use stage 0 or 1")
    recorder = _RecordingDict({k: v for k, v in ds.items() if k != SECTION})
    try:
        resolved = _deepspeed_batch_config(recorder, dp)
    except AssertionError as exc:
        micro = ds.get("train_micro_batch_size_per_gpu")
        gas = ds.get("gradient_accumulation_steps")
        hint = (f"set train_batch_size to {micro * gas * dp} (= micro-batch {micro} x accumulation {gas} x "
                f"{dp} data-parallel replicas)" if isinstance(micro, int) and isinstance(gas, int) else
                "make train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
                f"data-parallel size ({dp})")
        raise ConfigError(f"batch sizes do not fit {world_size} ranks ({stages} stages x {dp} data-parallel): "
                          f"{' '.join(str(exc).split())}; {hint}") from None
    except Exception as exc:  # DeepSpeed's parser: TypeError, pydantic ValidationError, ...
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ConfigError(f"{path}: DeepSpeed rejects the config ({type(exc).__name__}: {' | '.join(lines[:3])})"
                          f"; fix the DeepSpeed keys named there") from None
    compiled_ops = ds_keys.check(ds, resolved=resolved)
    layout = Layout(world_size=world_size, pipe_stages=stages, data_parallel=dp,
                    micro_batch=resolved.train_micro_batch_size_per_gpu,
                    grad_accum=resolved.gradient_accumulation_steps, train_batch=resolved.train_batch_size,
                    seq_len=section.data.seq_len, schedule=check_schedule(section.schedule))
    if layout.train_batch != layout.micro_batch * layout.grad_accum * dp or layout.grad_accum < 1:
        raise ConfigError(f"batch sizes do not fit {world_size} ranks: train_batch_size {layout.train_batch} is not "
                          f"micro-batch {layout.micro_batch} x accumulation {layout.grad_accum} x {dp} replicas")
    check_micro_batches(layout.schedule, stages=stages, micro_batches=layout.grad_accum)
    check_precision(ds, schedule=layout.schedule, zero=zero)
    check_momentum_target(ds, section.comm)
    check_overlap_grad_reduce(ds, section, zero=zero)
    ep = section.moe.expert_parallel_size
    if dp % ep:
        raise ConfigError(f"seekspeed.moe.expert_parallel_size {ep} does not divide the data-parallel size {dp} "
                          f"({world_size} ranks / {stages} stages): choose a divisor of {dp}")
    if section.moe.balance_loss_alpha > 0 and ds.get("fp16", {}).get("enabled", False):
        raise ConfigError("seekspeed.moe.balance_loss_alpha > 0 is not supported with fp16 (its gradient would miss "
                          "the loss scale): use bf16 or fp32, or set balance_loss_alpha to 0")

    known = recorder.seen | _TOP_LEVEL_KEYS | {SECTION}
    warnings = []
    for key in ds:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            warnings.append(f"top-level key {key!r} is not a DeepSpeed key; DeepSpeed will ignore it{hint}")
    return layout, warnings, compiled_ops


def print_warnings(warnings, *, rank):
    if rank == 0:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr, flush=True)
