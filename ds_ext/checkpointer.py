"""The training run's checkpoints: a save every seekspeed.checkpoint.interval_steps /
interval_seconds and at the end, and --resume from the newest complete one, by
DeepSpeed when it was written on this run's layout, cut anew for this layout
(ds_ext/checkpoint/reshard.py) when not. Each save carries what a resume must agree
on (``resume_state``), the model config, the layout record and the compression
settings."""

import dataclasses
import os
import sys
import time

from .errors import ConfigError, SeekspeedError
from .log import rank0_log

# What a checkpoint must agree on for --resume to continue the same sample order. With
# the tiered pipeline the order is one stream of rows that a resumed run continues at
# DeepSpeed's global_samples, so the batch shape may change (_RESHAPEABLE); the memory
# pipeline cuts the corpus per replica, and another cut would replay and skip data.
_RESUME_KEYS = ("data_parallel", "micro_batch", "grad_accum", "seq_len", "schedule_steps", "source", "tokenizer",
                "max_documents", "seed", "data_order")
_RESHAPEABLE = ("data_parallel", "micro_batch", "grad_accum")
# The parallel layout a checkpoint records: when one differs, the checkpoint is cut anew
# for this run (ds_ext/checkpoint/reshard.py) instead of loaded by DeepSpeed.
_LAYOUT_KEYS = ("pipe_stages", "data_parallel", "expert_parallel_size", "schedule")


