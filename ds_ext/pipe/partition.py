"""Cutting a layer list into pipeline stages, as DeepSpeed's PipelineModule does, and
the balanced cut from per-layer costs; what each pipeline rank then holds, and
parameter counts built on the meta device. Works on any DeepSpeed LayerSpec list (no
process group, no recipe class).
"""

import torch


def _spec_name(spec):
    return spec.typename.__name__


def partition(specs, *, num_parts, method):
    """Layer boundaries exactly as DeepSpeed's PipelineModule computes them; ``method``
    may also be a cut already made (a list of ``num_parts + 1`` boundaries, e.g.
    ``pipeline.partition: "balanced"`` resolved by ds_ext.planner)."""
    import re
    from deepspeed.runtime import utils as ds_utils
    if not isinstance(method, str):
        bounds = [int(b) for b in method]
        if len(bounds) != num_parts + 1 or bounds[0] != 0 or bounds[-1] != len(specs) or bounds != sorted(bounds):
            raise ValueError(f"a cut of {len(specs)} layers into {num_parts} parts needs {num_parts + 1} "
                             f"non-decreasing boundaries from 0 to {len(specs)}, got {bounds}")
        return bounds
    method = method.lower()
    if method == "uniform":
        return ds_utils.partition_uniform(num_items=len(specs), num_parts=num_parts)
    if method == "parameters":
        return ds_utils.partition_balanced(weights=[count_parameters(s) for s in specs], num_parts=num_parts)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if pattern.search(_spec_name(s)) else 0 for s in specs]
        if not any(weights):
            raise ValueError(f"partition method {method!r} matches no layer")
        return ds_utils.partition_balanced(weights=weights, num_parts=num_parts)
    raise ValueError(f"unknown partition method {method!r}: use 'uniform', 'parameters', 'type:REGEX' or 'balanced'")


