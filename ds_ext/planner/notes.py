"""The plan's notes: one line each for what the numbers alone do not say (expert
parallelism's share of the experts, the all-to-all charged and in flight, the
compressor's warm-up, target and state, unbalanced stages)."""

from ds_ext.muon import uses_muon

from .hardware import GB


def expert_notes(m, hw, costed, *, flight, charged, overlap):
    """Expert parallelism: the experts each rank holds and the all-to-all's figures."""
    mc, ep, a2a = m.mc, m.ep, costed.a2a
    notes = []
    if ep > 1:
        notes.append(f"per-rank counts hold {mc.n_routed_experts // ep} of {mc.n_routed_experts} routed experts "
                     f"per MoE layer (expert parallel {ep})")
    if not a2a.layer_bytes:
        return notes
    how = ("and each F&B chunk's behind the other half's compute (overlap layer)" if overlap == "layer" else
           "(overlap none: F&B chunks run their halves one after the other)")
    notes.append(f"expert all-to-all: {flight * 1e3:,.1f} ms per step in flight on the busiest rank, "
                 f"{charged * 1e3:,.1f} ms charged (the wait column): the dispatch hidden behind the shared expert "
                 f"{how}")
    ep_node_count = len(set(a2a.nodes))
    if ep_node_count > 1:
        from .costs import group_limit
        limited = group_limit(mc, ep_node_count)
        how = ("every routed copy to its expert's rank" if a2a.dispatcher.startswith("every-copy") else
               ("each token once to each node holding one of its experts, forwarded inside it"
                if a2a.forwarded else "each token once to each rank holding one of its experts")
               + f", {a2a.nodes_per_token:.2f} of the "
               f"{ep_node_count} nodes per token" + (f" (at most {limited}: node-limited routing)" if limited else ""))
        notes.append(f"one dispatch {a2a.cost.seconds * 1e3:,.2f} ms and its combine {a2a.combine.seconds * 1e3:,.2f} "
                     f"ms, moe.dispatcher {a2a.dispatcher} ({how})")
    return notes


def optimizer_notes(m, hw, stages):
    """The exact gradient norm's passes, and what the plan does not price about the
    optimizer the config names."""
    notes = []
    if m.section.grad_norm == "exact":
        from ds_ext.grad_norm import BYTES_PER_ELEMENT
        from .reductions import exact_norm_seconds
        notes.append(f"grad_norm exact: {max(exact_norm_seconds(m, hw, st) for st in stages) * 1e3:,.1f} ms a step "
                     f"on the busiest rank ({BYTES_PER_ELEMENT} bytes of memory-bound passes per gradient element it "
                     f"counts), in the optimizer time")
    if not uses_muon(m.cfg.ds):
        return notes
    from ds_ext.muon import NS_STEPS, muon_state_bytes
    p = m.precision
    busiest = max(stages, key=lambda st: st.muon_seconds)
    per = muon_state_bytes(zero=p.zero_stage, grad_bytes=p.grad, mixed=p.weight == 2)
    return notes + [f"optimizer Muon: Newton-Schulz ({NS_STEPS} steps, DeepSpeed's gram form) "
                    f"{busiest.muon_seconds * 1e3:,.1f} ms a step on rank {busiest.rank} at the GPU's rate, in the "
                    f"optimizer time; {per} bytes of state per orthogonalised element"
                    + (" (its momentum and the copy each step stages, in the gradient's dtype"
                       + (", and the fp32 master" if p.weight == 2 else "") + "; a matrix cut by ZeRO's partition is "
                       "held whole)" if p.zero_stage >= 1 else " (its momentum)")
                    + f", {p.optimizer} per parameter on the auxiliary Adam"]


def dense_steps(comm, run):
    """Optimizer steps of the first ``run`` that reduce dense under ``comm`` (a CommSection
    with target momentum): the warm-up and 0/1 Adam's variance refreshes after it."""
    from ds_ext.comm.reducer import refresh_steps
    refreshes = (refresh_steps(comm.var_update_scaler, comm.var_freeze_step, run, comm.var_update_max_interval)
                 if comm.var_update_scaler else ())
    return min(run, comm.warmup_steps) + sum(1 for s in refreshes if s > comm.warmup_steps)


def comm_notes(m, stages, reductions):
    """The compressor's dense warm-up, the momentum target, and the state it keeps."""
    comm = m.section.comm
    if comm.compressor == "none":
        return []
    notes = []
    dense_s = max(g["seconds"] for g in reductions)
    if comm.warmup_steps:
        notes.append(f"the first {comm.warmup_steps} optimizer steps reduce dense (gradient reduction "
                     f"{dense_s * 1e3:,.1f} ms a step, the dense columns); the step time and the compressed "
                     f"columns are the steps after them, what a long run sees")
    if comm.target == "momentum":
        notes.append(f"target momentum: after the dense warm-up Adam's second moment is frozen and each rank sends "
                     f"its local momentum through {comm.compressor}, the same bytes per step as the gradient; "
                     f"it keeps a full fp32 local momentum of its stage (also under ZeRO 1) and the residuals")
    if comm.target == "momentum" and comm.var_update_scaler is not None:
        counts = ", ".join(f"{dense_steps(comm, run):,} of the first {run:,}" for run in (300, 1000, 10000))
        notes.append(f"0/1 Adam's variance schedule (var_update_scaler {comm.var_update_scaler}, var_freeze_step "
                     f"{comm.var_freeze_step:,}"
                     + (f", var_update_max_interval {comm.var_update_max_interval:,}" if comm.var_update_max_interval
                        else "")
                     + "): each refresh is a dense step"
                     + (f" (its gradient through {comm.refresh_compressor} after the warm-up)"
                        if comm.refresh_compressor != "fp32" else "")
                     + f" at intervals doubling after every {comm.var_update_scaler} refreshes; dense steps, warm-up "
                     f"included: {counts}")
    heavy = max(stages, key=lambda st: st.comm_state)
    if heavy.comm_state:
        notes.append(f"comm state (what the compressed reduction keeps per rank between steps, in the totals): "
                     f"rank {heavy.rank} "
                     + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in heavy.comm_state_parts.items()))
    return notes


def balance_notes(busy):
    if max(busy) > 1.15 * min(busy):
        return ["stages are unbalanced: busy " + ", ".join(f"{b * 1e3:.0f}" for b in busy) + " ms per rank"]
    return []
