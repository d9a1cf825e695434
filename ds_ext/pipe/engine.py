"""seekspeed's pipeline engines and the initialize() that installs them.

``SeekspeedDualPipeVEngine`` is DeepSpeed's DualPipeVEngine running
``DualPipeVZBSchedule``: backward chunks marked ``zb`` defer their weight gradients
to ``WeightPass`` slots, F&B chunks run through the module's
``overlapped_forward_backward`` hook (sequential by default), and point-to-point
transfers are posted asynchronously at each CommitP2P and waited for only where their
tensors are used (a forward waits for its activations, a backward for its output
gradients; sends complete in the background and are all waited for before the
gradient reduction), so transfers run while the rank computes. With ``overlap="layer"``
an F&B chunk's forward and backward are interleaved layer by layer
(ds_ext/pipe/overlap.py), so each expert-parallel all-to-all of one micro-batch is in
flight while the other computes.

Every engine records the MoE all-to-alls into its timeline when one is set
(``--pipe-trace``): issued to waited, and the part the rank was blocked on.
"""

import time

from deepspeed import comm as dist
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe import schedule as ds_schedule

from ds_ext.comm import alltoall
from ds_ext.muon import muon_split, set_update

from . import LAYER_OVERLAP_SCHEDULES, schedule_spec, schedules
from .overlap import Interleaver, PerThread
from .zero_bubble import WeightGradStore

OVERLAP_MODES = ("none", "layer")


class InstructionTimeline:
    """Start and end times (seconds, time.perf_counter) of every executed instruction."""

    def __init__(self):
        self.events = []

    def record(self, name, kwargs, start, end):
        self.events.append((name, dict(kwargs), start, end))


class _TimedSchedule:
    """Mixin: record each instruction's start/end when ``self.timeline`` is set."""

    timeline = None

    def _exec_schedule(self, pipe_schedule):
        overlap = getattr(self, "grad_overlap", None)
        if self.timeline is None and overlap is None:
            return super()._exec_schedule(pipe_schedule)
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        cmds = [cmd for step_cmds in pipe_schedule for cmd in step_cmds]
        if overlap is not None:
            overlap.begin(cmds)
        with alltoall.recording(self.timeline):
            for i, cmd in enumerate(cmds):
                if type(cmd) not in self._INSTRUCTION_MAP:
                    raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {repr(cmd)}")
                start = time.perf_counter() if self.timeline is not None else 0.0
                self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)
                if self.timeline is not None:
                    self.timeline.record(cmd.name, cmd.kwargs, start, time.perf_counter())
                if overlap is not None:
                    overlap.after(i)


class _FrozenExperts:
    """Mixin: a model whose routed experts are all frozen (DeepSeek-V3.2's dense warm-up
    trains only the indexers) has no MoE parameter group for the optimizer, which
    DeepSpeed's ZeRO and BF16 optimizers assert on whenever the model has MoE layers.
    While they are built the engine says it has none; everything else (expert
    checkpoint files, expert groups) still sees the MoE layers. The experts are those
    DeepSpeed's assertion counts: parameters DeepSpeed's MoE layer tagged
    (``is_moe_param``), whatever the recipe's classes.

    Also says over which groups a stage's layers are replicated (``replica_groups``),
    for the recipes' step hooks."""

    def replica_groups(self):
        """(the stage's data-parallel group, the rank pair holding dualpipe's two copies
        of each stage or None): the ranks whose copies of this rank's layers must stay
        alike (a router's bias update sums its loads over both)."""
        return self.grid.get_data_parallel_group(), getattr(self, "_pair_group", None)

    def _frozen_experts(self):
        from deepspeed.moe.utils import is_moe_param
        return self.has_moe_layers and not any(p.requires_grad and is_moe_param(p) for p in self.module.parameters())

    def _with_moe_hidden(self, build, optimizer):
        if not self._frozen_experts():
            return build(optimizer)
        self.has_moe_layers = False
        try:
            return build(optimizer)
        finally:
            self.has_moe_layers = True

    def _configure_zero_optimizer(self, optimizer):
        return self._with_moe_hidden(super()._configure_zero_optimizer, optimizer)

    def _configure_bf16_optimizer(self, optimizer):
        built = self._with_moe_hidden(super()._configure_bf16_optimizer, optimizer)
        if self.has_moe_layers and not self._frozen_experts():
            _every_expert_group_in_norm(built)
        return built