def balanced_cut(costs, *, schedule, stages):
    """Boundaries of the layer list into the schedule's virtual stages that minimise the
    busiest pipeline rank's compute, from a cost per layer (seconds per micro-batch,
    forward + backward + W; ds_ext.planner). The cut is handed to DeepSpeed's
    PipelineModule as its ``parts`` (ds_ext.pipe's "balanced" method).

    DeepSpeed's ``partition_balanced`` evens out contiguous parts, but a rank may hold
    two of them: the V schedules give rank r parts r and 2P-1-r, dualpipe r and a copy
    of P-1-r, so their ranks pair parts from both ends of the list. Exact dynamic
    programmes: 1f1b over prefixes; the paired schedules over (left, right) boundaries
    folded from the ends inwards, one pair at a time. Ties on the busiest rank are then
    broken by moving single boundaries while the sorted loads fall. Every part keeps at
    least one layer."""
    import numpy as np
    from ds_ext.pipe import rank_chunks, virtual_stages
    parts, n = virtual_stages(schedule, stages), len(costs)
    if parts > n:
        raise ValueError(f"{parts} parts of {n} layers: every part needs a layer")
    owners = [rank_chunks(schedule, rank=r, stages=stages) for r in range(stages)]
    pre = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    if all(len(o) == 1 for o in owners):
        bounds = _cut_contiguous(pre, parts)
    elif all(sorted(o) == sorted({o[0], parts - 1 - o[0]}) for o in owners) and parts % 2 == 0:
        bounds = _cut_folded(pre, parts // 2)
    else:
        raise ValueError(f"no balanced cut for schedule {schedule!r}: ranks hold parts {owners}")

    def loads(b):
        chunk = [pre[b[p + 1]] - pre[b[p]] for p in range(parts)]
        return tuple(sorted((sum(chunk[p] for p in set(own)) for own in owners), reverse=True))

    best, improved = loads(bounds), True
    while improved:
        improved = False
        for p in range(1, parts):
            for step in (-1, 1):
                trial = list(bounds)
                trial[p] += step
                if bounds[p - 1] < trial[p] < bounds[p + 1] and loads(trial) < best:
                    bounds, best, improved = trial, loads(trial), True
    return [int(b) for b in bounds]


def _cut_contiguous(pre, parts):
    """Min-max cut of the prefix sums ``pre`` into ``parts`` non-empty contiguous parts."""
    import numpy as np
    n = len(pre) - 1
    best = np.full((parts + 1, n + 1), np.inf)
    back = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for p in range(1, parts + 1):
        for i in range(p, n - (parts - p) + 1):
            k = np.arange(p - 1, i)
            value = np.maximum(best[p - 1, k], pre[i] - pre[k])
            j = int(np.argmin(value))
            best[p, i], back[p, i] = value[j], k[j]
    bounds = [n]
    for p in range(parts, 0, -1):
        bounds.append(int(back[p, bounds[-1]]))
    return bounds[::-1]


def _cut_folded(pre, pairs):
    """Min-max cut into 2 x ``pairs`` non-empty parts where pair q is part q and part
    2 x pairs - 1 - q: states (i, j) = the left parts end at i, the right ones start at
    j; pair q adds [i, i') and [j', j)."""
    import numpy as np
    n = len(pre) - 1
    inf = np.inf
    value = np.full((n + 1, n + 1), inf)
    value[0, n] = 0.0
    history = []
    for q in range(pairs):
        last = q == pairs - 1
        new = np.full((n + 1, n + 1), inf)
        back = np.zeros((n + 1, n + 1, 2), dtype=int)
        rows = np.arange(n + 1)
        for i2 in range(1, n):
            left = pre[i2] - pre[:i2]                      # over i < i2
            sub = value[:i2]                               # (i, j)
            # right part [j2, j) for every j2 >= i2 (the middle pair meets: j2 == i2)
            for j2 in ([i2] if last else range(i2, n)):
                cols = rows[j2 + 1:]
                if not len(cols):
                    continue
                cand = np.maximum(sub[:, j2 + 1:], left[:, None] + (pre[j2 + 1:] - pre[j2])[None, :])
                flat = int(np.argmin(cand))
                i, jj = divmod(flat, cand.shape[1])
                if cand[i, jj] < new[i2, j2]:
                    new[i2, j2], back[i2, j2] = cand[i, jj], (i, cols[jj])
        value = new
        history.append(back)
    i2 = int(np.argmin(np.diagonal(value)))
    left, right, state = [i2], [i2], (i2, i2)
    for back in reversed(history[1:]):
        state = tuple(int(x) for x in back[state])
        left.append(state[0])
        right.append(state[1])
    left.append(0)
    right.append(n)
    return left[::-1] + right[1:]


def count_parameters(spec):
    """Parameters of one layer spec, built on the meta device (no memory)."""
    with torch.device("meta"):
        module = spec.build()
    return sum(p.numel() for p in module.parameters())


def held_once(specs, indices):
    """``indices`` of ``specs`` with each tied layer (a TiedLayerSpec key) kept at its
    first occurrence only: DeepSpeed holds one copy of a tied matrix per rank."""
    seen, out = set(), []
    for idx in indices:
        key = getattr(specs[idx], "key", None)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        out.append(idx)
    return out


def rank_layers(specs, *, bounds, schedule, stages):
    """Per pipeline rank: the indices of the layer specs it holds (its chunks of the
    cut at ``bounds``, a tied layer once)."""
    from ds_ext.pipe import rank_chunks
    return [held_once(specs, [i for p in rank_chunks(schedule, rank=rank, stages=stages)
                              for i in range(bounds[p], bounds[p + 1])]) for rank in range(stages)]


def stage_parameter_counts(specs, *, stages, schedule, partition_method):
    """Per pipeline rank: its layer ranges and parameter count, without allocating."""
    from ds_ext.pipe import rank_chunks, virtual_stages
    bounds = partition(specs, num_parts=virtual_stages(schedule, stages), method=partition_method)
    counts = [count_parameters(s) for s in specs]
    unique_total = sum(counts[i] for i in held_once(specs, range(len(specs))))
    return [{"rank": rank, "layer_ranges": [(bounds[p], bounds[p + 1]) for p in rank_chunks(schedule, rank=rank,
                                                                                           stages=stages)],
             "params": sum(counts[i] for i in held), "unique_total": unique_total}
            for rank, held in enumerate(rank_layers(specs, bounds=bounds, schedule=schedule, stages=stages))]
