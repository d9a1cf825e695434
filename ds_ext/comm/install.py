"""The compressed reduction inside DeepSpeed's pipeline engines.

``CompressedReduction`` is mixed into every seekspeed engine class (1F1B, DualPipeV,
dualpipev-zb, dualpipe). With ``engine.grad_reducer`` unset (compressor ``none``)
every method falls through to DeepSpeed's own. Set, it takes over the two places
where DeepSpeed reduces data-parallel gradients at the accumulation boundary:

- ``buffered_allreduce_fallback``: ZeRO 0 (fp32, fp16, bf16) and DeepSpeed's
  BF16_Optimizer; the gradients and expert groups are the ones DeepSpeed would
  reduce, averaged over the same groups by the same factors;
- ZeRO 1 (DeepSpeedZeroOptimizer, fp32/fp16/bf16): the gradients the optimizer is
  about to reduce (``get_gradient_for_reduction``, so fp32 accumulation buffers too)
  are summed over their groups first; then the optimizer's own reduction runs with
  its two communication calls (``allreduce_bucket``, ``gradient_reduction_w_predivide``)
  replaced by local versions that only divide as they would, so it averages,
  partitions and copies out as usual.

``target: "momentum"`` (1-bit Adam's scheme): the reducer returns the averaged Adam
momentum instead of the gradient once the warm-up is over, and ``FrozenVarianceAdam``
replaces the step of the Adam/AdamW inside whatever DeepSpeed wraps it in (itself at
ZeRO 0 fp32, BF16_Optimizer's, ZeRO 1's on its partition): it takes what arrives as
the gradient as the momentum and updates with the second moment frozen where the
warm-up left it. DeepSpeed's clipping and overflow checks run before it, on that
momentum.
"""

import fnmatch
import functools
import math

import torch
import torch.distributed as tdist
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

from .reducer import GradientReducer


def _local_allreduce_bucket(opt, bucket, communication_data_type, rank=None, log=None, divide=True,
                            process_group=None):
    """DeepSpeedZeroOptimizer.allreduce_bucket without the collective (the bucket is
    already summed): flatten, divide as it would."""
    tensor = opt.flatten(bucket)
    process_group = opt.dp_process_group if process_group is None else process_group
    if divide and opt.gradient_average:
        tensor.div_(tdist.get_world_size(group=process_group) / float(opt.sequence_parallel_size))
    return tensor


def _local_predivide(opt, tensor, communication_data_type):
    """DeepSpeedZeroOptimizer.gradient_reduction_w_predivide without the collective."""
    if opt.gradient_average and tensor.numel():
        tensor.div_(tdist.get_world_size(group=opt.dp_process_group) / float(opt.sequence_parallel_size))
    return tensor


def divided_later_by(opt, group, average):
    """What DeepSpeed divides a gradient reduced over ``group`` by before its optimizer
    sees it: nothing when the reduction averages (``average``), else ZeRO 1's own
    averaging, which runs after the compressed sum."""
    if average:
        return 1
    return tdist.get_world_size(group=group) / float(getattr(opt, "sequence_parallel_size", 1))


def _grouped(pairs, dense_params):
    """(param, grad) pairs -> (non-expert grads, {expert group name: grads}, ids of the
    grads whose parameter is in ``dense_params``)."""
    from deepspeed.moe.utils import is_moe_param
    non_expert, expert, dense = [], {}, set()
    for param, grad in pairs:
        if is_moe_param(param):
            expert.setdefault(param.group_name, []).append(grad)
        else:
            non_expert.append(grad)
        if id(param) in dense_params:
            dense.add(id(grad))
    return non_expert, expert, dense


def _zero_gradients(opt, dense_params):
    """What DeepSpeedZeroOptimizer will reduce, grouped by ``_grouped``."""
    pairs = ((param, opt.get_gradient_for_reduction(param)) for group in opt.bit16_groups for param in group)
    return _grouped(((p, g) for p, g in pairs if g is not None and p.numel()), dense_params)


def _bf16_gradients(opt, dense_params):
    """What DeepSpeed's BF16_Optimizer reduces, a flat fp32 buffer per parameter group,
    as the views of each parameter inside it (a compressor that works on matrices needs
    their shapes; the alignment padding after them stays zero on every rank)."""
    pairs = ((lp, grad.view(lp.shape)) for params, grads in zip(opt.bf16_groups, opt.fp32_groups_gradients)
             for lp, grad in zip(params, grads))
    return _grouped(((p, g) for p, g in pairs if p.numel()), dense_params)


