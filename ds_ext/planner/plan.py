"""``make_plan``: the planner's stages run in order for one config on one cluster
(the cost model: ds_ext/planner/__init__.py)."""

from dataclasses import asdict, dataclass, field

from .hardware import GB, Hardware, cut_hardware


@dataclass(kw_only=True)
class Plan:
    config: str
    schedule: str
    nodes: int
    ranks_per_node: int
    layout: dict
    placement: str
    hardware: Hardware
    stages: list               # [StageMemory]
    traffic: list              # [GroupTraffic]
    compressor: str
    chunk_costs: dict          # seconds per micro-batch: F, B, W per layer chunk (virtual stage), p2p
    makespan: float            # the pipeline part of the step (simulator)
    bubble: float
    busy: float
    dp_seconds: float          # the gradient reduction the step waits for (exposed)
    optimizer_seconds: float
    step_seconds: float
    tokens_per_step: int
    fits: bool
    total_params: int
    zero_stage: int
    comm_target: str = "gradient"
    warmup_steps: int = 0      # dense optimizer steps before the compressed ones (the dense columns)
    dp_total_seconds: float = 0.0      # the gradient reduction's own time, overlapped or not
    overlap_grad_reduce: bool = False  # seekspeed.overlap_grad_reduce: each chunk reduces after its last B/W
    partition: str = ""        # pipeline.partition as configured ("balanced": cut from layer_seconds)
    bounds: list = field(default_factory=list)          # the layer cut into virtual stages
    layer_seconds: list = field(default_factory=list)   # per layer spec: F + B + W seconds per micro-batch
    notes: list = field(default_factory=list)
    # per rank: {True: routed-expert, False: other} (rows, cols) of the 2-D+ tensors (not in to_json)
    matrices: list = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self):
        return self.tokens_per_step / self.step_seconds

    def to_json(self):
        out = {k: v for k, v in asdict(self).items() if k not in ("stages", "traffic", "hardware", "matrices")}
        out.update(hardware=asdict(self.hardware), stages=[s.to_json() for s in self.stages],
                   traffic=[asdict(t) for t in self.traffic], tokens_per_s=self.tokens_per_s,
                   bubble_fraction=self.bubble / self.makespan if self.makespan else 0.0)
        return out


def _cut(m, hw, *, ranks_per_node):
    """(the layer boundaries, the Costed on ``hw``). ``pipeline.partition: "balanced"``:
    placement and link classes from the recipe's default cut, then the cut with the least
    compute on the busiest rank (balanced_cut), costed on the figures the run cuts by
    (cut_hardware), whatever this plan's hardware; otherwise DeepSpeed's method."""
    from ds_ext.pipe.partition import balanced_cut, partition

    from .costs import cost_layers
    from .model import partition_method
    s, balanced = m.section, m.method == "balanced"
    method = m.recipe.default_partition if balanced else partition_method(m.cfg.ds, m.recipe)
    bounds = [int(b) for b in partition(m.specs, num_parts=m.parts, method=method)]
    costed = cost_layers(m, hw, ranks_per_node=ranks_per_node, bounds=bounds)
    if balanced:
        cut_hw = cut_hardware(s.topology, ranks_per_node)
        basis = costed if hw == cut_hw else cost_layers(m, cut_hw, ranks_per_node=ranks_per_node, bounds=bounds)
        bounds = balanced_cut(basis.seconds, schedule=s.schedule, stages=m.layout.pipe_stages)
    return bounds, costed


def make_plan(config, *, nodes, ranks_per_node, hardware=None, checkpoint_interval=None):
    """The plan for ``config`` (a path, or a RunConfig loaded for this world size) on
    ``nodes`` x ``ranks_per_node`` GPUs. ``checkpoint_interval`` overrides the config's
    pipeline.activation_checkpoint_interval. With ``pipeline.partition: "balanced"`` the
    layers are cut from the per-layer costs (``_cut``), and the plan is made for that cut."""
    from ds_ext.config import RunConfig, load_config

    from . import notes as note
    from .memory import stage_memories
    from .model import plan_model
    from .reductions import (GroupTraffic, a2a_traffic, exposed_reduction, optimizer_seconds, pipeline_traffic,
                             stage_reductions)
    from .timeline import a2a_per_step, chunk_sums, simulate_cut
    hw = hardware or Hardware()
    cfg = config if isinstance(config, RunConfig) else load_config(config, world_size=nodes * ranks_per_node)
    m = plan_model(cfg, checkpoint_interval=checkpoint_interval)
    s, lay, comm = m.section, m.layout, m.section.comm
    overlap = s.resolve_overlap(has_moe=m.has_moe)
    bounds, costed = _cut(m, hw, ranks_per_node=ranks_per_node)
    sums = chunk_sums(costed.costs, bounds, parts=m.parts, overlap=overlap)
    sim = simulate_cut(m, sums, comm=costed.p2p)
    no_p2p = simulate_cut(m, sums, comm=0.0)
    stages, stage_matrices = stage_memories(m, hw, bounds=bounds, sim=sim)
    reductions = stage_reductions(m, hw, stages, stage_matrices, costed.placement)
    groups = [GroupTraffic(group="data-parallel", members=lay.data_parallel,
                           **max(reductions, key=lambda g: g["seconds_compressed"])),
              pipeline_traffic(m, costed, seconds=sim.makespan - no_p2p.makespan)]
    flight = charged = 0.0
    if costed.a2a.layer_bytes:
        flight, charged = a2a_per_step(sim.timeline, fb_cost=sums["FB"], **{
            k: sums[k] for k in ("a2a_f", "a2a_b", "exposed_f", "exposed_b", "compute_f", "compute_b")})
        groups.append(a2a_traffic(m, costed, bounds=bounds, charged=charged))
    key = "seconds_compressed" if comm.compressor != "none" else "seconds"
    dp_seconds, dp_total = exposed_reduction(m, stages, reductions, bounds=bounds, sim=sim, key=key)
    opt_seconds = optimizer_seconds(m, hw, stages, costed.placement)
    for st, b in zip(stages, sim.busy):
        st.busy = b
    notes = (note.expert_notes(m, hw, costed, flight=flight, charged=charged, overlap=overlap)
             + note.comm_notes(m, stages, reductions) + note.balance_notes(sim.busy)
             + note.optimizer_notes(m, hw, stages))
    return Plan(config=cfg.path, schedule=s.schedule, nodes=nodes, ranks_per_node=ranks_per_node,
                layout=vars(lay) | {"tokens_per_step": lay.tokens_per_step}, placement=costed.placement.name,
                hardware=hw, stages=stages, traffic=groups, compressor=comm.compressor,
                chunk_costs={"F": sums["F"], "B": sums["B"], "W": sums["W"] if m.sched.zero_bubble else 0.0,
                             "p2p": costed.p2p},
                makespan=sim.makespan, bubble=sim.bubble, busy=max(sim.busy), dp_seconds=dp_seconds,
                dp_total_seconds=dp_total, overlap_grad_reduce=bool(getattr(s, "overlap_grad_reduce", False)),
                optimizer_seconds=opt_seconds, step_seconds=sim.makespan + dp_seconds + opt_seconds,
                tokens_per_step=lay.tokens_per_step, fits=all(st.total <= hw.memory_gb * GB for st in stages),
                total_params=m.unique_params, zero_stage=m.precision.zero_stage, comm_target=comm.target,
                warmup_steps=comm.warmup_steps if comm.compressor != "none" else 0, notes=notes,
                matrices=stage_matrices, partition=m.method, bounds=bounds, layer_seconds=costed.seconds)
