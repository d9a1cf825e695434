"""The planner's cost model: memory per pipeline rank, bytes per link class, the
pipeline bubble and a predicted step time for a config, without a GPU.

Parameters come from the recipe's layer specs built on the meta device, cut into
stages by DeepSpeed's own partitioning code (recipes.layers.pipe); the schedule's
bubble and in-flight activations come from the pipeline simulator (ds_ext.pipe.simulate),
which runs the very instruction streams the engines run.

Memory per rank (bytes):
- weights: parameters x 2 (bf16/fp16) or 4 (fp32);
- gradients: parameters x 4 when gradients accumulate in fp32 (fp32 training, or
  ``data_types.grad_accum_dtype: fp32``), else x 2;
- optimizer: Adam's two moments (8 bytes) plus an fp32 master copy (4) in mixed
  precision, divided by the data-parallel degree under ZeRO stage >= 1 (routed
  experts: by their own expert-data-parallel degree);
- activations: what autograd keeps per token of each layer (the recipe's
  ``PlannerCosts.activation_bytes``, recipes/spec.py; for recipes/layers' classes
  recipes/layers/costs.py, checked against the real layers in tests/test_plan.py)
  times the micro-batches the schedule holds at its peak (from the simulator); with DeepSpeed's activation
  checkpointing only each layer's input is kept, plus one layer's full activations
  while it is recomputed;
- buffers: ZeRO's reduce bucket (``reduce_bucket_size`` fp32 elements) and a fixed
  reserve for the CUDA context, NCCL and allocator fragmentation;
- comm state (``seekspeed.comm``, any compressor but ``none``): what the compressed
  reduction keeps between steps, from ``ds_ext.comm.traffic.state_bytes``: the reducer's
  flat fp32 copy of the gradient, the error-feedback residuals (full size, fp32; the
  two-phase compressors' server residual 1/W of it), and with ``target: "momentum"`` a
  full fp32 local momentum per rank (ZeRO 1 partitions only the optimizer's own).

Time per optimizer step: the simulator's makespan for per-chunk costs F (forward),
B (backward: 2F, plus F recomputed under activation checkpointing), W (the weight
gradient part) and the point-to-point transfer of one micro-batch, summed from each
layer's own cost (``layer_cost`` in make_plan: matmul FLOPs at the GEMM rate, FP8's with
``fp8_tflops``; the recipe's attention FLOPs (``PlannerCosts.attention_flops``: MLA's
S^2 terms, a sparse attention's indexer and selected keys); the memory-bound passes at ``hbm_gbps``: kept
activations, the embedding's rows, the head's logits), plus the data-parallel gradient
reduction (ds_ext/profile/collectives.py: NCCL's ring or tree over the node's rails and
NVLink, or the compressor's collectives and payload, ds_ext/comm/traffic.py: sign and
int4 an all-to-all then an all-gather of the segments; hierarchical: dense inside the
node, the rails across; routed experts' gradients always flat, as install.py reduces
them) after the drain, or with ``seekspeed.overlap_grad_reduce`` each chunk's from its
last backward and W on (only what is left after the pipeline counts), plus the optimizer
step (memory bound; under ZeRO 1 with the all-gather of the updated weights over the
data-parallel groups). With ``warmup_steps`` the compressed figures are those after the
dense warm-up (a note gives the warm-up's). ``pipeline.partition: "balanced"`` cuts the
layers from those per-layer costs (recipes.layers.pipe.balanced_cut), costed on the
config's own figures (``cut_hardware``) so every plan shows the cut the run makes.

Expert all-to-all (expert parallelism > 1): each MoE layer moves the routed tokens'
hidden states out and back (dispatch, combine), forward and backward, over the links
its expert-parallel group spans. A chunk is charged only what no compute covers: the
dispatch less the shared expert's time (its backward: twice that), the combine in
full; with ``seekspeed.overlap: "layer"`` an F&B chunk whose two halves both hold MoE
layers is charged max(0, each half's remaining all-to-all - the other half's compute),
from the chunk's totals (not layer by layer, so it is optimistic where one layer's
all-to-all is longer than the other half's compute between two switches).
"""

from dataclasses import asdict, dataclass, field

from ds_ext.errors import ConfigError

GB = 1e9