class CompressedReduction:
    grad_reducer = None
    comm_dense_params = frozenset()    # ids of the parameters reduced dense by name

    def _compressed_reduce(self, non_expert, expert, dense, *, average=True):
        from deepspeed.utils import groups
        reducer = self.grad_reducer
        reducer.begin_step()
        at = dict(micro_step=self.micro_steps, boundary=self.is_gradient_accumulation_boundary(), dense=dense)
        dp_group = self.mpu.get_data_parallel_group()
        calls = [(list(non_expert), dict(group=dp_group, key="dense",
                                         divide_by=tdist.get_world_size(dp_group) if average else 1))]
        if self.has_moe_layers:
            dp_world = tdist.get_world_size(groups._get_data_parallel_group())
            calls += [(list(grads), dict(group=groups._get_expert_data_parallel_group(name), key=("expert", name),
                                         hierarchical=False, divide_by=dp_world if average else 1))
                      for name, grads in sorted(expert.items())]
        for _, kw in calls:
            kw["divided_later_by"] = divided_later_by(self.optimizer, kw["group"], average)
        # every gradient of the step is at hand: target momentum clips before the exchange
        reducer.clip_ahead(calls)
        for grads, kw in calls:
            reducer.reduce(grads, **kw, **at)
        reducer.end_step()

    def _dense_by_storage(self, non_expert, expert):
        """Ids of the gradients (from DeepSpeed's list, ``param.grad.data``, a new
        tensor object each time) that belong to the dense-by-name parameters."""
        ptrs = {p.grad.data_ptr() for p in self.module.parameters()
                if id(p) in self.comm_dense_params and p.grad is not None and p.numel()}
        grads = [*non_expert, *(g for gs in expert.values() for g in gs)]
        return {id(g) for g in grads if hasattr(g, "data_ptr") and g.data_ptr() in ptrs}

    def buffered_allreduce_fallback(self, grads=None, elements_per_buffer=500000000):
        if self.grad_reducer is None:
            return super().buffered_allreduce_fallback(grads=grads, elements_per_buffer=elements_per_buffer)
        opt = self.optimizer
        if grads is not None:
            non_expert, expert, dense = grads, {}, set()
        elif hasattr(opt, "bf16_groups") and hasattr(opt, "fp32_groups_gradients"):
            non_expert, expert, dense = _bf16_gradients(opt, self.comm_dense_params)
        elif hasattr(opt, "get_grads_for_reduction"):
            non_expert, expert = opt.get_grads_for_reduction()
            dense = set()
        else:
            non_expert, expert = self._get_gradients_for_reduction()
            dense = self._dense_by_storage(non_expert, expert)
        self._compressed_reduce(non_expert, expert, dense)

    def allreduce_gradients(self, bucket_size=MEMORY_OPT_ALLREDUCE_SIZE):
        zero1 = (self.grad_reducer is not None and self.zero_optimization_stage() == 1
                 and hasattr(self.optimizer, "reduce_gradients") and hasattr(self.optimizer, "bit16_groups"))
        if not zero1 or not self.is_gradient_accumulation_boundary():
            return super().allreduce_gradients(bucket_size=bucket_size)
        opt = self.optimizer
        non_expert, expert, dense = _zero_gradients(opt, self.comm_dense_params)
        self._compressed_reduce(non_expert, expert, dense, average=False)
        opt.allreduce_bucket = functools.partial(_local_allreduce_bucket, opt)
        opt.gradient_reduction_w_predivide = functools.partial(_local_predivide, opt)
        try:
            super().allreduce_gradients(bucket_size=bucket_size)
        finally:
            del opt.allreduce_bucket, opt.gradient_reduction_w_predivide

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        client_state = {} if client_state is None else client_state     # DeepSpeed's default, not shared
        # this rank's compression state (state.py; --resume restores it) goes into the checkpoint
        # first, through the same checkpoint engine (AsyncCheckpointing, before this mixin, has begun the save)
        if self.grad_reducer is not None:
            from .state import save_file
            save_file(self, save_dir, tag if tag is not None else f"global_step{self.global_steps}")
        return super().save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                       exclude_frozen_parameters=exclude_frozen_parameters)


