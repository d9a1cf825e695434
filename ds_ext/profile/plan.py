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
- activations: what autograd keeps per token of each layer (``layer_activation_bytes``,
  checked against the real layers in tests/test_plan.py) times the micro-batches the
  schedule holds at its peak (from the simulator); with DeepSpeed's activation
  checkpointing only each layer's input is kept, plus one layer's full activations
  while it is recomputed;
- buffers: ZeRO's reduce bucket (``reduce_bucket_size`` fp32 elements) and a fixed
  reserve for the CUDA context, NCCL and allocator fragmentation.

Time per optimizer step: the simulator's makespan for per-chunk costs F (forward),
B (backward: 2F, plus F recomputed under activation checkpointing), W (the weight
gradient part) and the point-to-point transfer of one micro-batch, plus the
data-parallel gradient reduction after the pipeline drains (ring all-reduce, or the
compressor's collective and payload; hierarchical: dense inside the node, the rails
across), plus the optimizer step (memory bound). Compute runs at
``peak_tflops x efficiency``; FLOPs are 2 per activated parameter and token forward
and causal attention's S^2 terms.
"""

from dataclasses import asdict, dataclass, field

from ds_ext.errors import ConfigError

GB = 1e9


@dataclass(kw_only=True)
class Hardware:
    """A GPU and its links. Defaults: NVIDIA H800 SXM (80 GB HBM3, 989 dense bf16
    TFLOP/s, NVLink 400 GB/s both directions) with one 200 Gb/s NIC per GPU."""
    name: str = "H800"
    memory_gb: float = 80.0
    reserve_gb: float = 4.0         # CUDA context, NCCL buffers, allocator fragmentation
    peak_tflops: float = 989.0
    efficiency: float = 0.4         # achieved / peak on the model's matmuls (MFU)
    hbm_gbps: float = 3350.0        # GB/s, for the optimizer step
    intra_gbps: float = 200.0       # GB/s one way between two GPUs of a node
    inter_gbps: float = 25.0        # GB/s one way per GPU across nodes (200 Gb/s)
    latency_us: float = 10.0        # per point-to-point transfer

    @property
    def flops(self):
        return self.peak_tflops * 1e12 * self.efficiency


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

    @property
    def total(self):
        return (self.weights + self.gradients + self.optimizer + self.buffers
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
    chunk_costs: dict          # seconds per micro-batch chunk: F, B, W, p2p
    makespan: float            # the pipeline part of the step (simulator)
    bubble: float
    busy: float
    dp_seconds: float
    optimizer_seconds: float
    step_seconds: float
    tokens_per_step: int
    fits: bool
    total_params: int
    zero_stage: int
    notes: list = field(default_factory=list)

    @property
    def tokens_per_s(self):
        return self.tokens_per_step / self.step_seconds

    def to_json(self):
        out = {k: v for k, v in asdict(self).items() if k not in ("stages", "traffic", "hardware")}
        out.update(hardware=asdict(self.hardware), stages=[s.to_json() for s in self.stages],
                   traffic=[asdict(t) for t in self.traffic], tokens_per_s=self.tokens_per_s,
                   bubble_fraction=self.bubble / self.makespan if self.makespan else 0.0)
        return out


# ---- per-layer figures --------------------------------------------------------------

def layer_activation_bytes(config, kind, *, seq_len, act_bytes, fused_attention=True):
    """Bytes autograd keeps per token for one layer of ``kind`` ("embed", "dense",
    "moe", "mtp-dense", "mtp-moe", "norm", "head"), counted from the tensors our layers
    save: norms' inputs and outputs, the MLA projections (q low-rank path, latent,
    decoupled RoPE key), attention's q, k, v and output, the SwiGLU gates, and for MoE
    the router's fp32 scores and each of the k chosen experts' gates. Without a fused
    attention kernel (CPU's math path when the q/k and v head sizes differ) the
    softmax probabilities are kept too: heads x seq_len fp32 per token."""
    c, a = config, act_bytes
    h, heads = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    if kind == "embed":
        return 8
    if kind == "norm":
        return 2 * h * a
    if kind == "head":
        return h * a + 4 * c.vocab_size             # input, fp32 log-softmax of the logits
    q_path = 2 * (c.q_lora_rank or 0)
    attention = a * (2 * h + q_path + 2 * c.kv_lora_rank + c.qk_rope_head_dim + 2 * heads * qk + 3 * heads * c.v_head_dim)
    attention += 4 * heads + (0 if fused_attention else 4 * heads * seq_len)
    if kind.endswith("moe"):
        k, inter, shared = c.num_experts_per_tok, c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
        ffn = a * (2 * h + k * (2 * h + 5 * inter) + 4 * shared) + 4 * (h + 2 * c.n_routed_experts)
    else:
        ffn = a * (2 * h + 4 * c.intermediate_size)
    mtp = a * 5 * h if kind.startswith("mtp") else 0
    return attention + ffn + mtp


def attention_flops(config, *, seq_len):
    """Forward FLOPs per token of one causal attention (scores and weighted sum)."""
    c = config
    return c.num_attention_heads * seq_len * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)


def _spec_kind(spec, config):
    name = spec.typename.__name__
    if name == "EmbeddingPipe":
        from recipes.layers.pipe import tied_lm_head
        return "head" if getattr(spec, "forward_fn", None) is tied_lm_head else "embed"
    if name == "DecoderLayerPipe":
        return "moe" if config.is_moe_layer(spec.module_kwargs["layer_idx"]) else "dense"
    if name == "MTPLayerPipe":
        return "mtp-moe" if config.is_moe_layer(config.num_hidden_layers) else "mtp-dense"
    if name == "FinalNormPipe":
        return "norm"
    if name == "LMHeadPipe":
        return "head"
    raise ValueError(f"the planner does not know layer type {name}: add it to ds_ext/profile/plan.py")


def _layer_figures(specs, config):
    """Per spec: kind, parameters, routed-expert parameters, activated parameters
    (built once per distinct layer on the meta device)."""
    import torch
    from recipes.layers.moe import DeepSeekMoE
    from recipes.layers.pipe import activated_parameters
    cache, rows = {}, []
    for spec in specs:
        kind = _spec_kind(spec, config)
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
        rows.append({"kind": kind, "params": params, "experts": experts, "active": active, "matrices": matrices,
                     "tied": getattr(spec, "key", None)})
    return rows


# ---- the plan ------------------------------------------------------------------------

def nodes_from_hostfile(path):
    from ds_ext.topology.bandwidth import parse_hostfile
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"--hostfile {path}: cannot read it ({exc.strerror}); pass a DeepSpeed hostfile "
                          f"('host slots=N' per line) or --nodes and --gpus-per-node") from None
    hosts = parse_hostfile(text, path=path)
    slots = {n for _, n in hosts}
    if len(slots) != 1:
        raise ConfigError(f"{path}: nodes have different slot counts {sorted(slots)}; the planner assumes equal "
                          f"nodes")
    return len(hosts), slots.pop()


def make_plan(config_path, *, nodes, ranks_per_node, hardware=None, activation_checkpointing=None):
    """The plan for ``config_path`` on ``nodes`` x ``ranks_per_node`` GPUs.
    ``activation_checkpointing`` overrides the config's pipeline.activation_checkpoint_interval
    (None: as configured)."""
    from ds_ext.config import load_config
    from ds_ext.pipe import virtual_stages
    from ds_ext.pipe.simulate import simulate
    from ds_ext.topology.placement import choose, predict, rank_of
    from ds_ext.topology.setup import estimate_traffic
    from recipes import get_recipe
    from recipes.layers.pipe import partition

    hw = hardware or Hardware()
    world = nodes * ranks_per_node
    cfg = load_config(config_path, world_size=world)
    s, lay, ds = cfg.section, cfg.layout, cfg.ds
    recipe = get_recipe(s.recipe.name)
    mc = recipe.make_config(s.recipe.preset, s.recipe.overrides)
    recipe.check_stages(mc, stages=lay.pipe_stages, schedule=s.schedule)
    ep = s.moe.expert_parallel_size
    if lay.data_parallel % ep:
        raise ConfigError(f"seekspeed.moe.expert_parallel_size {ep} does not divide the data-parallel size "
                          f"{lay.data_parallel}: choose a divisor of {lay.data_parallel}")
    pipe_cfg = ds.get("pipeline", {})
    method = pipe_cfg.get("partition", "best")
    method = recipe.DEFAULT_PARTITION if method == "best" else method
    checkpointing = (pipe_cfg.get("activation_checkpoint_interval", 0) > 0 if activation_checkpointing is None
                     else activation_checkpointing)

    bf16 = ds.get("bf16", {}).get("enabled", False)
    fp16 = ds.get("fp16", {}).get("enabled", False)
    mixed = bf16 or fp16
    act_bytes = w_bytes = 2 if mixed else 4
    fp32_grads = not mixed or ds.get("data_types", {}).get("grad_accum_dtype") in ("fp32", "float32")
    g_bytes = 4 if fp32_grads else 2
    zero = ds.get("zero_optimization", {}).get("stage", 0)
    opt_bytes = 8 + (4 if mixed else 0)
    bucket = ds.get("zero_optimization", {}).get("reduce_bucket_size", 5e8) * 4 if zero >= 1 else 0
    tokens = lay.micro_batch * lay.seq_len

    specs = recipe.layer_specs(mc, seed=0, ep_size=ep, ep_rank=0)
    figures = _layer_figures(specs, mc)
    parts = virtual_stages(s.schedule, lay.pipe_stages)
    bounds = partition(specs, num_parts=parts, method=method)

    def chunk(p):
        return figures[bounds[p]:bounds[p + 1]]

    def act_per_mb(rows, *, full):
        if full:
            return tokens * sum(layer_activation_bytes(mc, r["kind"], seq_len=lay.seq_len, act_bytes=act_bytes)
                                for r in rows)
        return tokens * sum(mc.hidden_size * act_bytes if r["kind"] not in ("embed", "norm", "head") else
                            layer_activation_bytes(mc, r["kind"], seq_len=lay.seq_len, act_bytes=act_bytes)
                            for r in rows)

    def fwd_flops(rows):
        attn = sum(attention_flops(mc, seq_len=lay.seq_len) / 2 for r in rows
                   if r["kind"] in ("dense", "moe", "mtp-dense", "mtp-moe"))   # causal: half the scores
        return tokens * (2 * sum(r["active"] for r in rows) + 2 * attn)

    # The schedule: per-chunk costs from the slowest chunk.
    f_flops = max(fwd_flops(chunk(p)) for p in range(parts))
    w_flops = max(tokens * 2 * sum(r["active"] for r in chunk(p)) for p in range(parts))
    F = f_flops / hw.flops
    W = w_flops / hw.flops
    B = 2 * F + (F if checkpointing else 0.0)
    expert_seconds = 0.0
    dp, pp = lay.data_parallel, lay.pipe_stages
    moe_layers_per_chunk = max(sum(1 for r in chunk(p) if r["kind"].endswith("moe")) for p in range(parts))
    a2a_bytes = 0.0
    ep_span_nodes = 1
    traffic = estimate_traffic(model_config=mc, layout=lay, ds=ds,
                               stage_params=max(sum(r["params"] for r in chunk(p)) for p in range(parts)), ep=ep,
                               compute_tflops=hw.flops / 1e12)
    if s.topology.placement == "auto":
        best, _ = choose(pp=pp, dp=dp, ep=ep, moe=mc.num_moe_layers() > 0, traffic=traffic,
                         ranks_per_node=ranks_per_node, intra_gbps=hw.intra_gbps, inter_gbps=hw.inter_gbps)
        placement = best.placement
    else:
        placement = s.topology.placement
        predict(placement, pp=pp, dp=dp, ep=ep, traffic=traffic, ranks_per_node=ranks_per_node,
                intra_gbps=hw.intra_gbps, inter_gbps=hw.inter_gbps)

    def node(stage, data):
        return rank_of(placement, stage=stage, data=data, pp=pp, dp=dp) // ranks_per_node

    if ep > 1 and moe_layers_per_chunk:
        ep_span_nodes = len({node(0, d) for d in range(ep)})
        bw = (hw.inter_gbps if ep_span_nodes > 1 else hw.intra_gbps) * GB
        # dispatch + combine of the k routed copies of each token; (ep-1)/ep leave the rank
        a2a_bytes = 2 * tokens * mc.num_experts_per_tok * mc.hidden_size * act_bytes * (ep - 1) / ep
        expert_seconds = moe_layers_per_chunk * a2a_bytes / bw
        F += expert_seconds
        B += 2 * expert_seconds if checkpointing else expert_seconds

    p2p_bytes = tokens * mc.hidden_size * act_bytes * (2 if mc.num_mtp_layers else 1)
    pipe_cross = any(node(st, 0) != node(st + 1, 0) for st in range(pp - 1))
    p2p = p2p_bytes / ((hw.inter_gbps if pipe_cross else hw.intra_gbps) * GB) + hw.latency_us * 1e-6
    zb = s.schedule in ("dualpipev-zb", "dualpipe")
    sim = simulate(s.schedule, ranks=pp, micro_batches=lay.grad_accum, F=F, B=B, W=W if zb else 0.0, comm=p2p)
    no_p2p = simulate(s.schedule, ranks=pp, micro_batches=lay.grad_accum, F=F, B=B, W=W if zb else 0.0, comm=0.0)

    # Memory per pipeline rank.
    full_bytes = [act_per_mb(chunk(p), full=True) for p in range(parts)]
    ckpt_bytes = [act_per_mb(chunk(p), full=False) for p in range(parts)]
    peak_full, peak_ckpt = _peak_bytes(sim.timeline, full_bytes), _peak_bytes(sim.timeline, ckpt_bytes)
    stages, stage_matrices = [], []
    for rank in range(pp):
        owned = [rank] if parts == pp and s.schedule != "dualpipe" else [rank, parts - 1 - rank]
        rows, seen = [], set()
        for p in owned:
            for r in chunk(p):
                if r["tied"] is not None and r["tied"] in seen:
                    rows.append(r | {"params": 0, "experts": 0, "matrices": {True: [], False: []}})    # held once
                    continue
                if r["tied"] is not None:
                    seen.add(r["tied"])
                rows.append(r)
        params = sum(r["params"] for r in rows)
        experts = sum(r["experts"] for r in rows)
        dense = params - experts
        opt_div_dense = dp if zero >= 1 else 1
        opt_div_expert = max(dp // ep, 1) if zero >= 1 else 1
        largest_layer = max((tokens * layer_activation_bytes(mc, r["kind"], seq_len=lay.seq_len, act_bytes=act_bytes)
                             for r in rows if r["kind"] not in ("embed", "norm", "head")), default=0)
        head_logits = tokens * mc.vocab_size * act_bytes if any(r["kind"] == "head" for r in rows) else 0
        stage_matrices.append({flag: [m for r in rows for m in r["matrices"][flag]] for flag in (True, False)})
        stages.append(StageMemory(
            rank=rank, layers=[(int(bounds[p]), int(bounds[p + 1])) for p in owned], params=params,
            expert_params=experts, weights=params * w_bytes, gradients=params * g_bytes,
            optimizer=opt_bytes * (dense / opt_div_dense + experts / opt_div_expert),
            activations=peak_full[rank] + head_logits,
            activations_checkpointed=peak_ckpt[rank] + largest_layer + head_logits,
            buffers=bucket + hw.reserve_gb * GB, checkpointing=checkpointing, in_flight=sim.peak_activations[rank]))

    # Data-parallel gradient reduction (per stage), dense and with the configured compressor.
    from ds_ext.comm.traffic import payload_bytes
    comm = s.comm
    groups = []
    worst_dense = worst_comp = 0.0
    for rank, st in enumerate(stages):
        def payload(numel, matrices):
            big = [m for m in matrices if m[0] * m[1] >= comm.min_numel]
            return payload_bytes(comm.compressor, numel=numel, ratio=comm.ratio, rank=comm.rank,
                                 block_size=comm.block_size, matrices=big)
        g = _dp_group(numel=st.params - st.expert_params, grad_bytes=g_bytes, members=[node(rank, d) for d in range(dp)],
                      hw=hw, compressor=comm.compressor, hierarchical=comm.hierarchical,
                      payload=lambda numel, m=stage_matrices[rank][False]: payload(numel, m))
        if st.expert_params:
            # routed experts: over the ranks holding the same experts (expert-data-parallel group)
            ex = _dp_group(numel=st.expert_params, grad_bytes=g_bytes, members=[node(rank, d) for d in range(0, dp, ep)],
                           hw=hw, compressor=comm.compressor, hierarchical=comm.hierarchical,
                           payload=lambda numel, m=stage_matrices[rank][True]: payload(numel, m))
            for key in ("intra_bytes", "inter_bytes", "intra_bytes_compressed", "inter_bytes_compressed",
                        "seconds", "seconds_compressed"):
                g[key] += ex[key]
        if rank == 0 or g["seconds"] > worst_dense:
            groups_dp = g
        worst_dense = max(worst_dense, g["seconds"])
        worst_comp = max(worst_comp, g["seconds_compressed"])
    groups.append(GroupTraffic(group="data-parallel", members=dp, **groups_dp))
    chain_bytes = 2 * lay.grad_accum * p2p_bytes * (pp - 1) * (2 if parts != pp else 1)
    cross = sum(node(st, 0) != node(st + 1, 0) for st in range(pp - 1))
    inter_share = cross / max(pp - 1, 1)
    groups.append(GroupTraffic(group="pipeline", members=pp, intra_bytes=chain_bytes * (1 - inter_share),
                               inter_bytes=chain_bytes * inter_share,
                               intra_bytes_compressed=chain_bytes * (1 - inter_share),
                               inter_bytes_compressed=chain_bytes * inter_share,
                               seconds=sim.makespan - no_p2p.makespan,
                               seconds_compressed=sim.makespan - no_p2p.makespan))
    if ep > 1 and mc.num_moe_layers():
        per_step = 4 * a2a_bytes / 2 * ep * lay.grad_accum * moe_layers_per_chunk * (parts // pp)
        key = "inter" if ep_span_nodes > 1 else "intra"
        groups.append(GroupTraffic(group="expert all-to-all", members=ep,
                                   **{f"{key}_bytes": per_step, f"{key}_bytes_compressed": per_step},
                                   **{f"{other}_bytes": 0.0 for other in ("intra", "inter") if other != key},
                                   **{f"{other}_bytes_compressed": 0.0 for other in ("intra", "inter") if other != key},
                                   seconds=expert_seconds * 2 * lay.grad_accum, seconds_compressed=expert_seconds * 2 * lay.grad_accum))

    dp_seconds = worst_comp if comm.compressor != "none" else worst_dense
    biggest = max(stages, key=lambda st: st.params)
    optimizer_seconds = 2 * (biggest.optimizer + biggest.weights + biggest.gradients / max(dp, 1)) / (hw.hbm_gbps * GB)
    step = sim.makespan + dp_seconds + optimizer_seconds
    fits = all(st.total <= hw.memory_gb * GB for st in stages)
    full = figures if ep == 1 else _layer_figures(recipe.layer_specs(mc, seed=0), mc)
    first_of = {}
    for i, r in enumerate(full):
        first_of.setdefault(r["tied"], i)
    unique = sum(r["params"] for i, r in enumerate(full) if r["tied"] is None or first_of[r["tied"]] == i)
    notes = []
    if ep > 1:
        notes.append(f"per-rank counts hold {mc.n_routed_experts // ep} of {mc.n_routed_experts} routed experts "
                     f"per MoE layer (expert parallel {ep})")
    return Plan(config=config_path, schedule=s.schedule, nodes=nodes, ranks_per_node=ranks_per_node,
                layout=vars(lay) | {"tokens_per_step": lay.tokens_per_step}, placement=placement, hardware=hw,
                stages=stages, traffic=groups, compressor=comm.compressor,
                chunk_costs={"F": F, "B": B, "W": W if zb else 0.0, "p2p": p2p},
                makespan=sim.makespan, bubble=sim.bubble, busy=max(sim.busy), dp_seconds=dp_seconds,
                optimizer_seconds=optimizer_seconds, step_seconds=step, tokens_per_step=lay.tokens_per_step,
                fits=fits, total_params=unique, zero_stage=zero, notes=notes)


def _peak_bytes(timeline, stage_bytes):
    """Per rank: the most activation bytes alive at once, walking the simulated ops in
    order (a forward of virtual stage s adds ``stage_bytes[s]``, its backward frees them)."""
    peaks = []
    for ops in timeline:
        live = peak = 0.0
        for op in ops:
            if op.kind in ("F", "FB"):
                live += stage_bytes[op.stage]
            if op.kind in ("B", "Bi"):
                live -= stage_bytes[op.stage]
            if op.kind == "FB":
                live -= stage_bytes[op.stage2]
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _dp_group(*, numel, grad_bytes, members, hw, compressor, hierarchical, payload):
    """Bytes on intra/inter-node links and seconds of one data-parallel group's
    gradient reduction (ring collectives); ``members``: each member's node."""
    n = len(members)
    per_node = {}
    for m in members:
        per_node[m] = per_node.get(m, 0) + 1
    nodes, m = len(per_node), max(per_node.values())
    size = numel * grad_bytes
    out = dict(intra_bytes=0.0, inter_bytes=0.0, intra_bytes_compressed=0.0, inter_bytes_compressed=0.0,
               seconds=0.0, seconds_compressed=0.0)
    if n < 2:
        return out
    crossing = nodes if nodes > 1 else 0      # ring edges between nodes
    edge = 2 * (n - 1) / n * size
    out["intra_bytes"], out["inter_bytes"] = (n - crossing) * edge, crossing * edge
    bottleneck = (hw.inter_gbps if nodes > 1 else hw.intra_gbps) * GB
    out["seconds"] = edge / bottleneck
    if payload is None or compressor == "none":
        out["intra_bytes_compressed"], out["inter_bytes_compressed"] = out["intra_bytes"], out["inter_bytes"]
        out["seconds_compressed"] = out["seconds"]
        return out
    p_bytes, kind = payload(numel)
    if compressor in ("fp32",):
        p_bytes = size
    if not hierarchical or nodes == 1:
        c_edge = 2 * (n - 1) / n * p_bytes if kind == "all_reduce" else (n - 1) * p_bytes
        out["intra_bytes_compressed"], out["inter_bytes_compressed"] = (n - crossing) * c_edge, crossing * c_edge
        out["seconds_compressed"] = c_edge / bottleneck
        return out
    intra_edge = 2 * (m - 1) / m * size
    rail = p_bytes / m
    inter_edge = 2 * (nodes - 1) / nodes * rail if kind == "all_reduce" else (nodes - 1) * rail
    out["intra_bytes_compressed"] = nodes * m * intra_edge
    out["inter_bytes_compressed"] = m * nodes * inter_edge
    out["seconds_compressed"] = intra_edge / (hw.intra_gbps * GB) + inter_edge / (hw.inter_gbps * GB)
    return out


def check_fits(plan):
    """ConfigError naming the first rank that does not fit, with its numbers."""
    cap = plan.hardware.memory_gb * GB
    for st in plan.stages:
        if st.total > cap:
            act = st.activations_checkpointed if st.checkpointing else st.activations
            hint = ("enable activation checkpointing (pipeline.activation_checkpoint_interval: 1), " if not st.checkpointing
                    else "")
            raise ConfigError(
                f"pipeline rank {st.rank} needs {st.total / GB:.1f} GB of the {plan.hardware.memory_gb:g} GB on a "
                f"{plan.hardware.name} (weights {st.weights / GB:.1f}, gradients {st.gradients / GB:.1f}, optimizer "
                f"{st.optimizer / GB:.1f}, activations {act / GB:.1f} for {st.in_flight} micro-batches in flight, "
                f"buffers {st.buffers / GB:.1f}): {hint}add pipeline stages, "
                f"{'use ZeRO stage 1, ' if plan.zero_stage == 0 else 'add data-parallel ranks (ZeRO shards the optimizer over them), '}"
                f"or lower train_micro_batch_size_per_gpu")
