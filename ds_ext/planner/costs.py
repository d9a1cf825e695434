"""Per-layer costs in seconds per micro-batch, on one hardware: where the ranks sit
(placement, as the trainer chooses it), the expert all-to-all over the links its group
spans, each layer's forward, backward and W, and the point-to-point transfer between
stages."""

from dataclasses import dataclass

from .hardware import GB


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where pipeline stage s, data-parallel index d runs (ds_ext/topology/placement.py)."""
    name: str
    pp: int
    dp: int
    ranks_per_node: int

    def node(self, stage, data):
        from ds_ext.topology.placement import rank_of
        return rank_of(self.name, stage=stage, data=data, pp=self.pp, dp=self.dp) // self.ranks_per_node


def place(m, hw, *, ranks_per_node, bounds):
    """The placement the trainer would choose for PlanModel ``m`` cut at ``bounds``:
    seekspeed.topology.placement, or for "auto" the choice from the estimated traffic
    (ds_ext/topology/setup.py) on ``hw``'s links."""
    from ds_ext.topology.placement import choose
    from ds_ext.topology.setup import estimate_traffic
    s, lay, mc = m.section, m.layout, m.mc
    pp, dp = lay.pipe_stages, lay.data_parallel
    chunks = [m.rows[bounds[p]:bounds[p + 1]] for p in range(m.parts)]
    rank_params = max(sum(r["params"] for p in m.sched.rank_chunks(rank=rank, stages=pp) for r in chunks[p])
                      for rank in range(pp))        # what the trainer's placement choice is given
    traffic = estimate_traffic(model_config=mc, layout=lay, ds=m.cfg.ds, stage_params=rank_params, moe=s.moe,
                               compute_tflops=hw.flops / 1e12)
    name = s.topology.placement
    if name == "auto":
        name = choose(pp=pp, dp=dp, ep=m.ep, moe=m.has_moe, traffic=traffic, ranks_per_node=ranks_per_node,
                      intra_gbps=hw.intra_gbps, inter_gbps=hw.inter_gbps)[0].placement
    return Placement(name=name, pp=pp, dp=dp, ranks_per_node=ranks_per_node)


@dataclass(frozen=True, kw_only=True)
class ExpertAllToAll:
    """One MoE layer's dispatch + combine for one micro-batch and pass (``layer_bytes``
    per rank sent to other ranks, 0 without expert parallelism), at ``bandwidth``
    bytes/s; ``cost``: one dispatch over the group's nodes (collectives.py), ``combine``
    its combine; ``nodes``: the node of each expert-parallel rank of stage 0;
    ``dispatcher``: what the MoE layers run (seekspeed.moe.dispatcher, dispatch_dtype);
    ``nodes_per_token``: the nodes a token's dispatch reaches, expected."""
    layer_bytes: float = 0.0
    bandwidth: float = 1.0
    cost: object = None
    combine: object = None
    nodes: tuple = ()
    dispatcher: str = ""
    nodes_per_token: float = 0.0
    forwarded: bool = False

    @property
    def dispatch_seconds(self):
        """The mean of the dispatch's and the combine's time (the FP8 dispatch is the smaller)."""
        return self.layer_bytes / 2 / self.bandwidth