class FrozenVarianceAdam:
    """The step of an Adam/AdamW once ``target: "momentum"`` sends momentum: for each
    parameter, exp_avg := its gradient (the averaged momentum M, equal on every rank),
    exp_avg_sq left as the warm-up's last dense step made it, and AdamW's update with
    them, decoupled weight decay and the group's lr (so the lr schedule applies):
    p <- p (1 - lr wd) - lr m' / max(sqrt(v / (1 - b2^T)) + eps, |m'|), m' = m / (1 - b1^t),
    t the momentum's steps (the reducer's), T the variance's (the optimizer's own step
    count, which stops at the freeze as the variance does, and is saved with it). The
    max: a coordinate whose momentum outgrew the frozen variance (quiet in the warm-up,
    an embedding row first seen after it) moves by at most lr, where 1/sqrt(v) alone
    would throw it by lr |m'| / eps (measured: a 10-step warm-up then ended +95 % behind
    dense AdamW, the loss jumping back to 3.3 within 5 steps of the freeze). Before and
    during the warm-up, and on steps the reducer sent dense, the optimizer's own step
    runs, but for 0/1 Adam's variance refreshes after the first momentum step
    (``var_update_scaler``): there the dense gradient g updates both moments here, v <- b2 v
    + (1 - b2) g^2 (T + 1) and m <- b1 m + (1 - b1) g, and the update is the one above with
    the momentum's step count t (the optimizer's own bias correction would use T, a few
    steps, and scale the step by 1 / (1 - b1^T)). With ``var_refresh_decay: "elapsed"`` a
    refresh k steps after the last dense step decays v by b2^k instead, v <- b2^k v + (1 -
    b2^k) g^2, and T becomes the step's own number (the moving average kept in steps, as dense
    Adam's). A step whose momentum or gradient is
    non-finite on any rank changes nothing (counted in ``skipped_steps``); DeepSpeed's lr
    schedule still advances."""

    def __init__(self, optimizer, reducer):
        self.optimizer, self.reducer = optimizer, reducer
        self.dense_step = optimizer.step
        self.skipped_steps = 0

    @staticmethod
    def variance_steps(state):
        step = state.get("step", 0)
        return int(step.item() if hasattr(step, "item") else step)

    @staticmethod
    def _tensor_slices(reducer):
        """var_rescale "tensor": storage address -> [(element offset, numel, element size,
        factor)] of the gradients the reducer reduced this step; None when off."""
        factors = getattr(reducer, "tensor_factors", None)
        if factors is None:
            return None
        out = {}
        for (ptr, offset, numel, size), f in zip(reducer.tensor_slots, factors.tolist()):
            out.setdefault(ptr, []).append((offset, numel, size, f))
        return out

    @staticmethod
    def _scale(t, grad, slices, root=False):
        """``t`` (laid out as ``grad``: exp_avg_sq, or the step's denominator) times the
        factor of each reduced gradient that shares ``grad``'s storage, on the elements they
        share (a partition of a flat buffer takes the factors of the tensors inside it);
        ``root``: times its square root. A parameter none of them covers is refused: its
        gradient is not the one the reducer saw (ZeRO's optimizer keeps its own copy)."""
        lo, n, size = grad.storage_offset(), grad.numel(), grad.element_size()
        flat, covered = t.view(-1), 0
        for offset, numel, width, f in slices.get(grad.untyped_storage().data_ptr(), ()):
            a, b = max(offset, lo), min(offset + numel, lo + n)
            if width != size or a >= b:
                continue
            covered += b - a
            if f != 1.0:
                flat[a - lo:b - lo].mul_(math.sqrt(f) if root else f)
        if not covered:
            raise RuntimeError("comm var_rescale 'tensor': an optimizer parameter's gradient is none of the tensors the "
                               "reducer reduced (the optimizer steps a copy of its own), so its factor is "
                               "unknown; use var_rescale true (one factor for every element)")

    @torch.no_grad()
    def step(self, closure=None):
        reducer = self.reducer
        refresh = getattr(reducer, "refreshed", False)
        if not reducer.sent_momentum and not refresh:
            return self.dense_step() if closure is None else self.dense_step(closure)
        if reducer.skipped:
            self.skipped_steps += 1
            return None
        opt = self.optimizer
        for group in opt.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [opt.state[p] for p in params]
            if any("exp_avg_sq" not in st for st in states):
                raise RuntimeError("comm target momentum: the optimizer has no second moment to freeze (no dense step "
                                   "ran before the freeze)")
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            corrected = group.get("bias_correction", True)
            frozen = max(self.variance_steps(st) for st in states)
            rescale = reducer.variance_scale     # var_rescale: 1.0 when off
            slices = self._tensor_slices(reducer)      # var_rescale "tensor": per-tensor factors instead
            if slices is not None:
                rescale = 1.0
            if refresh:
                rescale = 1.0
                # var_refresh_decay "elapsed": b2 per step since the last dense step, the
                # variance's step count then the steps themselves (its bias correction in steps)
                elapsed = reducer.section.var_refresh_decay == "elapsed"
                keep = beta2 ** reducer.refresh_gap() if elapsed else beta2
                frozen = reducer.steps if elapsed else frozen + 1
                # var_rescale: the frozen v brought to where dense Adam's stood before this step
                decay = keep * reducer.scale_before
                for p, st in zip(params, states):
                    if slices is not None:
                        st["exp_avg_sq"].mul_(keep)
                        self._scale(st["exp_avg_sq"], p.grad, slices)
                    else:
                        st["exp_avg_sq"].mul_(decay)
                    st["exp_avg_sq"].addcmul_(p.grad, p.grad, value=1.0 - keep)
                    st["exp_avg"].mul_(beta1).add_(p.grad, alpha=1.0 - beta1)
                    if torch.is_tensor(st["step"]):
                        st["step"].fill_(frozen)
                    else:
                        st["step"] = frozen
            bc1 = 1.0 - beta1 ** reducer.steps if corrected else 1.0
            bc2 = math.sqrt(1.0 - beta2 ** frozen) if corrected else 1.0
            for p, st in zip(params, states):
                m = st["exp_avg"]
                if not refresh:
                    m.copy_(p.grad)
                denom = st["exp_avg_sq"].sqrt().div_(bc2)
                if rescale != 1.0:
                    denom.mul_(math.sqrt(rescale))
                if slices is not None and not refresh:
                    self._scale(denom, p.grad, slices, root=True)
                denom.add_(eps)
                # where the momentum outgrew the frozen variance (a coordinate quiet in the
                # warm-up, an embedding row first seen after it) the step is at most lr
                torch.maximum(denom, m.abs().div_(bc1), out=denom)
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.addcdiv_(m, denom, value=-lr / bc1)
        return None


