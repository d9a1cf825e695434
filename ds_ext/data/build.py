"""Building the tiered pipeline's packed cache: every part packed here, in order, or by
datatrove's local executor (``data.num_proc`` > 1; ds_ext/data/prepare.py), then the
index written once (ds_ext/data/store.py)."""

import os

from .prepare import run_executor
from .store import BuildPlan, ShardSet, finish, run_task


def build(data, tokenizer, *, root, rows_per_shard, log=print):
    """Build (or find) the packed cache for ``data`` under ``root``; returns its
    PackedStore. The parts are packed here, in order (``data.num_proc`` > 1: by that
    many local processes of datatrove's local executor), exactly as
    ``launch/prepare_data.py`` packs them."""
    plan = BuildPlan(data, tokenizer, root=root, rows_per_shard=rows_per_shard)
    if plan.done is not None:
        return plan.done
    if os.path.exists(plan.final):
        log(f"data: {plan.final} does not match the current settings; rebuilding it")
    plan.write()
    with plan.removed_on_bad_input():
        if data.num_proc > 1 and len(plan.parts) > 1:
            run_executor(plan, tokenizer, executor="local", tasks=min(data.num_proc, len(plan.parts)),
                         workers=data.num_proc, log=log)
        else:
            run_task(plan, tokenizer, rank=0, world_size=1, log=log)
        return finish(plan, log=log)


def build_all(data, tokenizer, *, root, rows_per_shard, log=print):
    """Every source of ``data`` (one, or the mixture's) built or found under ``root``."""
    stores, weights = [], []
    for section, weight in data.sources():
        stores.append(build(section, tokenizer, root=root, rows_per_shard=rows_per_shard, log=log))
        weights.append(weight)
    return ShardSet(root, stores, weights)