def expert_all_to_all(m, hw, placement):
    """One MoE layer's exchanges as the layers' dispatcher sends them
    (recipes/layers/dispatch.py): every-copy, each routed copy of a token to its
    expert's rank, self included (an all-to-all); deduplicated, each token once to each
    rank holding one of its experts, or, where the group spans nodes of several ranks,
    once to each node and forwarded inside it, each row with its routing slots beside
    it, group-limited routing bounding the nodes (``group_limit``). The FP8
    payload shrinks the dispatched rows, across nodes and forwarded inside them alike
    (decoded where the experts run); the combine is in the activation dtype."""
    ep, mc, moe = m.ep, m.mc, m.section.moe
    if not (ep > 1 and mc.num_moe_layers()):
        return ExpertAllToAll(bandwidth=hw.fabric().nvlink(a2a=True))
    from ds_ext.comm.fp8 import row_bytes as fp8_row_bytes
    from ds_ext.comm.alltoall import ORIGIN_BYTES, slot_bytes

    from .collectives import all_to_all, moe_dispatch, routing
    nodes = tuple(placement.node(0, d) for d in range(ep))
    node_count, per_node = len(set(nodes)), max(map(nodes.count, nodes))
    row = mc.hidden_size * m.precision.act
    sent_row = fp8_row_bytes(mc.hidden_size) if moe.dispatch_dtype == "fp8" else row
    k, fabric = mc.num_experts_per_tok, hw.fabric()
    name = moe.dispatcher + (" fp8" if moe.dispatch_dtype == "fp8" else "")
    if moe.dispatcher == "every-copy":
        cost = all_to_all(m.tokens * k * sent_row, nodes=node_count, per_node=per_node, fabric=fabric)
        combine = all_to_all(m.tokens * k * row, nodes=node_count, per_node=per_node, fabric=fabric)
        layer_bytes = m.tokens * k * (sent_row + row) * (ep - 1) / ep
        return ExpertAllToAll(layer_bytes=layer_bytes, bandwidth=layer_bytes / (cost.seconds + combine.seconds),
                              cost=cost, combine=combine, nodes=nodes, dispatcher=name, nodes_per_token=node_count)
    forwarding = node_count > 1 and per_node > 1
    kw = dict(tokens=m.tokens, nodes=node_count, per_node=per_node, fabric=fabric, num_experts=mc.n_routed_experts,
              top_k=k, top_groups=group_limit(mc, node_count), forwarding=forwarding)
    r = routing(**{key: kw[key] for key in ("nodes", "per_node", "num_experts", "top_k", "top_groups")})
    # a row carries its routing: min(k, the destination's experts) slots (fp32 weight, expert
    # index), and forwarded inside the node also its origin
    experts, slot = mc.n_routed_experts, slot_bytes(mc.n_routed_experts)
    rank_slots = min(k, experts // ep) * slot
    node_slots = min(k, experts // node_count) * slot if forwarding else rank_slots
    cost, _ = moe_dispatch(token_bytes=sent_row + node_slots, forward_bytes=sent_row + rank_slots + ORIGIN_BYTES,
                           **kw)
    combine, _ = moe_dispatch(token_bytes=row, **kw)
    layer_bytes = (cost.inter_bytes + cost.intra_bytes + combine.inter_bytes + combine.intra_bytes) / (node_count
                                                                                                       * per_node)
    return ExpertAllToAll(layer_bytes=layer_bytes, bandwidth=layer_bytes / (cost.seconds + combine.seconds), cost=cost,
                          combine=combine, nodes=nodes, dispatcher=name, nodes_per_token=r.nodes_per_token,
                          forwarded=forwarding)


def group_limit(mc, node_count):
    """The nodes a token may reach under the recipe's group-limited routing (DeepSeek-V3's
    n_group / topk_group; the trainer checks each group lies on one node), or None
    (free routing: a recipe without it, n_group 1, or groups not a multiple of the nodes)."""
    groups, top_groups = getattr(mc, "n_group", 1), getattr(mc, "topk_group", 1)
    if groups > 1 and node_count > 1 and groups % node_count == 0 and top_groups < node_count:
        return top_groups
    return None


def a2a_costs(*, moe_layers, dispatch, shared_forward, recompute_passes):
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


def layer_cost(m, hw, row, *, dispatch, shared_forward):
    """Seconds per micro-batch of one layer: compute at hw.flops (2 FLOPs per
    activated parameter and token, the recipe's attention FLOPs), the memory-bound
    passes at hw.hbm_gbps: the activations autograd keeps (the elementwise work:
    norms, RoPE, SwiGLU, softmax) written by the forward, read and their gradients
    written by the backward, a lookup layer's rows gathered and their fp32 gradients
    scattered, the logits written and read by the fp32 log-softmax and their fp32
    gradient; and the expert all-to-all no compute covers (a2a_costs)."""
    tokens, h, a, recompute = m.tokens, m.mc.hidden_size, m.precision.act, m.recompute_passes
    attention = m.recipe.planner.attention_flops(m.mc, row["kind"], seq_len=m.layout.seq_len, **m.options)
    weights = 2 * tokens * row["active"]
    kept = m.full_bytes(row) if row["checkpointable"] else 0.0
    forward = weights / hw.gemm_flops + tokens * attention / hw.flops + kept / (hw.hbm_gbps * GB)
    backward = (2 + recompute) * forward
    if m.is_lookup(row):
        forward += tokens * h * a / (hw.hbm_gbps * GB)
        backward += tokens * h * 4 / (hw.hbm_gbps * GB)
    elif m.is_logits(row):
        logits = tokens * m.mc.vocab_size
        forward += logits * (2 * a + 4) / (hw.hbm_gbps * GB)
        backward += logits * (4 + a) / (hw.hbm_gbps * GB)
    cost = a2a_costs(moe_layers=1 if m.is_moe(row) else 0, dispatch=dispatch, shared_forward=shared_forward,
                     recompute_passes=recompute)
    return {"compute_f": forward, "compute_b": backward, "a2a_f": cost["forward"], "a2a_b": cost["backward"],
            "exposed_f": cost["forward_exposed"], "exposed_b": cost["backward_exposed"],
            "W": weights / hw.gemm_flops if m.sched.zero_bubble else 0.0}


@dataclass(frozen=True, kw_only=True)
class Costed:
    """A PlanModel costed on one hardware: the placement, the expert all-to-all, each
    layer's costs and their total seconds (F + B + W per micro-batch), the
    point-to-point transfer (bytes, seconds) between stages."""
    placement: Placement
    a2a: ExpertAllToAll
    costs: list
    seconds: list
    p2p_bytes: float
    p2p: float


def cost_layers(m, hw, *, ranks_per_node, bounds):
    """The Costed of PlanModel ``m`` on ``hw``, placed for the cut at ``bounds``."""
    placement = place(m, hw, ranks_per_node=ranks_per_node, bounds=bounds)
    a2a = expert_all_to_all(m, hw, placement)
    mc, tokens = m.mc, m.tokens
    shared_forward = 2 * tokens * 3 * mc.hidden_size * mc.moe_intermediate_size * mc.n_shared_experts / hw.gemm_flops
    costs = [layer_cost(m, hw, row, dispatch=a2a.dispatch_seconds, shared_forward=shared_forward) for row in m.rows]
    seconds = [c["compute_f"] + c["exposed_f"] + c["compute_b"] + c["exposed_b"] + c["W"] for c in costs]
    p2p_bytes = tokens * m.recipe.planner.stage_boundary_bytes(mc, act_bytes=m.precision.act)
    pp = m.layout.pipe_stages
    pipe_cross = any(placement.node(st, 0) != placement.node(st + 1, 0) for st in range(pp - 1))
    p2p = p2p_bytes / ((hw.inter_gbps if pipe_cross else hw.intra_gbps) * GB) + hw.latency_us * 1e-6
    return Costed(placement=placement, a2a=a2a, costs=costs, seconds=seconds, p2p_bytes=p2p_bytes, p2p=p2p)
