"""Memory per pipeline rank: weights, gradients, optimizer state (ZeRO's shards),
activations at the schedule's peak (with and without activation checkpointing) and
buffers; and the check that every rank fits the GPU."""

from dataclasses import asdict, dataclass, field

from ds_ext.errors import ConfigError

from .hardware import GB


@dataclass(kw_only=True)
class StageMemory:
    rank: int
    layers: list
    params: int
    expert_params: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    activations_checkpointed: float
    buffers: float
    checkpointing: bool
    in_flight: int
    # what the compressed reduction keeps between steps (seekspeed.comm; ds_ext.comm.traffic.state_bytes)
    comm_state: float = 0.0
    comm_state_parts: dict = field(default_factory=dict)
    muon_seconds: float = 0.0  # DeepSpeed's Muon: this rank's Newton-Schulz matmuls a step
    busy: float = 0.0          # seconds a step this rank computes (the simulator's ops; idle and waits excluded)
    reduce_seconds: float = 0.0   # this rank's data-parallel gradient reduction on its own (not overlapped)

    @property
    def total(self):
        return (self.weights + self.gradients + self.optimizer + self.buffers + self.comm_state
                + (self.activations_checkpointed if self.checkpointing else self.activations))

    def to_json(self):
        return asdict(self) | {"total": self.total}


def chunk_activations(m, rows):
    """(bytes kept per micro-batch, bytes of the largest recomputed group) of one chunk's
    ``rows`` with checkpointing: DeepSpeed checkpoints each run of the interval's layers
    whose layers are all checkpointable, keeping its input; other layers keep
    everything. With checkpointing off this is the "with checkpointing" column at an
    interval of 1."""
    k = m.interval if m.interval > 0 else 1
    kept = recompute = 0
    for i in range(0, len(rows), k):
        group = rows[i:i + k]
        if all(r["checkpointable"] for r in group):
            kept += m.tokens * m.mc.hidden_size * m.precision.act
            recompute = max(recompute, sum(m.full_bytes(r) for r in group))
        else:
            kept += sum(m.full_bytes(r) for r in group)
    return kept, recompute


def optimizer_state(m, hw, rows, shards):
    """(bytes of optimizer state, Newton-Schulz seconds a step) of a rank holding
    ``rows``, its non-expert and routed-expert state cut into ``shards``. Adam (and
    Muon's auxiliary Adam): Precision.optimizer per parameter. DeepSpeed's Muon
    (ds_ext/muon.py): muon_state_bytes per orthogonalised element and
    newton_schulz_flops per matrix at the GPU's rate; under ZeRO each rank holds every
    Muon matrix its partition touches whole (momentum, staged copy, the update), so in
    each Muon parameter group (non-expert, routed-expert) at most the two matrices cut
    by its partition's ends are counted whole on top."""
    from ds_ext.muon import muon_state_bytes, newton_schulz_flops, uses_muon
    p = m.precision
    held = {True: sum(r["experts"] for r in rows)}
    held[False] = sum(r["params"] for r in rows) - held[True]
    if not uses_muon(m.cfg.ds):
        return p.optimizer * (held[False] / shards[0] + held[True] / shards[1]), 0.0
    mats = {f: [x for r in rows for x in r["muon"][f]] for f in (True, False)}
    muon = {f: sum(a * b for a, b in mats[f]) for f in (True, False)}
    per = muon_state_bytes(zero=p.zero_stage, grad_bytes=p.grad, mixed=p.weight == 2)
    state = sum((p.optimizer * (held[f] - muon[f]) + per * muon[f]) / shards[int(f)] for f in (False, True))
    flops = sum(sum(newton_schulz_flops(a, b) for a, b in mats[f]) / shards[int(f)] for f in (False, True))
    if p.zero_stage >= 1 and max(shards) > 1:
        whole = [x for f in (True, False) if shards[int(f)] > 1
                 for x in sorted(((a * b, newton_schulz_flops(a, b)) for a, b in mats[f]), reverse=True)[:2]]
        state += sum(n for n, _ in whole) * 2 * p.grad
        flops += sum(f for _, f in whole)
    return state, flops / hw.flops


