"""The layouts of one config that fit, ranked by the planner's tokens/s per GPU
(``launch/plan.py --sweep``).

Every combination of pipeline degree, schedule, expert-parallel degree, micro-batch
and activation checkpointing is planned at the config's global batch
(``train_batch_size``, or micro-batch x accumulation x data-parallel as written) with
``pipeline.partition: "balanced"``; the accumulation follows from the micro-batch and
the data-parallel degree. A combination DeepSpeed or seekspeed would refuse (batch not
divisible, a schedule's constraint on accumulation or degree, more stages than layers)
is counted as refused with its reason, one that does not fit GPU memory as not
fitting; the rest are ranked.
"""

import copy
import json
import os
import re
import tempfile
from dataclasses import dataclass

from ds_ext.errors import SeekspeedError

PIPE_DEGREES = (1, 2, 4, 8, 16, 32)
MICRO_BATCHES = (1, 2, 4)


@dataclass(kw_only=True)
class Candidate:
    pipe_stages: int
    schedule: str
    expert_parallel: int
    micro_batch: int
    grad_accum: int
    checkpointing: bool
    plan: object = None         # ds_ext.planner.Plan, when it was planned

    def describe(self):
        return (f"pp {self.pipe_stages} {self.schedule} ep {self.expert_parallel} mb {self.micro_batch} "
                f"x {self.grad_accum} ckpt {'on' if self.checkpointing else 'off'}")

    def to_json(self):
        p = self.plan
        busy = [st.busy for st in p.stages]
        return {"pipe_stages": self.pipe_stages, "schedule": self.schedule, "expert_parallel": self.expert_parallel,
                "micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "checkpointing": self.checkpointing,
                "step_seconds": p.step_seconds, "tokens_per_s_per_gpu": p.tokens_per_s / (p.nodes * p.ranks_per_node),
                "memory_gb": max(st.total for st in p.stages) / 1e9, "busy_spread": max(busy) / min(busy) - 1,
                "dp_seconds": p.dp_seconds, "bubble": p.bubble}


def _powers_of_two_dividing(n, limit):
    out, k = [], 1
    while k <= limit and n % k == 0:
        out.append(k)
        k *= 2
    return out


def candidates(ds, *, world_size, layers, routed_experts):
    """Every layout to try for the DeepSpeed JSON ``ds`` on ``world_size`` ranks."""
    from ds_ext.pipe import REGISTRY
    current_dp = world_size // ds.get("pipeline", {}).get("stages", 1)
    batch = ds.get("train_batch_size") or (ds.get("train_micro_batch_size_per_gpu", 1)
                                           * ds.get("gradient_accumulation_steps", 1) * current_dp)
    moe = routed_experts > 0
    for pp in PIPE_DEGREES:
        if world_size % pp or pp > layers:
            continue
        dp = world_size // pp
        for schedule, spec in REGISTRY.items():
            if pp == 1 and not spec.one_stage:
                continue
            for ep in (_powers_of_two_dividing(dp, routed_experts) if moe else [1]):
                if moe and routed_experts % ep:
                    continue
                for mb in MICRO_BATCHES:
                    if batch % (mb * dp):
                        continue
                    for ckpt in (True, False):
                        yield Candidate(pipe_stages=pp, schedule=schedule, expert_parallel=ep, micro_batch=mb,
                                        grad_accum=batch // (mb * dp), checkpointing=ckpt)


def _variant(ds, c):
    out = copy.deepcopy(ds)
    out.pop("train_batch_size", None)
    out["train_micro_batch_size_per_gpu"] = c.micro_batch
    out["gradient_accumulation_steps"] = c.grad_accum
    out.setdefault("pipeline", {}).update(stages=c.pipe_stages, partition="balanced",
                                          activation_checkpoint_interval=1 if c.checkpointing else 0)
    s = out.setdefault("seekspeed", {})
    s["schedule"] = c.schedule
    s.setdefault("moe", {})["expert_parallel_size"] = c.expert_parallel
    if s.get("overlap") == "layer":
        s["overlap"] = "auto"
    return out


def sweep(config_path, *, nodes, ranks_per_node, hardware, log=print):
    """(ranked [Candidate] that fit, {reason: count} of those that did not)."""
    from ds_ext.config import read_json
    from ds_ext.planner import GB, make_plan
    from recipes import get_recipe
    ds = read_json(config_path)
    s = ds.get("seekspeed", {})
    recipe = get_recipe(s.get("recipe", {}).get("name", "deepseek_v3"))
    mc = recipe.make_config(s.get("recipe", {}).get("preset", "tiny"), s.get("recipe", {}).get("overrides"))
    world = nodes * ranks_per_node
    todo = list(candidates(ds, world_size=world, layers=mc.num_hidden_layers,
                           routed_experts=mc.n_routed_experts if mc.num_moe_layers() else 0))
    log(f"sweep: {len(todo)} layouts of {config_path} on {nodes} x {ranks_per_node} ranks")
    fitting, skipped = [], {}
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, os.path.basename(config_path))
        for i, c in enumerate(todo, 1):
            with open(path, "w") as f:
                json.dump(_variant(ds, c), f)
            try:
                c.plan = make_plan(path, nodes=nodes, ranks_per_node=ranks_per_node, hardware=hardware)
            except (SeekspeedError, ValueError) as exc:
                reason = re.sub(r"\d+", "N", str(exc).split(":")[0])[:90]
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            if all(st.total <= hardware.memory_gb * GB for st in c.plan.stages):
                fitting.append(c)
            else:
                skipped["does not fit GPU memory"] = skipped.get("does not fit GPU memory", 0) + 1
            if i % 25 == 0 or i == len(todo):
                log(f"  {i}/{len(todo)} planned, {len(fitting)} fit")
    fitting.sort(key=lambda c: -c.plan.tokens_per_s)
    return fitting, skipped


def report(fitting, skipped, *, top=10):
    lines = [f"{'#':>3}  {'layout':<44} {'step s':>7} {'tok/s/GPU':>10} {'mem GB':>7} {'busy spread':>11} "
             f"{'grad red. ms':>12}"]
    for i, c in enumerate(fitting[:top], 1):
        j = c.to_json()
        lines.append(f"{i:>3}  {c.describe():<44} {j['step_seconds']:>7.3f} {j['tokens_per_s_per_gpu']:>10,.0f} "
                     f"{j['memory_gb']:>7.1f} {j['busy_spread']:>10.1%} {j['dp_seconds'] * 1e3:>12.1f}")
    if not fitting:
        lines.append("  (no layout fits)")
    lines.append(f"{len(fitting)} layouts fit; not planned or not fitting: "
                 + (", ".join(f"{n} x {reason}" for reason, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
                    or "none"))
    return "\n".join(lines)