def _every_expert_group_in_norm(optimizer):
    """DeepSpeed's BF16 optimizer takes the gradient norm of each expert group with
    collectives over the pipeline and expert groups, but only for the groups whose
    experts this rank's own layers hold: a pipeline stage without MoE layers (an
    embedding-only stage, dualpipe's copy stages left to their partner) skips
    collectives its pipeline peers run, and the step hangs. Every rank names every
    expert group of the model; where it holds none of a group's experts, a zero adds
    nothing to the norm."""
    import torch
    from deepspeed.utils import groups
    names = sorted(groups._get_expert_parallel_group_dict())
    own = optimizer.get_grads_for_norm

    def get_grads_for_norm(for_clipping=False):
        got = own(for_clipping=for_clipping)
        if for_clipping:
            return got
        non_expert, expert = got
        for name in names:
            expert.setdefault(name, [torch.zeros(1, dtype=torch.float32, device=optimizer.fp32_groups_gradients_flat[0].device)])
        return non_expert, {name: expert[name] for name in sorted(expert)}

    optimizer.get_grads_for_norm = get_grads_for_norm


class SeekspeedPipelineEngine(_FrozenExperts, _TimedSchedule, PipelineEngine):
    """1f1b: DeepSpeed's PipelineEngine and TrainSchedule."""


class SeekspeedDualPipeVEngineAsIs(_FrozenExperts, _TimedSchedule, DualPipeVEngine):
    """dualpipev: DeepSpeed's own DualPipeVEngine and DualPipeVSchedule."""


class _KeepAlive:
    """A send's work handle and the tensor it reads, kept together until it completes."""

    def __init__(self, work, tensor):
        self.work, self.tensor = work, tensor

    def wait(self):
        self.work.wait()