@dataclass(kw_only=True)
class Hardware:
    """A GPU, its node and its links. Defaults: NVIDIA H800 SXM (80 GB HBM3, 989 dense
    bf16 TFLOP/s) in a node as DeepSeek-V3's cluster had them: 8 GPUs on NVLink and
    NVSwitch (400 GB/s both directions per GPU, 200 one way), one 400 Gb/s ConnectX-7
    InfiniBand NIC per GPU (DeepSeek-V3 technical report, arXiv 2412.19437 section 3.1;
    DeepEP's README: "H800 (~160 GB/s NVLink maximum bandwidth), with each connected to
    a CX7 InfiniBand 400 Gb/s RDMA network card (~50 GB/s maximum bandwidth)").
    Bandwidths are line rates, one way; the efficiencies are what NCCL achieves of them
    (ds_ext/profile/collectives.py says where each comes from)."""
    name: str = "H800"
    memory_gb: float = 80.0
    reserve_gb: float = 4.0         # CUDA context, NCCL buffers, allocator fragmentation
    peak_tflops: float = 989.0
    efficiency: float = 0.4         # achieved / peak on the model's matmuls (MFU)
    hbm_gbps: float = 3350.0        # GB/s, for the optimizer step
    # node and links
    gpus_per_node: int = 8
    nics_per_node: int = 8          # one rail each
    intra_gbps: float = 200.0       # NVLink GB/s one way per GPU
    inter_gbps: float = 50.0        # GB/s one way per NIC (400 Gb/s)
    nvlink_efficiency: float = 0.8      # rings and trees: NCCL's own 20.6 of 25 GB/s per Hopper link
    nvlink_a2a_efficiency: float = 0.67  # all-to-all: DeepEP's intranode EP8 dispatch, 153 GB/s on H800
    nic_efficiency: float = 0.94        # NVIDIA: 46-48 GB/s per 400 Gb/s NIC through NCCL
    latency_us: float = 10.0        # per point-to-point transfer
    # dense FP8 GEMM TFLOP/s (H800: 1,979), for a run whose weight matmuls are FP8 elsewhere: those
    # FLOPs then run at fp8_tflops x efficiency; attention's S^2 terms and memory stay as in bf16
    fp8_tflops: float | None = None
    nvlink_latency_us: float = 1.0  # per collective algorithm step inside a node
    nic_latency_us: float = 5.0     # per collective algorithm step between nodes

    def __post_init__(self):
        flags = {"gpus_per_node": "--gpus-per-node", "nics_per_node": "--nics-per-node",
                 "intra_gbps": "--intra-gbps", "inter_gbps": "--nic-gbps (--inter-gbps)"}
        for name in ("gpus_per_node", "nics_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flags[name]} {getattr(self, name)}: a node needs at least one; pass the count "
                                  f"per node (8 GPUs and 8 NICs on an HGX H100/H800)")
        for name in ("intra_gbps", "inter_gbps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{flags[name]} {getattr(self, name)}: give the link's GB/s one way, above 0 "
                                  f"(400 Gb/s is 50)")
        for name in ("nvlink_efficiency", "nvlink_a2a_efficiency", "nic_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"Hardware {name} {getattr(self, name)}: an achieved fraction of the line rate, "
                                  f"in (0, 1]")

    @property
    def flops(self):
        return self.peak_tflops * 1e12 * self.efficiency

    @property
    def gemm_flops(self):
        """FLOP/s of the weight matmuls: FP8's when given."""
        return (self.fp8_tflops if self.fp8_tflops else self.peak_tflops) * 1e12 * self.efficiency

    def fabric(self):
        """The node's links for ds_ext/profile/collectives.py."""
        from ds_ext.profile.collectives import Fabric
        return Fabric(gpus_per_node=self.gpus_per_node, nics_per_node=self.nics_per_node, nic_gbps=self.inter_gbps,
                      nvlink_gbps=self.intra_gbps, nic_efficiency=self.nic_efficiency,
                      nvlink_efficiency=self.nvlink_efficiency, nvlink_a2a_efficiency=self.nvlink_a2a_efficiency,
                      nic_latency_us=self.nic_latency_us, nvlink_latency_us=self.nvlink_latency_us)


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
    busy: float = 0.0          # seconds a step this rank computes (the simulator's ops; idle and waits excluded)
    reduce_seconds: float = 0.0   # this rank's data-parallel gradient reduction on its own (not overlapped)

    @property
    def total(self):
        return (self.weights + self.gradients + self.optimizer + self.buffers + self.comm_state
                + (self.activations_checkpointed if self.checkpointing else self.activations))

    def to_json(self):
        return asdict(self) | {"total": self.total}


@dataclass(kw_only=True)
class GroupTraffic:
    group: str                 # "data-parallel", "pipeline", "expert all-to-all"
    members: int
    intra_bytes: float         # per step, summed over the group's links inside nodes
    inter_bytes: float
    intra_bytes_compressed: float
    inter_bytes_compressed: float
    seconds: float             # what the step waits for, dense
    seconds_compressed: float


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


# ---- per-layer figures --------------------------------------------------------------

