"""Pipeline schedule simulator: per-rank timelines, bubbles and activation memory
from the costs of a forward chunk F, a full backward chunk B (of which W is the
weight-gradient part), an overlapped forward-and-backward chunk F&B, and a
point-to-point latency.

The op sequences of the registered schedules (1f1b, dualpipev, dualpipev-zb,
dualpipe) come from the very schedule classes the engines run (each registry entry
names its class and how to read it), so the simulator checks what actually runs;
ZB1P (zero-bubble 1F1B), simulated only, is built here. Each op starts when its rank
is free and its inputs exist: a forward after the previous stage's forward of the same micro-batch,
a backward after the next stage's backward (or its own forward on the loss stage),
a W after the backward that deferred it.

    python -m ds_ext.pipe.simulate --ranks 4 --micro-batches 8 --F 20 --B 40 --W 20
"""

import argparse
import json
from dataclasses import dataclass, field


@dataclass
class Op:
    kind: str                  # "F", "B" (full), "Bi" (input grad only), "W", "FB"
    stage: int = -1            # virtual stage (F/B/Bi; for FB the forward's)
    mb: int = -1               # micro-batch
    stage2: int = -1           # FB: the backward's virtual stage and micro-batch
    mb2: int = -1
    deferred: bool = False     # Bi whose W goes to a later W op
    direction: int = 0         # dualpipe: which copy of the model
    start: float = 0.0
    end: float = 0.0


@dataclass
class Result:
    schedule: str
    ranks: int
    micro_batches: int
    makespan: float
    busy: list
    bubble: float              # makespan - busy, worst rank
    peak_activations: list     # per rank, in (stage, micro-batch) activation units
    timeline: list = field(default_factory=list)   # per rank: [Op]

    def to_json(self):
        return {"schedule": self.schedule, "ranks": self.ranks, "micro_batches": self.micro_batches,
                "makespan": self.makespan, "busy": self.busy, "bubble": self.bubble,
                "peak_activations": self.peak_activations,
                "timeline": [[{"kind": o.kind, "stage": o.stage, "mb": o.mb, "stage2": o.stage2, "mb2": o.mb2,
                               "start": o.start, "end": o.end} for o in ops] for ops in self.timeline]}


# ---- op sequences ---------------------------------------------------------------------