class SeekspeedDualPipeVEngine(_FrozenExperts, _TimedSchedule, DualPipeVEngine):

    # receives are posted this many CommitP2P groups ahead of their own (see _exec_schedule)
    PREPOST_GROUPS = 2

    # the phase an interleaved F&B chunk's two halves each run (DualPipeVEngine's state)
    _active_phase = PerThread()

    def __init__(self, *args, zero_bubble=True, overlap_p2p=True, overlap="none", **kwargs):
        if overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap {overlap!r}: choose one of {list(OVERLAP_MODES)}")
        self._zero_bubble = zero_bubble
        self._overlap = overlap_p2p
        self._interleaver = Interleaver() if overlap == "layer" else None
        self._p2p_keys = []
        self._pending_recv = {}
        self._pending_sends = []
        self._queue_key = None         # the receive being queued: ("act"|"grad", buffer)
        super().__init__(*args, **kwargs)
        WeightGradStore.clear()

    # -- schedule ---------------------------------------------------------------------

    def _train_schedule(self):
        if not self._zero_bubble:
            return super()._train_schedule()
        return schedules.DualPipeVZBSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                             stage_id=self.stage_id)

    def _exec_schedule(self, pipe_schedule):
        """Run the instructions in order, but post each receive up to PREPOST_GROUPS
        CommitP2P groups early (once the tensor shapes are known, after the first
        step). A gloo send completes only when its receive is posted, so a receive
        posted when the compute that needs it is about to start leaves the transfer on
        the critical path; posted early, it lands while the rank still computes. Per
        link, receives keep their order, so they still pair with the same sends."""
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        cmds = [cmd for step in pipe_schedule.steps() for cmd in step]
        overlap = getattr(self, "grad_overlap", None)
        if overlap is not None:
            overlap.begin(cmds)
        with alltoall.recording(self.timeline):
            self._exec_commands(cmds)

    def _exec_commands(self, cmds):
        overlap = getattr(self, "grad_overlap", None)
        commits = [i for i, cmd in enumerate(cmds) if isinstance(cmd, ds_schedule.CommitP2P)]
        early = set()
        prepost = self._overlap and self.PREPOST_GROUPS > 0 and None not in self._recv_specs
        next_commit = 0
        for i, cmd in enumerate(cmds):
            if i in early:
                continue
            if prepost and isinstance(cmd, ds_schedule.CommitP2P):
                while next_commit < len(commits) and commits[next_commit] <= i:
                    next_commit += 1
                horizon = commits[next_commit + self.PREPOST_GROUPS - 1] if next_commit + self.PREPOST_GROUPS - 1 < len(
                    commits) else len(cmds)
                for j in range(i + 1, horizon):
                    if j not in early and isinstance(cmds[j], (ds_schedule.RecvActivation, ds_schedule.RecvGrad)):
                        self._run_instruction(cmds[j])
                        early.add(j)
            self._run_instruction(cmd)
            if overlap is not None:
                overlap.after(i)

    def _run_instruction(self, cmd):
        if type(cmd) not in self._INSTRUCTION_MAP:
            raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {repr(cmd)}")
        start = time.perf_counter() if self.timeline is not None else 0.0
        self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)
        if self.timeline is not None:
            self.timeline.record(cmd.name, cmd.kwargs, start, time.perf_counter())

    # -- asynchronous point-to-point ----------------------------------------------------

    def _queue_p2p(self, op, tensors, stage):
        before = len(self._p2p_ops)
        super()._queue_p2p(op, tensors, stage)
        self._p2p_keys.extend([self._queue_key] * (len(self._p2p_ops) - before))

    def _exec_recv_activations(self, buffer_id, phase):
        self._queue_key = ("act", buffer_id)
        try:
            super()._exec_recv_activations(buffer_id, phase)
        finally:
            self._queue_key = None

    def _exec_recv_grads(self, buffer_id, phase):
        self._queue_key = ("grad", buffer_id)
        try:
            super()._exec_recv_grads(buffer_id, phase)
        finally:
            self._queue_key = None

    def _exec_commit_p2p(self):
        if not self._overlap:
            self._p2p_keys.clear()
            return super()._exec_commit_p2p()
        if not self._p2p_ops:
            return
        works = dist.batch_isend_irecv(self._p2p_ops)
        for key, work in zip(self._p2p_keys, works):
            if key is None:
                self._pending_sends.append(work)
            else:
                self._pending_recv.setdefault(key, []).append(work)
        self._p2p_ops.clear()
        self._p2p_keys.clear()

    def _send_tensor_meta(self, buffer, recv_stage):
        """DeepSpeed's shape handshake, sent without blocking. Its blocking send
        deadlocks when two ranks first send to each other at the same time (DualPipe's
        two directions do); the receiver's blocking receive still gets it first, as it
        precedes the data on the same link."""
        from deepspeed.runtime.pipe import p2p
        if not self._overlap or not p2p.can_send_recv():
            return super()._send_tensor_meta(buffer, recv_stage)
        import torch
        from deepspeed.runtime.pipe.engine import TENSOR_META_SIZE
        tensors = [buffer] if torch.is_tensor(buffer) else list(buffer)
        meta = [0] if torch.is_tensor(buffer) else [2, len(tensors)]
        for t in tensors:
            meta += [self.DTYPE_TO_ID[t.dtype], t.dim(), *t.shape]
        if len(meta) > TENSOR_META_SIZE:
            raise RuntimeError(f"tensor metadata needs {len(meta)} ints, DeepSpeed's buffer holds {TENSOR_META_SIZE}")
        meta_buffer = torch.zeros(TENSOR_META_SIZE, dtype=torch.int32, device=self.device)
        meta_buffer[:len(meta)] = torch.tensor(meta, dtype=torch.int32)
        work = dist.isend(meta_buffer, self.grid.stage_to_global(stage_id=recv_stage))
        self._pending_sends.append(_KeepAlive(work, meta_buffer))

    def _wait(self, key):
        works = self._pending_recv.pop(key, ())
        start = time.perf_counter() if self.timeline is not None and works else None
        for work in works:
            work.wait()
        if start is not None:
            self.timeline.record("WaitRecv", {"key": list(key)}, start, time.perf_counter())

    def _wait_all(self):
        for works in self._pending_recv.values():
            for work in works:
                work.wait()
        for work in self._pending_sends:
            work.wait()
        self._pending_recv.clear()
        self._pending_sends.clear()

    # -- compute --------------------------------------------------------------------------

    def _exec_forward_pass(self, buffer_id, phase):
        self._wait(("act", buffer_id))
        super()._exec_forward_pass(buffer_id, phase)

    def _exec_backward_pass(self, buffer_id, phase, zb=False):
        self._wait(("grad", buffer_id))
        WeightGradStore.enabled = zb
        try:
            super()._exec_backward_pass(buffer_id, phase)
        finally:
            WeightGradStore.enabled = False
        if zb:
            WeightGradStore.flush()

    def _exec_forward_backward_pass(self, fwd_buffer, fwd_phase, bwd_buffer, bwd_phase):
        def forward():
            self._exec_forward_pass(fwd_buffer, fwd_phase)

        def backward():
            self._exec_backward_pass(bwd_buffer, bwd_phase)

        hook = getattr(self.module, "overlapped_forward_backward", None)
        if self._interleaver is not None:
            # the forward half first: DeepSpeed's forward resets ZeRO's backward-hook
            # bookkeeping, which must not happen in the middle of the other half's backward
            self._interleaver.run(forward, backward)
        elif hook is None:
            forward()
            backward()
        else:
            hook(forward, backward)

    def _exec_weight_pass(self):
        bf16 = self.using_bf16_optimizer
        if bf16:
            # the BF16 optimizer accumulates each backward's bf16 grads into fp32 ones right
            # after it; deferred weight grads arrive later, so add them here, once
            self.optimizer.clear_lp_grads()
        WeightGradStore.pop()
        if bf16:
            self.optimizer.update_hp_grads(clear_lp_grads=True)

    def _exec_reduce_tied_grads(self):
        self._wait_all()
        if WeightGradStore.pending():
            raise RuntimeError(f"{WeightGradStore.pending()} deferred weight-gradient chunks were never run")
        super()._exec_reduce_tied_grads()

    _INSTRUCTION_MAP = {
        **DualPipeVEngine._INSTRUCTION_MAP,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
        ds_schedule.RecvActivation: _exec_recv_activations,
        ds_schedule.RecvGrad: _exec_recv_grads,
        ds_schedule.CommitP2P: _exec_commit_p2p,
        ds_schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        schedules.ForwardBackwardPass: _exec_forward_backward_pass,
        schedules.WeightPass: _exec_weight_pass,
    }


