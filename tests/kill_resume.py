"""The kill-and-resume matrix's machinery (tests/test_kill_resume.py runs it over every
config in ds_configs/; benchmarks/kill_resume_layouts.py over ``OPTIMIZER_LAYOUTS``, the
optimizer layouts no shipped config has): the trainer (ds_ext.trainer.main, as
launch/train.py runs it) saves a checkpoint after every step with DeepSpeed's engine and
with async-zstd; one of its ranks SIGKILLs itself at a random point of the save path
(tests/kill_worker.py: on entering or leaving one of the engine's steps, drawn from what
the uninterrupted run did in that save, or at a random moment after a save began), the
others are killed 0-200 ms later as a launcher would, and the same command runs again
with ``--resume auto``, again and again until a run finishes. Every restart must come
back from the newest complete checkpoint on disk (or start fresh where there is none)
and the finished run must end bitwise where the uninterrupted one ends: every weight of
the last checkpoint and every step's loss in metrics.csv (the same arithmetic in the
same order, so bitwise; CPU FusedAdam's beta powers are computed from the step, see
ds_ext/checkpoint/adam_history.py).

Configs run through tests/config_analogues.py (a production config as its tiny
analogue with the same non-shape sections). Every run takes the smallest batch its
schedule accepts (2 micro-batches of 2 rows per stage; a save and a resume happen at
the same places in a step of any size). Ranks fork from the test harness's forkserver
(torch, DeepSpeed and the trainer imported once). ``TRIALS_*`` kills per chain of runs
on one checkpoint directory (a chain that finishes first is followed by another).
"""

import json
import os
import random
import signal
import time

from ds_ext.checkpoint import catalog
from tests import config_analogues, kill_worker
from tests.distributed import free_port, rank_context
from tests.numerics import assert_same_checkpoint_weights

STEPS = 5
ENGINES = ("deepspeed", "async-zstd")
# configs of ds_configs/ the matrix cannot run, with why (none today)
CANNOT_RUN = {}
# (config, optimizer layout): changes on top of the config's analogue
OPTIMIZER_LAYOUTS = {
    "zero1-fp32": ("tiny_1rank.json", {"zero_optimization": {"stage": 1}}),
    "bf16-zero0": ("tiny_1rank.json", {"bf16": {"enabled": True}}),
    "bf16-zero1": ("tiny_1rank.json", {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}),
    "torch-adamw": ("tiny_1rank.json", {"optimizer": {"type": "AdamW", "params": {
        "lr": 0.002, "betas": [0.9, 0.95], "weight_decay": 0.1, "torch_adam": True}}}),
}
# kills per (case, engine) chain: more where a restart is cheap (one rank)
TRIALS_ONE_RANK, TRIALS_TWO_RANKS, TRIALS_FOUR_RANKS = 6, 3, 2
TIMED_SHARE = 0.25          # kills at a random moment rather than at a step's entry or exit


def _merge(base, change):
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict) and key != "optimizer":
            _merge(base[key], value)
        else:
            base[key] = value


def _trials(world):
    return {1: TRIALS_ONE_RANK, 2: TRIALS_TWO_RANKS}.get(world, TRIALS_FOUR_RANKS)


def shipped_cases():
    """{case: (config file, {})} for every config in ds_configs/ not in ``CANNOT_RUN``."""
    return {name.removesuffix(".json"): (name, {}) for name in config_analogues.config_names()
            if name not in CANNOT_RUN}


def layout_cases():
    """{case: (config file, change)} for ``OPTIMIZER_LAYOUTS``."""
    return {f"{name.removesuffix('.json')}+{layout}": (name, change)
            for layout, (name, change) in OPTIMIZER_LAYOUTS.items()}


def planned_kills(name):
    """Kills the matrix makes for ds_configs/``name``: both engines, by its world size."""
    return len(ENGINES) * _trials(config_analogues.analogue(name)[1])


