"""The simulated step of a cut: per-chunk sums of the layer costs, the pipeline
simulator (ds_ext/pipe/simulate.py, which runs the engines' own instruction streams)
over them, and what the simulated ops say about the all-to-all in flight, the
overlapped gradient reduction and the activations alive at once."""

SUM_KEYS = ("compute_f", "compute_b", "a2a_f", "a2a_b", "exposed_f", "exposed_b", "W")


def chunk_sums(costs, bounds, *, parts, overlap):
    """Per virtual stage the sums of ``costs`` (cost_layers' per layer) over the cut at
    ``bounds``; "F" and "B" the compute plus the exposed all-to-all; "FB" the cost of an
    F&B chunk (fb_cost)."""
    sums = {key: [sum(costs[i][key] for i in range(bounds[p], bounds[p + 1])) for p in range(parts)]
            for key in SUM_KEYS}
    sums["F"] = [sums["compute_f"][p] + sums["exposed_f"][p] for p in range(parts)]
    sums["B"] = [sums["compute_b"][p] + sums["exposed_b"][p] for p in range(parts)]
    sums["FB"] = fb_cost(sums, overlap=overlap)
    return sums


def fb_cost(sums, *, overlap):
    """An F&B chunk's seconds: interleaved (overlap "layer"), each half's all-to-alls run
    while the other half computes, when both halves have some; counted from the chunk's
    totals, not layer by layer."""
    def cost(sf, sb):
        if overlap != "layer" or not (sums["a2a_f"][sf] and sums["a2a_b"][sb]):
            return sums["F"][sf] + sums["B"][sb]
        return (sums["compute_f"][sf] + sums["compute_b"][sb] + max(0.0, sums["exposed_f"][sf] - sums["compute_b"][sb])
                + max(0.0, sums["exposed_b"][sb] - sums["compute_f"][sf]))
    return cost


def simulate_cut(m, sums, *, comm):
    """The simulated step of PlanModel ``m``'s schedule over per-chunk ``sums``, with
    ``comm`` seconds per point-to-point transfer."""
    from ds_ext.pipe.simulate import simulate
    zb = m.sched.zero_bubble
    return simulate(m.section.schedule, ranks=m.layout.pipe_stages, micro_batches=m.layout.grad_accum, F=sums["F"],
                    B=sums["B"], W=sums["W"] if zb else 0.0, FB=sums["FB"], comm=comm)


def a2a_per_step(timeline, *, fb_cost, a2a_f, a2a_b, exposed_f, exposed_b, compute_f, compute_b):
    """(seconds in flight, seconds charged) of the all-to-alls per step on the rank with
    the most in flight, walking the simulated ops."""
    worst = (0.0, 0.0)
    for ops in timeline:
        flight = charged = 0.0
        for op in ops:
            if op.kind == "F":
                flight, charged = flight + a2a_f[op.stage], charged + exposed_f[op.stage]
            elif op.kind in ("B", "Bi"):
                flight, charged = flight + a2a_b[op.stage], charged + exposed_b[op.stage]
            elif op.kind == "FB":
                flight += a2a_f[op.stage] + a2a_b[op.stage2]
                charged += fb_cost(op.stage, op.stage2) - compute_f[op.stage] - compute_b[op.stage2]
        worst = max(worst, (flight, charged))
    return worst


def overlapped_reduction_ends(timeline, *, schedule, stages, reductions):
    """Per rank: when its gradient reduction ends if each chunk's starts once the chunk
    has run its last backward and W of the step (``seekspeed.overlap_grad_reduce``),
    one chunk after another on the rank's links. ``reductions[rank][chunk]``: that
    chunk's reduction seconds. A chunk held twice (dualpipe's copies) starts once both
    copies are done: their gradients are summed first. The reductions are taken not to
    slow the pipeline's own transfers or compute (separate links and streams)."""
    done = {}
    for ops in timeline:
        for op in ops:
            if op.kind in ("B", "Bi", "W"):
                done[op.stage] = max(done.get(op.stage, 0.0), op.end)
            elif op.kind == "FB":
                done[op.stage2] = max(done.get(op.stage2, 0.0), op.end)
    ends = []
    for rank in range(stages):
        t = 0.0
        for chunk, seconds in sorted(reductions[rank].items(), key=lambda kv: done.get(kv[0], 0.0)):
            t = max(t, done.get(chunk, 0.0)) + seconds
        ends.append(t)
    return ends


def peak_bytes(timeline, stage_bytes):
    """Per rank: the most activation bytes alive at once, walking the simulated ops in
    order: a forward of virtual stage s adds ``stage_bytes[s]``, its backward frees
    them, or, when the backward defers its weight gradient, the W that runs it (the
    layer inputs and output gradients wait for it; counted as all of the chunk's)."""
    peaks = []
    for ops in timeline:
        live = peak = 0.0
        for op in ops:
            if op.kind in ("F", "FB"):
                live += stage_bytes[op.stage]
            peak = max(peak, live)
            if op.kind == "B" or (op.kind == "Bi" and not op.deferred) or op.kind == "W":
                live -= stage_bytes[op.stage]
            if op.kind == "FB":
                live -= stage_bytes[op.stage2]
        peaks.append(peak)
    return peaks