def _layer_figures(specs, config, recipe):
    """Per spec: the recipe's kind for it, whether DeepSpeed checkpoints it (its class
    is in the recipe's checkpointable_layers), parameters, routed-expert parameters,
    activated parameters (built once per distinct layer on the meta device)."""
    import torch
    from recipes.layers.moe import DeepSeekMoE
    from recipes.layers.pipe import activated_parameters
    cache, rows = {}, []
    kinds = recipe.layer_kinds(specs, config)
    for spec, kind in zip(specs, kinds):
        key = (spec.typename.__name__, kind, getattr(spec, "forward_fn", None))
        if key not in cache:
            with torch.device("meta"):
                module = spec.build()
            expert_ids = {id(p) for m in module.modules() if isinstance(m, DeepSeekMoE) for p in m.experts.parameters()}
            matrices = {True: [], False: []}      # routed expert or not -> (rows, cols) of each 2-D+ tensor
            for p in module.parameters():
                if p.dim() >= 2:
                    matrices[id(p) in expert_ids].append((p.shape[0], p.numel() // p.shape[0]))
            experts = sum(p.numel() for p in module.parameters() if id(p) in expert_ids)
            cache[key] = (sum(p.numel() for p in module.parameters()), experts, activated_parameters([spec]), matrices)
        params, experts, active, matrices = cache[key]
        rows.append({"kind": kind, "checkpointable": spec.typename.__name__ in recipe.checkpointable_layers,
                     "params": params, "experts": experts, "active": active, "matrices": matrices})
    return rows


# ---- the plan ------------------------------------------------------------------------

def nodes_from_hostfile(path, *, include="", exclude="", num_nodes=None, num_gpus=None):
    """(nodes, GPUs per node) of DeepSpeed hostfile ``path`` after the launcher's --include,
    --exclude, --num_nodes and --num_gpus (DeepSpeed's own parser and filters)."""
    import os

    from ds_ext.topology.hostfile import active_resources, read_hostfile
    if not os.path.isfile(path):
        raise ConfigError(f"--hostfile {path} does not exist; pass a DeepSpeed hostfile ('host slots=N' per line) "
                          f"or --nodes and --gpus-per-node")
    active = active_resources(read_hostfile(path, what="--hostfile"), include=include, exclude=exclude,
                              num_nodes=num_nodes, num_gpus=num_gpus, path=path)
    counts = {host: len(slots) for host, slots in active.items()}
    if len(set(counts.values())) != 1:
        by_count = {}
        for host, n in counts.items():
            by_count.setdefault(n, []).append(host)
        shown = "; ".join(f"{n} GPUs on {', '.join(hosts[:3])}{', ...' if len(hosts) > 3 else ''}"
                          for n, hosts in sorted(by_count.items()))
        raise ConfigError(f"{path}: the nodes used have different GPU counts ({shown}); the planner assumes equal "
                          f"nodes: select equal ones with --include/--exclude or --num_gpus")
    return len(counts), next(iter(counts.values()))




def gradient_bytes(ds):
    """Bytes per parameter DeepSpeed keeps for gradients. bf16 with fp32 accumulation
    under ZeRO-1 runs DeepSpeed's BF16_Optimizer: the bf16 ``param.grad`` stays
    allocated (unless ``bf16.immediate_grad_update``) next to a full fp32 accumulation
    buffer; other bf16/fp16 setups keep low-precision gradients; fp32 keeps fp32."""
    from ds_ext.config import fp32_grad_accumulation, mixed_precision
    if not mixed_precision(ds):
        return 4
    if ds.get("bf16", {}).get("enabled", False) and fp32_grad_accumulation(ds):
        return 4 + (0 if ds["bf16"].get("immediate_grad_update", False) else 2)
    return 2


def cut_hardware(topology, ranks_per_node):
    """The figures ``pipeline.partition: "balanced"`` costs layers with, in the run and
    in every plan of it: seekspeed.topology's compute_tflops (sustained, so efficiency
    1), memory_gbps and link speeds (one NIC per rank); the rest Hardware's defaults."""
    return Hardware(peak_tflops=topology.compute_tflops, efficiency=1.0, hbm_gbps=topology.memory_gbps,
                    gpus_per_node=ranks_per_node, nics_per_node=ranks_per_node, intra_gbps=topology.intra_node_gbps,
                    inter_gbps=topology.inter_node_gbps)


def make_plan(config, *, nodes, ranks_per_node, hardware=None, checkpoint_interval=None):
    """The plan for ``config`` (a path, or a RunConfig loaded for this world size) on
    ``nodes`` x ``ranks_per_node`` GPUs. ``checkpoint_interval`` overrides the config's
    pipeline.activation_checkpoint_interval. With ``pipeline.partition: "balanced"`` the
    layers are cut from the per-layer costs below (``balanced_cut``), and the plan is
    made for that cut."""
    from ds_ext.comm.traffic import chunk_numel, payload_bytes, state_bytes
    from ds_ext.config import RunConfig, fp32_grad_accumulation, load_config, mixed_precision
    from ds_ext.pipe import schedule_spec
    from ds_ext.pipe.simulate import simulate
    from ds_ext.topology.placement import choose, rank_of
    from ds_ext.topology.setup import estimate_traffic
    from ds_ext.trainer import _partition_method
    from recipes import get_recipe
    from recipes.layers.pipe import balanced_cut, held_once, partition, rank_layers

    hw = hardware or Hardware()
    cfg = config if isinstance(config, RunConfig) else load_config(config, world_size=nodes * ranks_per_node)
    config_path = cfg.path
    s, lay, ds = cfg.section, cfg.layout, cfg.ds
    recipe = get_recipe(s.recipe.name)
    mc = recipe.make_config(s.recipe.preset, s.recipe.overrides)
    recipe.check_stages(mc, stages=lay.pipe_stages, schedule=s.schedule)
    options = recipe.train_options(s)
    ep, dp, pp = s.moe.expert_parallel_size, lay.data_parallel, lay.pipe_stages
    interval = (ds.get("pipeline", {}).get("activation_checkpoint_interval", 0) if checkpoint_interval is None
                else checkpoint_interval)
    mixed = mixed_precision(ds)
    a = w_bytes = 2 if mixed else 4
    g_bytes = gradient_bytes(ds)
    reduce_bytes = 4 if fp32_grad_accumulation(ds) else 2      # what the data-parallel reduction moves
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    opt_bytes = 8 + (4 if mixed else 0)       # Adam moments, plus fp32 master weights in mixed precision
    bucket = ds.get("zero_optimization", {}).get("reduce_bucket_size", 5e8) * 4 if zero >= 1 else 0
    tokens, h = lay.micro_batch * lay.seq_len, mc.hidden_size

    # Layers: parameters held (this rank's experts only) and compute (every routed expert
    # a token picks, wherever it lives: from the unsharded build).
    specs = recipe.layer_specs(mc, seed=0, ep_size=ep, ep_rank=0, **options)
    figures = _layer_figures(specs, mc, recipe)
    full_specs = specs if ep == 1 else recipe.layer_specs(mc, seed=0, **options)
    full = figures if ep == 1 else _layer_figures(full_specs, mc, recipe)
    for row, whole in zip(figures, full):
        row["active"] = whole["active"]
    sched = schedule_spec(s.schedule)
    parts = sched.virtual_stages(pp)
    method = ds.get("pipeline", {}).get("partition", "best")
    balanced = method == "balanced"
    # balanced: placement and link classes from the recipe's default cut, then the cut from the costs
    bounds = [int(b) for b in partition(specs, num_parts=parts, method=recipe.default_partition if balanced
                                        else _partition_method(ds, recipe))]
    chunks = [figures[bounds[p]:bounds[p + 1]] for p in range(parts)]

    def full_bytes(r):
        return tokens * recipe.planner.activation_bytes(mc, r["kind"], seq_len=lay.seq_len, act_bytes=a, **options)

    ckpt_k = interval if interval > 0 else 1     # the "with checkpointing" column when it is off: every layer

    def chunk_activations(rows):
        """(bytes kept per micro-batch, bytes of the largest recomputed group) with
        checkpointing: DeepSpeed checkpoints each run of ``ckpt_k`` layers whose layers
        are all checkpointable, keeping its input; other layers keep everything."""
        kept = recompute = 0
        for i in range(0, len(rows), ckpt_k):
            group = rows[i:i + ckpt_k]
            if all(r["checkpointable"] for r in group):
                kept += tokens * h * a
                recompute = max(recompute, sum(full_bytes(r) for r in group))
            else:
                kept += sum(full_bytes(r) for r in group)
        return kept, recompute

    # Placement (as the trainer chooses it) and where each group's links run.
    rank_params = max(sum(r["params"] for p in sched.rank_chunks(rank=rank, stages=pp) for r in chunks[p])
                      for rank in range(pp))        # what the trainer's placement choice is given
    traffic = estimate_traffic(model_config=mc, layout=lay, ds=ds, stage_params=rank_params, ep=ep,
                               compute_tflops=hw.flops / 1e12)
    placement = s.topology.placement
    if placement == "auto":
        placement = choose(pp=pp, dp=dp, ep=ep, moe=mc.num_moe_layers() > 0, traffic=traffic,
                           ranks_per_node=ranks_per_node, intra_gbps=hw.intra_gbps, inter_gbps=hw.inter_gbps)[0].placement

    def node(stage, data):
        return rank_of(placement, stage=stage, data=data, pp=pp, dp=dp) // ranks_per_node

    # Per-chunk costs (seconds per micro-batch) for the simulator. The all-to-all is
    # charged only where no compute covers it (see _a2a_costs).
    a2a_layer = 0.0            # one MoE layer's dispatch + combine for one micro-batch, one pass
    a2a_bw = hw.fabric().nvlink(a2a=True)
    a2a_cost = None            # one dispatch as NCCL's all-to-all over the group's nodes (collectives.py)
    if ep > 1 and mc.num_moe_layers():
        from ds_ext.profile.collectives import all_to_all
        ep_nodes = [node(0, d) for d in range(ep)]
        sent = tokens * mc.num_experts_per_tok * h * a          # every routed copy of a token, self included
        a2a_cost = all_to_all(sent, nodes=len(set(ep_nodes)), per_node=max(map(ep_nodes.count, ep_nodes)),
                              fabric=hw.fabric())
        a2a_layer = 2 * sent * (ep - 1) / ep
        a2a_bw = a2a_layer / 2 / a2a_cost.seconds
    recompute_passes = 1 if interval > 0 else 0
    overlap = s.resolve_overlap(has_moe=mc.num_moe_layers() > 0)
    shared_forward = 2 * tokens * 3 * h * mc.moe_intermediate_size * mc.n_shared_experts / hw.gemm_flops
    zb = sched.zero_bubble
    logits = tokens * mc.vocab_size

    def layer_cost(row):
        """Seconds per micro-batch of one layer: compute at hw.flops (2 FLOPs per
        activated parameter and token, causal attention's S^2 terms), the memory-bound
        passes at hw.hbm_gbps: the activations autograd keeps (the elementwise work:
        norms, RoPE, SwiGLU, softmax) written by the forward, read and their gradients
        written by the backward, the embedding's rows gathered and their fp32 gradients
        scattered, the head's logits written and read by the fp32 log-softmax and their
        fp32 gradient; and the expert all-to-all no compute covers (_a2a_costs)."""
        attention = recipe.planner.attention_flops(mc, row["kind"], seq_len=lay.seq_len, **options)
        weights = 2 * tokens * row["active"]
        kept = full_bytes(row) if row["checkpointable"] else 0.0
        forward = weights / hw.gemm_flops + tokens * attention / hw.flops + kept / (hw.hbm_gbps * GB)
        backward = (2 + recompute_passes) * forward
        if row["kind"] == "embed":
            forward += tokens * h * a / (hw.hbm_gbps * GB)
            backward += tokens * h * 4 / (hw.hbm_gbps * GB)
        elif row["kind"] == "head":
            forward += logits * (2 * a + 4) / (hw.hbm_gbps * GB)
            backward += logits * (4 + a) / (hw.hbm_gbps * GB)
        cost = _a2a_costs(moe_layers=1 if row["kind"].endswith("moe") else 0, dispatch=a2a_layer / 2 / a2a_bw,
                          shared_forward=shared_forward, recompute_passes=recompute_passes)
        return {"compute_f": forward, "compute_b": backward, "a2a_f": cost["forward"], "a2a_b": cost["backward"],
                "exposed_f": cost["forward_exposed"], "exposed_b": cost["backward_exposed"],
                "W": weights / hw.gemm_flops if zb else 0.0}

    costs = [layer_cost(row) for row in figures]
    for row, c in zip(figures, costs):
        row["seconds"] = c["compute_f"] + c["exposed_f"] + c["compute_b"] + c["exposed_b"] + c["W"]
    p2p_bytes = tokens * h * a * (2 if mc.num_mtp_layers else 1)
    pipe_cross = any(node(st, 0) != node(st + 1, 0) for st in range(pp - 1))
    p2p = p2p_bytes / ((hw.inter_gbps if pipe_cross else hw.intra_gbps) * GB) + hw.latency_us * 1e-6

    def pipeline(cut, comm=p2p):
        """The per-chunk costs of the cut at ``cut`` and the simulated step."""
        sums = {key: [sum(costs[i][key] for i in range(cut[p], cut[p + 1])) for p in range(parts)]
                for key in ("compute_f", "compute_b", "a2a_f", "a2a_b", "exposed_f", "exposed_b", "W")}
        sums["F"] = [sums["compute_f"][p] + sums["exposed_f"][p] for p in range(parts)]
        sums["B"] = [sums["compute_b"][p] + sums["exposed_b"][p] for p in range(parts)]

        def fb_cost(sf, sb):
            """An F&B chunk: interleaved (overlap "layer"), each half's all-to-alls run
            while the other half computes, when both halves have some; counted from the
            chunk's totals, not layer by layer."""
            if overlap != "layer" or not (sums["a2a_f"][sf] and sums["a2a_b"][sb]):
                return sums["F"][sf] + sums["B"][sb]
            return (sums["compute_f"][sf] + sums["compute_b"][sb] + max(0.0, sums["exposed_f"][sf] - sums["compute_b"][sb])
                    + max(0.0, sums["exposed_b"][sb] - sums["compute_f"][sf]))
        sums["FB"] = fb_cost
        return sums, simulate(s.schedule, ranks=pp, micro_batches=lay.grad_accum, F=sums["F"], B=sums["B"],
                              W=sums["W"] if zb else 0.0, FB=fb_cost, comm=comm)

    if balanced:
        # the cut with the least compute on the busiest rank (recipes.layers.pipe.balanced_cut),
        # costed on the figures the run cuts by (cut_hardware), whatever this plan's hardware
        cut_hw = cut_hardware(s.topology, ranks_per_node)
        bounds = (balanced_cut([row["seconds"] for row in figures], schedule=s.schedule, stages=pp) if hw == cut_hw
                  else make_plan(cfg, nodes=nodes, ranks_per_node=ranks_per_node, hardware=cut_hw,
                                 checkpoint_interval=checkpoint_interval).bounds)
        chunks = [figures[bounds[p]:bounds[p + 1]] for p in range(parts)]
    sums, sim = pipeline(bounds)
    no_p2p = pipeline(bounds, comm=0.0)[1]
    compute_f, compute_b, a2a_f, a2a_b, exposed_f, exposed_b = (
        sums[k] for k in ("compute_f", "compute_b", "a2a_f", "a2a_b", "exposed_f", "exposed_b"))
    F, B, W, fb_cost = sums["F"], sums["B"], (sums["W"] if zb else 0.0), sums["FB"]

    # Memory per pipeline rank.
    kept = [chunk_activations(rows) for rows in chunks]
    peak_full = _peak_bytes(sim.timeline, [sum(full_bytes(r) for r in rows) for rows in chunks])
    peak_kept = _peak_bytes(sim.timeline, [k for k, _ in kept])
    stages, stage_matrices = [], []
    for rank, held in enumerate(rank_layers(specs, bounds=bounds, schedule=s.schedule, stages=pp)):
        owned = sched.rank_chunks(rank=rank, stages=pp)
        rows = [figures[i] for i in held]
        params = sum(r["params"] for r in rows)
        experts = sum(r["experts"] for r in rows)
        shards = (dp, max(dp // ep, 1)) if zero >= 1 else (1, 1)
        head_logits = tokens * mc.vocab_size * a if any(r["kind"] == "head" for r in rows) else 0
        recompute = max(kept[p][1] for p in owned)
        stage_matrices.append({flag: [m for r in rows for m in r["matrices"][flag]] for flag in (True, False)})
        stages.append(StageMemory(
            rank=rank, layers=[(bounds[p], bounds[p + 1]) for p in owned], params=params, expert_params=experts,
            weights=params * w_bytes, gradients=params * g_bytes,
            optimizer=opt_bytes * ((params - experts) / shards[0] + experts / shards[1]),
            activations=peak_full[rank] + head_logits,
            activations_checkpointed=peak_kept[rank] + recompute + head_logits,
            buffers=bucket + hw.reserve_gb * GB, checkpointing=interval > 0, in_flight=sim.peak_activations[rank]))

    # Gradient reduction per stage: dense over the data-parallel group, routed experts
    # over their expert-data-parallel group (always flat: install.py reduces them with
    # hierarchical=False); dense and with the configured compressor. The compression's
    # state per rank from the same groups.
    comm = s.comm
    chunk = chunk_numel(comm.chunk_mb)

    def payload(matrices):
        big = [m for m in matrices if m[0] * m[1] >= comm.min_numel]

        def one(numel, members):
            return payload_bytes(comm.compressor, numel=numel, ratio=comm.ratio, rank=comm.rank,
                                 block_size=comm.resolved_block_size, matrices=big)
        return one, big

    def comm_state(numel, members, *, hierarchical, matrices):
        per_node = {}
        for m in members:
            per_node[m] = per_node.get(m, 0) + 1
        return state_bytes(comm.compressor, numel=numel, nodes=len(per_node), per_node=max(per_node.values()),
                           hierarchical=hierarchical, target=comm.target, error_feedback=comm.error_feedback,
                           momentum=comm.momentum, matrices=payload(matrices)[1], rank=comm.rank, chunk=chunk)
    reductions = []
    for rank, st in enumerate(stages):
        groups_ = [(st.params - st.expert_params, [node(rank, d) for d in range(dp)], comm.hierarchical,
                    stage_matrices[rank][False])]
        if st.expert_params:
            groups_.append((st.expert_params, [node(rank, d) for d in range(0, dp, ep)], False,
                            stage_matrices[rank][True]))
        g, kept_state = None, {}
        for numel, members, hier, matrices in groups_:
            one = _dp_group(numel=numel, grad_bytes=reduce_bytes, members=members, hw=hw, compressor=comm.compressor,
                            hierarchical=hier, payload=payload(matrices)[0])
            g = one if g is None else {k: g[k] + one[k] for k in g}
            for name, b in comm_state(numel, members, hierarchical=hier, matrices=matrices).items():
                kept_state[name] = kept_state.get(name, 0.0) + b
        reductions.append(g)
        st.comm_state_parts, st.comm_state = kept_state, float(sum(kept_state.values()))
    worst = max(reductions, key=lambda g: g["seconds_compressed"])
    groups = [GroupTraffic(group="data-parallel", members=dp, **worst)]
    chain = 2 * lay.grad_accum * p2p_bytes * (pp - 1) * sched.link_passes
    crossing = sum(node(st, 0) != node(st + 1, 0) for st in range(pp - 1)) / max(pp - 1, 1)
    groups.append(GroupTraffic(group="pipeline", members=pp, intra_bytes=chain * (1 - crossing),
                               inter_bytes=chain * crossing, intra_bytes_compressed=chain * (1 - crossing),
                               inter_bytes_compressed=chain * crossing, seconds=sim.makespan - no_p2p.makespan,
                               seconds_compressed=sim.makespan - no_p2p.makespan))
    if a2a_layer:
        # per rank per step: every MoE layer it holds, forward + backward (+ recompute), every micro-batch
        passes = lay.grad_accum * (2 + recompute_passes)
        per_rank = max(sum(1 for p in sched.rank_chunks(rank=r, stages=pp) for row in chunks[p]
                           if row["kind"].endswith("moe")) for r in range(pp)) * passes * a2a_layer
        cross = a2a_cost.inter_bytes / (a2a_cost.inter_bytes + a2a_cost.intra_bytes)
        flight, charged = _a2a_per_step(sim.timeline, fb_cost=fb_cost, a2a_f=a2a_f, a2a_b=a2a_b,
                                        exposed_f=exposed_f, exposed_b=exposed_b, compute_f=compute_f,
                                        compute_b=compute_b)
        groups.append(GroupTraffic(group="expert all-to-all", members=ep, intra_bytes=per_rank * ep * (1 - cross),
                                   inter_bytes=per_rank * ep * cross, intra_bytes_compressed=per_rank * ep * (1 - cross),
                                   inter_bytes_compressed=per_rank * ep * cross, seconds=charged,
                                   seconds_compressed=charged))

    key = "seconds_compressed" if comm.compressor != "none" else "seconds"
    dp_total = max(g[key] for g in reductions)
    for st, g in zip(stages, reductions):
        st.reduce_seconds = g[key]
    overlap_dp = bool(getattr(s, "overlap_grad_reduce", False))
    dp_seconds = dp_total
    if overlap_dp and pp > 1:
        ends = _overlapped_reduction_ends(sim.timeline, schedule=s.schedule, stages=pp, reductions=[
            {p: g[key] * sum(r["params"] for r in chunks[p]) / max(st.params, 1)
             for p in sched.rank_chunks(rank=rank, stages=pp)}
            for rank, (g, st) in enumerate(zip(reductions, stages))])
        dp_seconds = max(0.0, max(ends) - sim.makespan)
    biggest = max(stages, key=lambda st: st.params)
    optimizer_seconds = 2 * (biggest.optimizer + biggest.weights + biggest.gradients / max(dp, 1)) / (hw.hbm_gbps * GB)
    if zero >= 1 and dp > 1:
        # ZeRO 1: each rank steps its shard, then the updated weights are all-gathered over
        # the data-parallel group (routed experts over theirs), on the same links
        from ds_ext.profile.collectives import all_gather

        def gather(numel, members):
            counts = {m: members.count(m) for m in members}
            if numel == 0 or len(members) < 2:
                return 0.0
            return all_gather(numel * w_bytes, nodes=len(counts), per_node=max(counts.values()),
                              fabric=hw.fabric()).seconds
        optimizer_seconds += max(gather(st.params - st.expert_params, [node(rank, d) for d in range(dp)])
                                 + gather(st.expert_params, [node(rank, d) for d in range(0, dp, ep)])
                                 for rank, st in enumerate(stages))
    unique = sum(full[i]["params"] for i in held_once(full_specs, range(len(full_specs))))
    notes = []
    if ep > 1:
        notes.append(f"per-rank counts hold {mc.n_routed_experts // ep} of {mc.n_routed_experts} routed experts "
                     f"per MoE layer (expert parallel {ep})")
    if a2a_layer:
        how = ("and each F&B chunk's behind the other half's compute (overlap layer)" if overlap == "layer" else
               "(overlap none: F&B chunks run their halves one after the other)")
        notes.append(f"expert all-to-all: {flight * 1e3:,.1f} ms per step in flight on the busiest rank, "
                     f"{charged * 1e3:,.1f} ms charged (the wait column): the dispatch hidden behind the shared expert "
                     f"{how}")
        ep_node_count = len(set(ep_nodes))
        if ep_node_count > 1:
            from ds_ext.profile.collectives import moe_dispatch
            limited = mc.topk_group if mc.n_group == ep_node_count and mc.topk_group < mc.n_group else None
            deepep, _ = moe_dispatch(tokens=tokens, token_bytes=h * a, nodes=ep_node_count,
                                     per_node=max(map(ep_nodes.count, ep_nodes)), fabric=hw.fabric(),
                                     num_experts=mc.n_routed_experts, top_k=mc.num_experts_per_tok,
                                     top_groups=limited, forwarding=True)
            notes.append(f"one dispatch {a2a_cost.seconds * 1e3:,.2f} ms as ds_ext/comm/alltoall.py sends it (every "
                         f"routed copy to its rank over {ep_node_count} nodes); forwarded as DeepEP does (a token "
                         f"across once per node" + (f", at most {limited} nodes" if limited else "")
                         + f"; not built here) it would take {deepep.seconds * 1e3:,.2f} ms")
    if comm.compressor != "none":
        dense_s = max(g["seconds"] for g in reductions)
        if comm.warmup_steps:
            notes.append(f"the first {comm.warmup_steps} optimizer steps reduce dense (gradient reduction "
                         f"{dense_s * 1e3:,.1f} ms a step, the dense columns); the step time and the compressed "
                         f"columns are the steps after them, what a long run sees")
        if comm.target == "momentum":
            notes.append(f"target momentum: after the dense warm-up Adam's second moment is frozen and each rank sends "
                         f"its local momentum through {comm.compressor}, the same bytes per step as the gradient; "
                         f"it keeps a full fp32 local momentum of its stage (also under ZeRO 1) and the residuals")
        heavy = max(stages, key=lambda st: st.comm_state)
        if heavy.comm_state:
            notes.append(f"comm state (what the compressed reduction keeps per rank between steps, in the totals): "
                         f"rank {heavy.rank} "
                         + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in heavy.comm_state_parts.items()))
    busy = sim.busy
    for st, b in zip(stages, busy):
        st.busy = b
    if max(busy) > 1.15 * min(busy):
        notes.append("stages are unbalanced: busy " + ", ".join(f"{b * 1e3:.0f}" for b in busy) + " ms per rank")
    return Plan(config=config_path, schedule=s.schedule, nodes=nodes, ranks_per_node=ranks_per_node,
                layout=vars(lay) | {"tokens_per_step": lay.tokens_per_step}, placement=placement, hardware=hw,
                stages=stages, traffic=groups, compressor=comm.compressor,
                chunk_costs={"F": F, "B": B, "W": W, "p2p": p2p},
                makespan=sim.makespan, bubble=sim.bubble, busy=max(busy), dp_seconds=dp_seconds,
                dp_total_seconds=dp_total, overlap_grad_reduce=overlap_dp,
                optimizer_seconds=optimizer_seconds, step_seconds=sim.makespan + dp_seconds + optimizer_seconds,
                tokens_per_step=lay.tokens_per_step, fits=all(st.total <= hw.memory_gb * GB for st in stages),
                total_params=unique, zero_stage=zero, comm_target=comm.target,
                warmup_steps=comm.warmup_steps if comm.compressor != "none" else 0, notes=notes,
                matrices=stage_matrices, partition=method, bounds=bounds,
                layer_seconds=[row["seconds"] for row in figures])


def _a2a_costs(*, moe_layers, dispatch, shared_forward, recompute_passes):
    """One chunk's all-to-all seconds per micro-batch, in flight and not covered by the
    chunk's own compute. Each MoE layer's dispatch runs while its shared expert computes
    (forward; the reverse dispatch while the shared expert's backward, twice the forward,
    runs); its combine has nothing to run behind inside the layer. A recomputed forward
    (activation checkpointing) repeats the forward's all-to-alls in the backward."""
    one_f = dispatch + max(0.0, dispatch - shared_forward)
    one_b = dispatch + max(0.0, dispatch - 2 * shared_forward)
    return {"forward": moe_layers * 2 * dispatch, "forward_exposed": moe_layers * one_f,
            "backward": moe_layers * 2 * dispatch * (1 + recompute_passes),
            "backward_exposed": moe_layers * (one_b + recompute_passes * one_f)}


def _a2a_per_step(timeline, *, fb_cost, a2a_f, a2a_b, exposed_f, exposed_b, compute_f, compute_b):
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


def _overlapped_reduction_ends(timeline, *, schedule, stages, reductions):
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


def _peak_bytes(timeline, stage_bytes):
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


def _dp_group(*, numel, grad_bytes, members, hw, compressor, hierarchical, payload):
    """Bytes on intra/inter-node links and seconds of one data-parallel group's
    gradient reduction, as NCCL runs the collectives (ds_ext/profile/collectives.py: ring
    or tree over the node's rails and NVLink, the faster for the size; the other
    stages' groups on the node share its NICs). Dense: an all-reduce. A compressor's
    payload (ds_ext/comm/traffic.py) by its collective: all-reduce; all-gather of every
    rank's payload; two-phase (sign, int4): an all-to-all of the payload, then an
    all-gather of the 1/n segments. Hierarchical: an all-reduce inside each node, then
    the payload across the nodes on each of the node's m rails (1/m of it each).
    ``members``: each member's node; ``payload(numel, ranks)``: the compressor's
    (bytes, collective) over ``ranks``."""
    from ds_ext.profile import collectives as cc
    n = len(members)
    per_node = {}
    for m in members:
        per_node[m] = per_node.get(m, 0) + 1
    nodes, m = len(per_node), max(per_node.values())
    size = numel * grad_bytes
    out = {"intra_bytes": 0.0, "inter_bytes": 0.0, "intra_bytes_compressed": 0.0, "inter_bytes_compressed": 0.0,
           "seconds": 0.0, "seconds_compressed": 0.0}
    if n < 2:
        return out
    fabric = hw.fabric()
    group = {"nodes": nodes, "per_node": m, "fabric": fabric}
    dense = cc.all_reduce(size, **group)
    out.update(intra_bytes=dense.intra_bytes, inter_bytes=dense.inter_bytes, seconds=dense.seconds)
    if payload is None or compressor == "none":
        out.update(intra_bytes_compressed=dense.intra_bytes, inter_bytes_compressed=dense.inter_bytes,
                   seconds_compressed=dense.seconds)
        return out

    def collectives(p_bytes, kind, ranks, **where):
        if kind == "two_phase":
            return [cc.all_to_all(p_bytes, **where), cc.all_gather(p_bytes, **where)]
        if kind == "all_gather":
            return [cc.all_gather(ranks * p_bytes, **where)]
        return [cc.all_reduce(p_bytes, **where)]
    if not hierarchical or nodes == 1:
        steps = [(1, c) for c in collectives(*payload(numel, n), n, **group)]
    else:
        p_bytes, kind = payload(numel, nodes)
        rails = collectives(p_bytes / m, kind, nodes, nodes=nodes, per_node=1, fabric=fabric)
        steps = [(nodes, cc.all_reduce(size, nodes=1, per_node=m, fabric=fabric))] + [(m, c) for c in rails]
    out["intra_bytes_compressed"] = sum(k * c.intra_bytes for k, c in steps)
    out["inter_bytes_compressed"] = sum(k * c.inter_bytes for k, c in steps)
    out["seconds_compressed"] = sum(c.seconds for _, c in steps)
    return out


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