def _config(tmp_path, case, name, change, engine):
    cfg, world = config_analogues.analogue(name)
    _merge(cfg, change)
    # the smallest batch every schedule takes (2 micro-batches per stage, of 2 rows): kills and
    # resumes happen at the same places in a step of any size, and each run takes less time
    stages = cfg.get("pipeline", {}).get("stages", 1)
    cfg.pop("train_batch_size", None)
    cfg["gradient_accumulation_steps"] = min(cfg.get("gradient_accumulation_steps", 1), 2 * stages)
    cfg["train_micro_batch_size_per_gpu"] = min(cfg.get("train_micro_batch_size_per_gpu", 1), 2)
    s = cfg["seekspeed"]
    ckpt = s.setdefault("checkpoint", {})
    ckpt.update(engine=engine, interval_steps=1, save_final=True)
    ckpt.pop("interval_seconds", None)
    if engine == "deepspeed":
        ckpt.pop("keep_last", None)            # retention is the async engine's
    elif ckpt.get("keep_last"):
        ckpt["keep_last"] = 2                  # so that 5 steps reach retention's deletes
    s["train"]["log_interval"] = 1
    s["data"]["max_documents"] = 100           # enough rows for 5 steps; loads in a fraction of a second
    s.setdefault("report", {})["plots"] = False
    path = tmp_path / f"{case}.{engine}.json"
    path.write_text(json.dumps(cfg))
    return str(path), world