def stage_memories(m, hw, *, bounds, sim):
    """(per pipeline rank its StageMemory, per rank {True: routed-expert, False: other}
    (rows, cols) of its 2-D+ tensors) for the cut at ``bounds`` and the simulated step
    ``sim`` (its timeline gives the activations alive at once)."""
    from ds_ext.pipe.partition import rank_layers

    from .timeline import peak_bytes
    lay, p, mc = m.layout, m.precision, m.mc
    pp, dp = lay.pipe_stages, lay.data_parallel
    chunks = [m.rows[bounds[c]:bounds[c + 1]] for c in range(m.parts)]
    kept = [chunk_activations(m, rows) for rows in chunks]
    peak_full = peak_bytes(sim.timeline, [sum(m.full_bytes(r) for r in rows) for rows in chunks])
    peak_kept = peak_bytes(sim.timeline, [k for k, _ in kept])
    stages, stage_matrices = [], []
    for rank, held in enumerate(rank_layers(m.specs, bounds=bounds, schedule=m.section.schedule, stages=pp)):
        owned = m.sched.rank_chunks(rank=rank, stages=pp)
        rows = [m.rows[i] for i in held]
        params = sum(r["params"] for r in rows)
        experts = sum(r["experts"] for r in rows)
        shards = (dp, max(dp // m.ep, 1)) if p.zero_stage >= 1 else (1, 1)
        head_logits = m.tokens * mc.vocab_size * p.act if any(m.is_logits(r) for r in rows) else 0
        recompute = max(kept[c][1] for c in owned)
        stage_matrices.append({flag: [x for r in rows for x in r["matrices"][flag]] for flag in (True, False)})
        optimizer, muon_seconds = optimizer_state(m, hw, rows, shards)
        stages.append(StageMemory(
            rank=rank, layers=[(bounds[c], bounds[c + 1]) for c in owned], params=params, expert_params=experts,
            weights=params * p.weight, gradients=params * p.grad,
            optimizer=optimizer, muon_seconds=muon_seconds,
            activations=peak_full[rank] + head_logits,
            activations_checkpointed=peak_kept[rank] + recompute + head_logits,
            buffers=p.bucket + hw.reserve_gb * GB, checkpointing=m.interval > 0, in_flight=sim.peak_activations[rank]))
    return stages, stage_matrices


def check_fits(plan):
    """ConfigError naming the first rank that does not fit, with its numbers."""
    cap = plan.hardware.memory_gb * GB
    for st in plan.stages:
        if st.total > cap:
            act = st.activations_checkpointed if st.checkpointing else st.activations
            hint = ("enable activation checkpointing (pipeline.activation_checkpoint_interval: 1), " if not st.checkpointing
                    else "")
            if st.comm_state:
                hint += ("keep less compression state (seekspeed.comm: " + ", ".join(
                    f"{k} {v / GB:.1f}" for k, v in st.comm_state_parts.items())
                    + ("; target 'gradient' keeps no local momentum" if "local momentum" in st.comm_state_parts
                       else "") + "), ")
            raise ConfigError(
                f"pipeline rank {st.rank} needs {st.total / GB:.1f} GB of the {plan.hardware.memory_gb:g} GB on a "
                f"{plan.hardware.name} (weights {st.weights / GB:.1f}, gradients {st.gradients / GB:.1f}, optimizer "
                f"{st.optimizer / GB:.1f}, activations {act / GB:.1f} at the schedule's peak, "
                f"buffers {st.buffers / GB:.1f}"
                + (f", comm state {st.comm_state / GB:.1f}" if st.comm_state else "")
                + f"): {hint}add pipeline stages, "
                f"{'use ZeRO stage 1, ' if plan.zero_stage == 0 else 'add data-parallel ranks (ZeRO shards the optimizer over them), '}"
                f"or lower train_micro_batch_size_per_gpu")