class SeekspeedDualPipeEngine(SeekspeedDualPipeVEngine):
    """Bidirectional DualPipe on DeepSpeed's engine (see ds_ext/pipe/dualpipe.py).

    Both end ranks read every micro-batch of the step from the data iterator: the
    first half travel in direction 0 (inputs on rank 0, labels and loss on rank R-1),
    the second half in direction 1 (inputs on rank R-1, labels and loss on rank 0).
    """

    def __init__(self, *args, **kwargs):
        self._step_batches = None
        super().__init__(*args, **kwargs)
        from .dualpipe import pair_groups
        self._pair_group = pair_groups(self.grid, self.num_stages)

    def _train_schedule(self):
        from .dualpipe import DualPipeSchedule
        return DualPipeSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _inference_schedule(self, micro_batches):
        from .dualpipe import DualPipeSchedule
        return DualPipeSchedule(micro_batches=micro_batches, stages=self.num_stages, stage_id=self.stage_id,
                                forward_only=True)

    def _is_loss_stage(self, phase):
        return (self.stage_id == self.num_stages - 1 and phase == 0) or (self.stage_id == 0 and phase == 1)

    def _is_first_stage_of(self, phase):
        return (self.stage_id == 0 and phase == 0) or (self.stage_id == self.num_stages - 1 and phase == 1)

    def _is_last_rank(self):
        return False      # no V turn: each direction ends on an end rank

    def is_last_stage(self):
        phase = self._active_phase
        if phase in (0, 1):
            return self._is_loss_stage(phase)
        return super().is_last_stage()

    def is_first_stage(self):
        phase = self._active_phase
        if phase in (0, 1):
            return self._is_first_stage_of(phase)
        return self.stage_id == 0

    def _loss_stage_global_rank(self):
        return self.grid.stage_to_global(self.num_stages - 1)

    def set_dataiterator(self, iterator):
        """Both end ranks read data (each is a first stage and a loss stage)."""
        if self.stage_id in (0, self.num_stages - 1):
            self.training_dataloader = None
            self.data_iterator = iterator

    def _exec_load_micro_batch(self, buffer_id):
        half = self.micro_batches // 2
        if buffer_id in (0, half):        # the first load of the step on this end rank
            self._step_batches = [self._next_batch() for _ in range(self.micro_batches)]
            loss_direction = 0 if self.stage_id == self.num_stages - 1 else 1
            for mb in range(half):
                labels = self._step_batches[loss_direction * half + mb][1]
                self.pipe_buffers["labels"][loss_direction * half + mb] = labels.to(self.device)
        inputs = self._step_batches[buffer_id][0]
        self.pipe_buffers["inputs"][buffer_id] = inputs.clone().to(self.device).detach()

    def _exec_backward_pass(self, buffer_id, phase, zb=False):
        super()._exec_backward_pass(buffer_id, phase, zb)
        if self._is_first_stage_of(phase):
            self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_reduce_grads(self):
        from .dualpipe import sum_copy_gradients
        sum_copy_gradients(self.module, self._pair_group, optimizer=self.optimizer)
        super()._exec_reduce_grads()

    def _aggregate_total_loss(self):
        """Both end ranks hold half of the step's losses: sum them over the pipeline,
        average over data-parallel replicas."""
        import torch
        parts = [self.total_loss if self.total_loss is not None else torch.zeros((), device=self.device)]
        names = []
        if self.total_additional_losses:
            names = list(self.total_additional_losses)
            parts += [self.total_additional_losses[n] for n in names]
        elif self.module.get_additional_losses():
            names = list(self.module.get_additional_losses())
            parts += [torch.zeros((), device=self.device) for _ in names]
        flat = torch.stack([p.detach().float().reshape(()) for p in parts])
        dist.all_reduce(flat, group=self.grid.get_pipe_parallel_group())
        flat = self._scale_loss_by_gas(flat)
        self.dp_group_loss = flat[0].clone()
        if self.is_data_parallel:
            dist.all_reduce(flat, group=self.mpu.get_data_parallel_group())
            flat /= self.dp_world_size
        self.agg_additional_losses = ({n: flat[1 + i] for i, n in enumerate(names)} if names else None)
        return flat[0]

    _INSTRUCTION_MAP = {
        **SeekspeedDualPipeVEngine._INSTRUCTION_MAP,
        ds_schedule.LoadMicroBatch: _exec_load_micro_batch,
        ds_schedule.BackwardPass: _exec_backward_pass,
        ds_schedule.ReduceGrads: _exec_reduce_grads,
    }