class _Job:
    """The ranks of one launch/train.py run, forked from the harness's forkserver."""

    def __init__(self, *, world, argv, log_dir, tracer_args):
        os.makedirs(log_dir, exist_ok=True)
        ctx = rank_context()
        port = free_port()
        self.logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(world)]
        self.procs = [ctx.Process(target=kill_worker.run_rank, daemon=True,
                                  args=(r, world, port, argv, self.logs[r], tracer_args[r], {}))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def log(self, rank=0):
        try:
            with open(self.logs[rank], errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def describe(self, lines=40):
        return "\n".join(f"--- rank {r} (exit code {p.exitcode}):\n" + "".join(self.log(r).splitlines(True)[-lines:])
                         for r, p in enumerate(self.procs))

    def wait(self, timeout, rng):
        """Until every rank exits or one is killed; then the others are killed 0-200 ms
        later. Returns the exit codes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.exitcode for p in self.procs]
            if -signal.SIGKILL in codes or all(c is not None for c in codes):
                break
            time.sleep(0.01)
        else:
            self.finish()
            raise AssertionError(f"the run hangs after {timeout} s\n{self.describe()}")
        if any(p.exitcode is None for p in self.procs):
            time.sleep(rng.uniform(0.0, 0.2))
        self.finish()
        return [p.exitcode for p in self.procs]

    def finish(self):
        for p in self.procs:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.join()


def _argv(cfg, ckpt, *, resume, summary=None):
    argv = ["--deepspeed", cfg, "--steps", str(STEPS), "--checkpoint-dir", ckpt]
    if resume:
        argv += ["--resume", "auto"]
    if summary:
        argv += ["--summary-json", summary]
    return argv


def _reference(tmp_path, cfg, world, engine):
    """The uninterrupted run, each rank recording its save path: (checkpoint dir, losses,
    per rank {save: [events]})."""
    ckpt, summary = str(tmp_path / "ckpt"), str(tmp_path / "summary.json")
    records = [str(tmp_path / f"events{r}.jsonl") for r in range(world)]
    job = _Job(world=world, argv=_argv(cfg, ckpt, resume=False, summary=summary), log_dir=str(tmp_path / "log"),
               tracer_args=[{"engine": engine, "record": records[r]} for r in range(world)])
    codes = job.wait(300, random.Random(0))
    assert codes == [0] * world, job.describe()
    events = []
    for path in records:
        per_save = {}
        with open(path) as f:
            for line in f:
                e = json.loads(line)
                per_save.setdefault(e["save"], []).append(e)
        events.append(per_save)
    with open(summary) as f:
        losses = json.load(f)["losses"]
    assert len(losses) == STEPS
    return ckpt, losses, events


def _newest_complete(ckpt, engine):
    """The step a restart must come back from (0: none), read from disk as each engine
    defines complete: the newest committed checkpoint that verifies (async-zstd), the one
    ``latest`` names (DeepSpeed's engine)."""
    if engine == "async-zstd":
        found = catalog.newest_complete(ckpt, log=lambda m: None)
        return found.step if found is not None else 0
    tag = catalog.read_latest(ckpt)
    return catalog.step_of(tag) if tag else 0


def _draw_kill(rng, events, *, start, world):
    """A kill in one of the next two saves of a run resuming at ``start``: a rank, a save,
    and one of the events the uninterrupted run had there on that rank, or a moment
    after the save began."""
    rank = rng.randrange(world)
    save = rng.randint(1, min(2, STEPS - start))
    recorded = events[rank][start + save]
    if rng.random() < TIMED_SHARE:
        span = max(e["t"] for e in recorded)
        return rank, {"save": save, "when": "timed", "delay": rng.uniform(0.0, 1.5 * span + 0.05)}
    e = rng.choice(recorded)
    return rank, {"save": save, "phase": e["phase"], "n": e["n"], "when": e["when"]}


def _chain(directory, cfg, world, engine, events, *, rng, kills, report):
    """Runs with --resume auto in one checkpoint directory, up to ``kills`` of them
    killed, until one finishes. Each must come back from the newest complete checkpoint.
    Returns the number killed."""
    ckpt = str(directory / "ckpt")
    killed_runs = 0
    for run in range(4 * kills + 8):
        start = _newest_complete(ckpt, engine)
        kill = _draw_kill(rng, events, start=start, world=world) if killed_runs < kills and start < STEPS else None
        log_dir = str(directory / f"run{run}")
        killed_path = os.path.join(log_dir, "killed.json")
        tracer = [{"engine": engine} for _ in range(world)]
        if kill is not None:
            tracer[kill[0]].update(kill=kill[1], killed=killed_path)
        job = _Job(world=world, argv=_argv(cfg, ckpt, resume=True), log_dir=log_dir, tracer_args=tracer)
        codes = job.wait(300, rng)
        log = job.log(0)
        came_back = (f"resumed from {ckpt}/global_step{start}" in log and f" at step {start}\n" in log) if start \
            else "starting fresh" in log
        what = f"{engine} run {run} (from step {start}, kill {kill})"
        if kill is not None and os.path.exists(killed_path):
            assert codes[kill[0]] == -signal.SIGKILL, f"{what}\n{job.describe()}"
            # every kill is in a save or after one began, so after the resume was printed
            assert came_back, f"{what} did not come back from step {start}\n{job.describe()}"
            killed_runs += 1
            report.append(f"{engine}: from step {start}, rank {kill[0]} killed at {kill[1]}")
            continue
        assert codes == [0] * world, f"{what} failed\n{job.describe()}"
        assert came_back, f"{what} did not come back from step {start}\n{job.describe()}"
        if kill is not None:
            report.append(f"{engine}: from step {start}, {kill} was not reached: the run finished")
        return killed_runs
    raise AssertionError(f"{engine}: no run finished after {run + 1} runs")


def _metrics_losses(ckpt):
    import csv
    with open(os.path.join(ckpt, "report", "metrics.csv"), newline="") as f:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(f)}


def check_case(tmp_path, case, name, change):
    """The matrix's check for one case (ds_configs/``name`` as its analogue, with
    ``change`` merged in), in ``tmp_path``: both engines' uninterrupted runs end alike;
    then per engine, chains of killed and resumed runs until its share of kills, each
    chain ending bitwise on the uninterrupted run. Raises AssertionError on the first
    failure; returns the report lines and {engine: (kills, chains)}."""
    rng = random.Random(f"{case}-20261204")
    configs = {engine: _config(tmp_path, case, name, change, engine) for engine in ENGINES}
    references = {engine: _reference(tmp_path / engine / "reference", cfg, world, engine)
                  for engine, (cfg, world) in configs.items()}
    # the engines write the same training: the two uninterrupted runs end alike
    assert references["deepspeed"][1] == references["async-zstd"][1]
    assert_same_checkpoint_weights(references["deepspeed"][0], references["async-zstd"][0], f"global_step{STEPS}")

    report, counts = [], {}
    for engine, (cfg, world) in configs.items():
        ref_ckpt, ref_losses, events = references[engine]
        kills, chains = 0, 0
        while kills < _trials(world):        # a chain that finishes before its share of kills is followed by another
            chain = tmp_path / engine / f"chain{chains}"
            kills += _chain(chain, cfg, world, engine, events, rng=rng, kills=_trials(world) - kills, report=report)
            # bitwise the uninterrupted run: the last checkpoint's weights, every step's loss
            assert_same_checkpoint_weights(ref_ckpt, chain / "ckpt", f"global_step{STEPS}")
            losses = _metrics_losses(chain / "ckpt")
            assert losses == dict(enumerate(ref_losses, start=1)), (losses, ref_losses)
            chains += 1
        report.append(f"{engine}: {kills} kills in {chains} chain(s), each ending bitwise the uninterrupted run")
        counts[engine] = (kills, chains)
    return report, counts