def _ops_from_instructions(schedule_obj, *, rank, ranks, micro_batches, vstage_of, mb_of, direction_of=None):
    """Translate a DeepSpeed-style instruction stream into simulator ops."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass
    from .schedules import ForwardBackwardPass, WeightPass
    ops, counts = [], {}

    def ident(kind, buffer_id, phase):
        if mb_of is None:   # 1F1B: the k-th forward (backward) is micro-batch k
            counts[kind] = counts.get(kind, -1) + 1
            return rank, counts[kind]
        return vstage_of(rank, phase), mb_of(buffer_id)

    for step in schedule_obj.steps():
        for cmd in step:
            phase = getattr(cmd, "phase", 0)
            if isinstance(cmd, ForwardPass):
                stage, mb = ident("F", cmd.buffer_id, phase)
                ops.append(Op("F", stage, mb, direction=direction_of(rank, phase) if direction_of else 0))
            elif isinstance(cmd, BackwardPass):
                stage, mb = ident("B", cmd.buffer_id, phase)
                zb = getattr(cmd, "zb", False)
                ops.append(Op("Bi" if zb else "B", stage, mb, deferred=zb,
                              direction=direction_of(rank, phase) if direction_of else 0))
            elif isinstance(cmd, ForwardBackwardPass):
                s0, m0 = vstage_of(rank, cmd.fwd_phase), mb_of(cmd.fwd_buffer)
                s1, m1 = vstage_of(rank, cmd.bwd_phase), mb_of(cmd.bwd_buffer)
                d = direction_of(rank, cmd.fwd_phase) if direction_of else 0
                ops.append(Op("FB", s0, m0, s1, m1, direction=d))
            elif isinstance(cmd, WeightPass):
                ops.append(Op("W"))
    return ops


def schedule_ops(schedule, *, ranks, micro_batches):
    """Per-rank op lists and the number of virtual stages: a registered schedule's from
    its instruction stream, read as its entry's ``sim`` map says; ZB1P's built here."""
    if schedule == "zb1p":
        return [_zb1p_ops(r, ranks, micro_batches) for r in range(ranks)], ranks
    spec = _spec(schedule)
    cls, sim = spec.instruction_class(), spec.sim
    held = [spec.rank_chunks(rank=r, stages=ranks) for r in range(ranks)]
    per_direction = micro_batches // sim.directions
    return [_ops_from_instructions(cls(micro_batches, ranks, r), rank=r, ranks=ranks, micro_batches=micro_batches,
                                   vstage_of=(lambda rank, phase: held[rank][phase]) if sim.by_buffer else None,
                                   mb_of=(lambda b: b % per_direction) if sim.by_buffer else None,
                                   direction_of=(lambda rank, phase: phase) if sim.directions > 1 else None)
            for r in range(ranks)], spec.virtual_stages(ranks)


def _spec(schedule):
    from .registry import REGISTRY
    if schedule not in REGISTRY:
        raise ValueError(f"unknown schedule {schedule!r}")
    return REGISTRY[schedule]


def _zb1p_ops(rank, ranks, micro_batches):
    """ZB1P (ZB-H1 of the zero-bubble paper): 1F1B's order with each backward split
    into Bi and a W. The W's are not placed here: the simulator runs a pending W
    whenever the rank would otherwise wait at least that long (never delaying an F or
    Bi), and the rest at the end."""
    warmup = min(ranks - rank - 1, micro_batches)
    ops = [Op("F", rank, i) for i in range(warmup)]
    f = warmup
    for b in range(micro_batches):
        if f < micro_batches:
            ops.append(Op("F", rank, f))
            f += 1
        ops.append(Op("Bi", rank, b, deferred=True, direction=-1))   # direction -1: its W fills idle time
    return ops


# ---- the simulation -------------------------------------------------------------------

def simulate(schedule, *, ranks, micro_batches, F, B, W=0.0, FB=None, Bi=None, comm=0.0):
    """Run the schedule's op sequences against the costs; returns a Result. ``F``,
    ``B``, ``W`` (and ``Bi``) are one cost for every chunk, or a list with one per
    virtual stage (unbalanced stages); an F&B chunk then costs its forward's F plus its
    backward's B, or ``FB`` (one cost, or a function of the forward's and the backward's
    virtual stage). ``Bi``, the input-gradient-only backward of a deferring chunk, is
    B - W unless given (a measured engine adds its own fixed cost to each)."""
    def at(cost, stage):
        return cost[stage] if isinstance(cost, (list, tuple)) else cost

    def input_grad(stage):
        return at(B, stage) - at(W, stage) if Bi is None else at(Bi, stage)

    per_rank, num_stages = schedule_ops(schedule, ranks=ranks, micro_batches=micro_batches)
    for v in range(num_stages):
        if at(W, v) > at(B, v):
            raise ValueError(f"W ({at(W, v)}) is part of B ({at(B, v)}) and cannot exceed it")

    def duration(op):
        if op.kind == "F":
            return at(F, op.stage)
        if op.kind == "B":
            return at(B, op.stage)
        if op.kind == "Bi":
            return input_grad(op.stage)
        if op.kind == "W":
            return at(W, op.stage)
        if callable(FB):                                                       # "FB"
            return FB(op.stage, op.stage2)
        return FB if FB is not None else at(F, op.stage) + at(B, op.stage2)

    sim = _Simulation(schedule, ranks, num_stages, comm, copies=_copies(schedule, ranks))
    index = [0] * ranks
    while any(index[r] < len(per_rank[r]) for r in range(ranks)):
        progressed = False
        # ranks in time order, so a rank deciding whether to fill a wait with a W sees
        # every op that could end before it
        for r in sorted(range(ranks), key=lambda q: sim.clock[q]):
            if index[r] >= len(per_rank[r]):
                continue
            op = per_rank[r][index[r]]
            t = sim.ready(r, op)
            if sim.fillers[r]:
                w = Op("W", sim.w_stages[r][0])
                if t is None or t >= sim.clock[r] + duration(w):
                    bound = {"F": at(F, op.stage), "Bi": input_grad(op.stage)}
                    if t is not None or sim.earliest_input(r, op, bound) >= sim.clock[r] + duration(w):
                        sim.run(r, w, start=sim.clock[r], duration=duration(w))
                        progressed = True
                        break
            if t is None:
                continue
            if op.kind == "W":
                op.stage = sim.w_stages[r][0]
            sim.run(r, op, start=max(sim.clock[r], t), duration=duration(op))
            index[r] += 1
            progressed = True
            break
        if not progressed:
            stuck = {r: per_rank[r][index[r]] for r in range(ranks) if index[r] < len(per_rank[r])}
            raise RuntimeError(f"{schedule} deadlocks: no rank can proceed; next ops {stuck}")
    for r in range(ranks):
        while sim.fillers[r]:
            w = Op("W", sim.w_stages[r][0])
            sim.run(r, w, start=sim.clock[r], duration=duration(w))
    makespan = max(sim.clock)
    busy = [sum(o.end - o.start for o in ops) for ops in sim.timeline]
    return Result(schedule, ranks, micro_batches, makespan, busy, max(makespan - b for b in busy), sim.peak,
                  sim.timeline)


def _copies(schedule, ranks):
    """Per rank, the stages it holds in direction order, when each direction of travel
    has its own copy of the model (dualpipe); None otherwise."""
    spec = None if schedule == "zb1p" else _spec(schedule)
    if spec is None or spec.sim.directions == 1:
        return None
    return [spec.rank_chunks(rank=r, stages=ranks) for r in range(ranks)]


class _Simulation:
    """Completion times and per-rank state while ops are placed."""

    def __init__(self, schedule, ranks, stages, comm, copies=None):
        self.schedule, self.ranks, self.last_stage, self.comm = schedule, ranks, stages - 1, comm
        self.copies = copies
        self.fwd_done, self.bwd_done = {}, {}     # (direction, stage, mb) -> end time
        self.clock = [0.0] * ranks
        self.deferred = [[] for _ in range(ranks)]   # W work of deferred backward chunks, FIFO
        self.w_stages = [[] for _ in range(ranks)]   # their virtual stages, same order
        self.fillers = [[] for _ in range(ranks)]    # ZB1P: W work run when the rank would wait
        self.timeline = [[] for _ in range(ranks)]
        self.live = [0] * ranks
        self.peak = [0] * ranks

    def _direction(self, rank, stage, op_direction):
        if self.copies is not None:
            return self.copies[rank].index(stage)
        return max(op_direction, 0)

    def _f_ready(self, d, s, mb):
        if s == 0:
            return 0.0
        t = self.fwd_done.get((d, s - 1, mb))
        return None if t is None else t + self.comm

    def _b_ready(self, d, s, mb):
        own = self.fwd_done.get((d, s, mb))
        if own is None:
            return None
        if s == self.last_stage:
            return own
        t = self.bwd_done.get((d, s + 1, mb))
        return None if t is None else max(own, t + self.comm)

    def earliest_input(self, rank, op, cost):
        """ZB1P (one stage per rank): a lower bound on when ``op``'s input from a
        neighbour can arrive, given that the neighbour is busy until its clock."""
        neighbour = rank - 1 if op.kind == "F" else rank + 1
        return self.clock[neighbour] + cost["F" if op.kind == "F" else "Bi"] + self.comm

    def ready(self, rank, op):
        """When ``op`` could start (None: its inputs do not exist yet)."""
        if op.kind == "F":
            return self._f_ready(self._direction(rank, op.stage, op.direction), op.stage, op.mb)
        if op.kind in ("B", "Bi"):
            return self._b_ready(self._direction(rank, op.stage, op.direction), op.stage, op.mb)
        if op.kind == "W":
            return self.deferred[rank][0] if self.deferred[rank] else None
        if op.kind == "FB":
            a = self._f_ready(self._direction(rank, op.stage, op.direction), op.stage, op.mb)
            b = self._b_ready(self._direction(rank, op.stage2, op.direction), op.stage2, op.mb2)
            return None if a is None or b is None else max(a, b)
        raise AssertionError(op.kind)

    def run(self, rank, op, *, start, duration):
        op.start, op.end = start, start + duration
        self.clock[rank] = op.end
        if op.kind in ("F", "FB"):
            self.fwd_done[(self._direction(rank, op.stage, op.direction), op.stage, op.mb)] = op.end
            self.live[rank] += 1
        if op.kind in ("B", "Bi"):
            self.bwd_done[(self._direction(rank, op.stage, op.direction), op.stage, op.mb)] = op.end
            self.live[rank] -= 1
            if op.deferred:
                (self.fillers if op.direction == -1 else self.deferred)[rank].append(op.end)
                self.w_stages[rank].append(op.stage)
        if op.kind == "FB":
            self.bwd_done[(self._direction(rank, op.stage2, op.direction), op.stage2, op.mb2)] = op.end
            self.live[rank] -= 1
        if op.kind == "W":          # its stage was set from w_stages when it was placed
            (self.deferred[rank] or self.fillers[rank]).pop(0)
            self.w_stages[rank].pop(0)
        self.peak[rank] = max(self.peak[rank], self.live[rank])
        self.timeline[rank].append(op)



def formula_bubble(schedule, *, ranks, F, B, W=0.0, FB=None):
    """The DualPipe README's bubble formulas (PP = pipeline stages: ranks, or 2 x ranks
    for the V schedules; F, B, W, F&B per stage chunk), from each schedule's registry
    entry. They are exact when a chunk's forward, input-gradient backward and weight
    backward cost the same (B = 2F, W = F), the case the README's figures assume."""
    from .registry import REGISTRY
    FB = F + B if FB is None else FB
    if schedule == "zb1p":
        return (ranks - 1) * (F + B - 2 * W)
    formula = REGISTRY[schedule].bubble_formula if schedule in REGISTRY else None
    if formula is None:
        raise ValueError(f"no formula for {schedule!r}")
    return formula(ranks=ranks, F=F, B=B, W=W, FB=FB)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--F", type=float, default=20.0)
    p.add_argument("--B", type=float, default=40.0)
    p.add_argument("--W", type=float, default=20.0)
    p.add_argument("--FB", type=float, help="overlapped F&B chunk (default F + B)")
    p.add_argument("--comm", type=float, default=0.0)
    p.add_argument("--schedules", nargs="+", default=["1f1b", "zb1p", "dualpipev", "dualpipev-zb", "dualpipe"])
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = []
    print(f"{'schedule':<14} {'step':>9} {'bubble':>9} {'formula':>9} {'peak act.':>10}")
    for s in args.schedules:
        res = simulate(s, ranks=args.ranks, micro_batches=args.micro_batches, F=args.F, B=args.B, W=args.W,
                       FB=args.FB, comm=args.comm)
        try:
            f = f"{formula_bubble(s, ranks=args.ranks, F=args.F, B=args.B, W=args.W, FB=args.FB):9.1f}"
        except ValueError:
            f = f"{'-':>9}"
        print(f"{s:<14} {res.makespan:9.1f} {res.bubble:9.1f} {f} {max(res.peak_activations):10d}")
        rows.append(res.to_json())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