def _inner_optimizer(engine):
    """The Adam/AdamW instance whose step updates the weights (DeepSpeed's wrappers keep
    it as ``.optimizer``)."""
    opt = engine.optimizer
    while hasattr(opt, "optimizer") and hasattr(opt.optimizer, "param_groups"):
        opt = opt.optimizer
    return opt


def check_momentum_optimizer(opt):
    """A one-line error unless ``opt`` is an Adam whose weight decay is decoupled (AdamW)
    or zero: the momentum a rank sends must be all of what the step uses."""
    from ds_ext.errors import ConfigError
    from deepspeed.ops.adam import FusedAdam
    name = type(opt).__name__
    if isinstance(opt, FusedAdam):
        decoupled = bool(opt.adam_w_mode)
    elif isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
        decoupled = isinstance(opt, torch.optim.AdamW) or any(g.get("decoupled_weight_decay") for g in opt.param_groups)
    else:
        raise ConfigError(f"seekspeed.comm.target 'momentum' freezes Adam's second moment and sends its momentum, and "
                          f"the optimizer is {name}: use optimizer type Adam or AdamW, or target 'gradient'")
    if not decoupled and any(g["weight_decay"] for g in opt.param_groups):
        raise ConfigError(f"seekspeed.comm.target 'momentum' with {name}'s L2 weight decay (added to the gradient, so "
                          f"into the momentum each rank sends): use AdamW (decoupled weight decay) or weight_decay 0")
    betas = {tuple(g["betas"]) for g in opt.param_groups}
    if len(betas) > 1:
        raise ConfigError(f"seekspeed.comm.target 'momentum' keeps one momentum per element with one beta1, and the "
                          f"parameter groups have betas {sorted(betas)}: give every group the same betas")
    return next(iter(betas))[0]


def check_tensor_rescale(section, zero_stage, optimizer):
    """``var_rescale: "tensor"`` finds each optimizer parameter's factor by its gradient's
    storage, which must be the reduced gradients': the model's own (no ZeRO) or
    BF16_Optimizer's flat buffer. ZeRO 1's DeepSpeedZeroOptimizer steps a copy: refused in
    one line."""
    if section.var_rescale == "tensor" and zero_stage >= 1 and not hasattr(optimizer, "bf16_groups"):
        from ds_ext.errors import ConfigError
        raise ConfigError(f"seekspeed.comm.var_rescale 'tensor' scales each parameter's variance by its tensor's "
                          f"factor, and ZeRO stage {zero_stage}'s optimizer ({type(optimizer).__name__}) steps a copy "
                          f"of the gradients it cannot map to the tensors reduced: set var_rescale true, zero stage "
                          f"0, or bf16 (DeepSpeed's BF16_Optimizer steps views of the reduced buffer)")