def _engine_class(schedule, overlap="none"):
    """The engine class the registry names for ``schedule``, under the mixins that
    install gradient compression, the overlapped reduction and async checkpoints, and
    its own constructor options."""
    from ds_ext.comm.install import CompressedReduction
    from ds_ext.checkpoint.engine import AsyncCheckpointing
    from .grad_overlap import OverlappedReduction, with_overlap_map
    spec = schedule_spec(schedule)
    if overlap != "none" and not spec.layer_overlap:
        raise ValueError(f"overlap {overlap!r} interleaves F&B chunks, which only schedules "
                         f"{' and '.join(LAYER_OVERLAP_SCHEDULES)} have; schedule {schedule!r} takes overlap 'none'")
    base = spec.engine_class()
    extra = {}
    if issubclass(base, SeekspeedDualPipeVEngine):
        extra = {"zero_bubble": spec.zero_bubble, "overlap_p2p": spec.async_p2p, "overlap": overlap}
    # Mixins first: each falls through to DeepSpeed unless its part is installed
    return with_overlap_map(type(base.__name__, (AsyncCheckpointing, OverlappedReduction, CompressedReduction, base),
                                 {})), extra


def initialize(*, model, config, model_parameters, schedule, overlap="none", comm=None, checkpoint=None, node_of=None,
               overlap_grad_reduce=False, grad_norm="deepspeed", muon_update="auto", log=print):
    """deepspeed.initialize for a pipeline module, with the engine class ``schedule``
    needs (``overlap`` "layer": F&B chunks interleaved, see ds_ext/pipe/overlap.py); when
    ``comm`` (a ``seekspeed.comm`` section) names a compressor, the
    compressed gradient reduction; when ``checkpoint`` (a ``seekspeed.checkpoint``
    section) names engine async-zstd, that checkpoint engine; with ``overlap_grad_reduce``
    the data-parallel reduction overlapped with the drain (ds_ext/pipe/grad_overlap.py);
    ``grad_norm`` "exact": the layout-independent gradient norm (ds_ext/grad_norm.py);
    ``muon_update``: how DeepSpeed's Muon runs its update (ds_ext/muon.py ``set_update``).
    Follows deepspeed.initialize's pipeline branch
    (config parsed with the module's grid as mpu, optimizer flags, engine), which has
    no hook for choosing the engine class. Returns the engine."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime import zero
    from ds_ext.comm.install import install
    engine_cls, extra = _engine_class(schedule, overlap)
    zero.partition_parameters.shutdown_init_context()
    mpu = model.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    if config_class.optimizer_name == "muon":
        lines = [muon_split(model, model_parameters), set_update(muon_update)]
        if dist.get_rank() == 0:
            for line in lines:
                log(line)
    engine = engine_cls(args=None, model=model, optimizer=None, model_parameters=model_parameters,
                        training_data=None, lr_scheduler=None, mpu=mpu, dist_init_required=None, collate_fn=None,
                        config=config, config_class=config_class, **extra)
    zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    engine.node_of = node_of        # each global rank's node, when the topology plan knows them (recipes' step hooks)
    # CPU FusedAdam's beta powers from the step, not from the process's history: a
    # resumed run then steps bitwise as the uninterrupted one (ds_ext/checkpoint/adam_history.py)
    from ds_ext.checkpoint.adam_history import install as history_free_adam
    history_free_adam(engine.optimizer)
    if grad_norm == "exact":
        from ds_ext.grad_norm import install as exact_norm
        line = exact_norm(engine)
        if dist.get_rank() == 0:
            log(line)
    if comm is not None:
        install(engine, comm, node_of=node_of, log=log)
    if overlap_grad_reduce:
        grad_overlap = engine.enable_grad_overlap()
        if dist.get_rank() == 0:
            log(grad_overlap.describe())
    if checkpoint is not None:
        from ds_ext.checkpoint.engine import install as install_checkpoints
        install_checkpoints(engine, checkpoint, log=log)
    return engine