class Checkpointer:
    """Saves and resumes one run's checkpoints (``plan.checkpoint_dir``; with none set,
    saves nothing). Call ``after_step`` after each optimizer step, ``finish`` once after
    the loop; ``paths`` are then the checkpoints this run committed."""

    def __init__(self, plan, engine, control, *, rank):
        from .checkpoint.reshard import optimizer_kind
        from .comm.state import settings as comm_settings
        s = plan.section
        self.engine, self.control, self.rank = engine, control, rank
        self.directory, self.section, self.comm = plan.checkpoint_dir, s.checkpoint, s.comm
        self.model_config, self.cfg, self.routed_experts = plan.model_config, plan.cfg, plan.recipe.routed_experts
        self.total = s.train.steps
        self.layout = plan.layout_record | {"optimizer": optimizer_kind(engine)}
        self.comm_settings = comm_settings(s.comm, layout=self.layout)
        # "comm": what each rank's compression state file (written by the engine) depends on
        self.meta = resume_state(plan.cfg) | {"recipe": s.recipe.name,
                                              "model_config": dataclasses.asdict(plan.model_config),
                                              "layout": self.layout, "comm": self.comm_settings}
        self.async_ckpt = engine._async_checkpoints()
        self.saved = []
        self.last_save = time.monotonic()

    # -- resume ----------------------------------------------------------------------------

    def resume(self):
        """Load the newest complete checkpoint (all ranks); the engine then stands at its step."""
        load_path = self._load()
        if self.rank == 0:
            print(f"resumed from {load_path} at step {self.engine.global_steps}", flush=True)
        self.last_save = time.monotonic()

    def _load(self):
        """By DeepSpeed when the checkpoint was written on this run's layout, cut anew for
        this layout when not. Returns its path."""
        from .checkpoint import reshard
        from .comm import state as comm_state
        engine, control, rank, ckpt_dir = self.engine, self.control, self.rank, self.directory
        tag = self._newest_tag()
        if tag is None:
            raise ConfigError(f"--resume: DeepSpeed found no loadable checkpoint in {ckpt_dir}")
        tag_dir = os.path.join(ckpt_dir, tag)
        layout = self.layout
        error, changed, saved, comm = None, [], None, None
        try:
            state = reshard.load_model_state(engine, tag_dir)
            saved = state.get("seekspeed") if isinstance(state, dict) else None
            changed = check_resume_state(saved, self.cfg, tag_dir, layout=layout, model_config=self.model_config)
            comm = comm_state.resume_plan(saved.get("comm"), self.comm_settings, section=self.comm, path=tag_dir)
        except SeekspeedError as exc:
            error = exc
        control.stop_if_any_failed(error, rank=rank)
        if comm.warning and rank == 0:
            print(f"warning: {comm.warning}", file=sys.stderr, flush=True)
        assert not (comm.load and changed), "a layout change is a compression settings change"
        if not changed:
            load_path, _ = engine.load_checkpoint(ckpt_dir, tag=tag)
            if load_path is None:
                raise ConfigError(f"--resume: DeepSpeed could not load {tag_dir}")
            if comm.load:      # this rank's residuals, Q, generator and step count
                try:
                    steps = comm_state.load_file(engine, tag_dir, saved=saved["comm"])
                except SeekspeedError as exc:
                    error = exc
                control.stop_if_any_failed(error, rank=rank)
                if rank == 0:
                    print(f"comm: every rank's compression state restored ({self.comm.compressor}, {steps} steps "
                          f"reduced)", flush=True)
            return load_path
        record = saved["layout"]
        if rank == 0:
            print(f"--resume: {tag_dir} was written on another layout ("
                  + "; ".join(f"{k} {record[k]} -> {layout[k]}" for k in changed) + "): cutting it anew for this run",
                  flush=True)
        try:
            reshard.load_into(engine, tag_dir, saved=record, routed_experts=self.routed_experts,
                              log=rank0_log(rank))
        except SeekspeedError as exc:
            error = exc
        control.stop_if_any_failed(error, rank=rank)
        return tag_dir

    def _newest_tag(self):
        """The tag --resume loads: the newest checkpoint that verifies (async-zstd), or the
        one DeepSpeed's 'latest' names."""
        if self.async_ckpt is not None:
            self.async_ckpt.wait()
            return self.async_ckpt.resolve(self.directory)
        latest = os.path.join(self.directory, "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            return f.read().strip()

    # -- save ------------------------------------------------------------------------------

    def after_step(self, step):
        if self._due(step):
            self._save(step)

    def _due(self, step):
        if not self.directory or step >= self.total:
            return False
        if self.section.interval_steps and step % self.section.interval_steps == 0:
            return True
        if self.section.interval_seconds:
            return self.control.rank0_decides(time.monotonic() - self.last_save >= self.section.interval_seconds)
        return False

    def _save(self, step):
        if self.engine.save_checkpoint(self.directory, tag=f"global_step{step}",
                                       client_state={"seekspeed": dict(self.meta)}) is not False:
            self.saved.append(step)
        self.last_save = time.monotonic()

    def finish(self, *, start):
        """The final save (seekspeed.checkpoint.save_final, when this run trained a step),
        then wait for the asynchronous writes."""
        if self.directory and self.section.save_final and self.total > start:
            if self.async_ckpt is not None:
                self.async_ckpt.wait()      # the final save is never skipped for one still writing
            self._save(self.total)
        if self.async_ckpt is not None:
            self.async_ckpt.wait()
            self.saved = [h["step"] for h in self.async_ckpt.committed()]

    @property
    def paths(self):
        return [os.path.join(self.directory, f"global_step{n}") for n in self.saved] if self.directory else []

    @property
    def history(self):
        """Every asynchronous save's record (committed, skipped, failed); None with DeepSpeed's engine."""
        return self.async_ckpt.history if self.async_ckpt is not None else None


def resume_state(cfg):
    """What a checkpoint of ``cfg``'s run records for --resume to check (``_RESUME_KEYS``)."""
    s, lay = cfg.section, cfg.layout
    return {"data_parallel": lay.data_parallel, "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum,
            "seq_len": lay.seq_len, "schedule_steps": s.train.steps, "source": s.data.source,
            "tokenizer": s.data.tokenizer, "max_documents": s.data.max_documents, "seed": s.train.seed,
            "data_order": _data_order(s.data)}


def _data_order(data):
    """What the sample order depends on beyond the keys above (hot/cold tier settings do not count).
    encoding_errors appears only when not "strict", so checkpoints from before it still match."""
    encodings = [section.encoding_errors for section, _ in data.sources()]
    encoding = "" if set(encodings) == {"strict"} else f" encoding_errors={encodings}"
    if data.pipeline == "memory":
        return "memory" + encoding
    mixture = [(m.source, m.weight) for m in data.mixture]
    return f"tiered rows_per_shard={data.rows_per_shard} shuffle_window={data.shuffle_window} mixture={mixture}" \
        + encoding


def check_resume_state(saved, cfg, path, *, layout, model_config):
    """Refuse what --resume cannot continue, naming every difference; returns the layout
    keys that differ (empty: DeepSpeed loads the checkpoint as it is)."""
    if not saved:
        raise ConfigError(f"--resume: {path} was not written by seekspeed (no data position in it); "
                          f"start a new run in another --checkpoint-dir")
    now = resume_state(cfg)
    saved = {"data_order": "memory"} | saved        # checkpoints from before the tiered pipeline
    fields = dataclasses.asdict(model_config)
    model = [f"{k} {v!r} -> {fields.get(k)!r}" for k, v in (saved.get("model_config") or {}).items()
             if fields.get(k) != v]
    if model:
        raise ConfigError(f"--resume: {path} holds another model ({'; '.join(model[:4])}): resume with the "
                          f"checkpoint's recipe.preset and recipe.overrides, or start a new run")
    tiered = cfg.section.data.pipeline == "tiered"
    diff = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in _RESUME_KEYS
            if saved.get(k) != now[k] and not (tiered and k in _RESHAPEABLE)]
    if diff:
        reshape = [d for d in diff if d.split()[0] in _RESHAPEABLE]
        hint = (" (data.pipeline \"memory\" gives each replica its own cut of the corpus, which another degree or "
                "batch would cut anew, replaying and skipping data: resume with the checkpoint's batch layout, or "
                "train with seekspeed.data.pipeline \"tiered\", whose one global order a resume continues at any "
                "layout)") if reshape and not tiered else ""
        raise ConfigError(f"--resume: {path} was trained with other settings ({'; '.join(diff)}){hint}: resume "
                          f"with the checkpoint's data, sequence length and train.steps")
    record = saved.get("layout")
    if record is None:
        if now["data_parallel"] != saved.get("data_parallel"):
            raise ConfigError(f"--resume: {path} predates seekspeed's layout records, so it can only resume on its "
                              f"own layout ({saved.get('data_parallel')} data-parallel replicas)")
        return []
    changed = [k for k in _LAYOUT_KEYS if record.get(k) != layout[k]]
    from .checkpoint.reshard import PARTITIONED_OPTIMIZERS
    if changed and not {record.get("optimizer"), layout["optimizer"]} <= set(PARTITIONED_OPTIMIZERS):
        what = "; ".join(f"{k} {record.get(k)!r} -> {layout[k]!r}" for k in changed)
        raise ConfigError(f"--resume: {path} was written on another layout ({what}), and resuming on another "
                          f"layout needs an optimizer state DeepSpeed cuts by replicas on both sides (ZeRO stage 1, "
                          f"or bf16; checkpoint: {record.get('optimizer')}, now: {layout['optimizer']}): resume on "
                          f"the checkpoint's layout, or train with zero_optimization.stage 1")
    return changed