def install(engine, section, *, node_of=None, log=print):
    """Attach a GradientReducer for ``section`` (a ``seekspeed.comm`` section) to
    ``engine``; collective over the world when ``section.hierarchical``. ``node_of``:
    node of each global rank (default: consecutive blocks of the launcher's ranks per node)."""
    import warnings
    from ds_ext.topology.groups import NodeGroups
    # torch 2.13 routes the sparse all-gather through a deprecated alias and warns on every rank
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    if section.compressor == "none":
        engine.grad_reducer = None
        return None
    world = tdist.get_world_size()
    if node_of is None:
        from ds_ext.topology.setup import local_world_size
        per_node = local_world_size(world)
        node_of = [r // per_node for r in range(world)]
    node_groups = None
    if section.hierarchical:
        try:
            node_groups = NodeGroups.for_subsets(node_of, engine.grid.dp_groups)
        except ValueError as exc:
            from ds_ext.errors import ConfigError
            raise ConfigError(f"seekspeed.comm.hierarchical: {exc}; set hierarchical to false or change "
                              f"seekspeed.topology.placement") from None
    spans = {}
    if node_groups is not None:
        spans = {node_groups.intra_group: False, node_groups.rail_group: node_groups.num_nodes > 1}
    reducer = GradientReducer(section, node_groups=node_groups, spans_nodes=spans, node_of=node_of,
                              seed=0)
    engine.grad_reducer = reducer
    if section.target == "momentum":
        inner = _inner_optimizer(engine)
        reducer.beta1 = check_momentum_optimizer(inner)
        reducer.beta2 = float(inner.param_groups[0]["betas"][1])
        check_tensor_rescale(section, engine.zero_optimization_stage(), engine.optimizer)
        # the momentum is made of clipped gradients, as Adam's (GradientReducer._settle_momentum)
        reducer.clip = float(engine.gradient_clipping() or 0.0)
        reducer.copies = 2 if getattr(engine, "_pair_group", None) is not None else 1
        frozen = FrozenVarianceAdam(inner, reducer)
        inner.step = frozen.step
        engine.frozen_variance = frozen
    patterns = section.dense_params
    if patterns is None:
        patterns = getattr(reducer.compressor, "default_dense_params", ())
    named = [(name, p) for name, p in engine.module.named_parameters()
             if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)]
    engine.comm_dense_params = frozenset(id(p) for _, p in named)
    if tdist.get_rank() == 0:
        shape = (f"hierarchical: {node_groups.num_nodes} node(s) x {node_groups.local_size} rank(s) per data-parallel "
                 f"group" if node_groups is not None else "flat")
        log(f"comm: data-parallel gradients through {section.compressor} ({shape}, chunks of {section.chunk_mb:g} MB, "
            f"{section.pipeline_depth} in flight, dense under {section.min_numel} elements"
            + (f", dense for the first {section.warmup_steps} steps" if section.warmup_steps else "")
            + (", sending Adam's momentum (variance frozen after the warm-up, error feedback as the compressor "
               "keeps it)" if section.target == "momentum" else "")
            + _dense_note(patterns, named)
            + _kernel_note(reducer.compressor) + ")")
    return reducer


def _dense_note(patterns, named):
    """Which parameters go dense by name (on rank 0's stage), for the install log line."""
    if not patterns:
        return ""
    names = ", ".join(name for name, _ in named[:4]) + (", ..." if len(named) > 4 else "")
    return (f", dense by name ({' '.join(patterns)}): {len(named)} parameter(s) of this stage"
            + (f" ({names})" if named else ""))


def _kernel_note(compressor):
    """Which top-k selection or sign codec code runs, for the install log line."""
    from ds_ext.comm import kernels
    from ds_ext.comm.compressors import TopK, TwoPhase, _SignCodec, _cpu_accelerator
    if isinstance(compressor, TwoPhase) and isinstance(compressor.codec, _SignCodec):
        on_cpu = _cpu_accelerator()
        if not on_cpu or compressor.codec.kernel == "torch":
            return ", sign's encoding in torch ops" + ("" if on_cpu else " (the fused kernel is for CPU gradients)")
        if compressor.codec.fused(torch.device("cpu")) is not None:
            return ", sign's encoding in the fused C++ kernel on CPU"
        error = kernels.build_error("sign_codec")
        return ", sign's encoding in torch ops" + (f" (the fused kernel did not build: {error})" if error else "")
    if not isinstance(compressor, TopK) or compressor.selection != "sampled":
        return ""
    if not compressor.uses_kernel():
        return ", top-k selection in torch ops"
    if compressor._kernel_module is not None:
        return ", top-k selection in the fused C++ kernel on CPU"
    error = kernels.build_error()
    if error:
        return f", top-k selection in torch ops (the fused kernel did not build: {error})"
    return ", top-k selection in torch ops (the fused kernel is for CPU gradients)"
