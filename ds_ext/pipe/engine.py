"""seekspeed's pipeline engines and the initialize() that installs them.

``SeekspeedDualPipeVEngine`` is DeepSpeed's DualPipeVEngine running
``DualPipeVZBSchedule``: backward chunks marked ``zb`` defer their weight gradients
to ``WeightPass`` slots, F&B chunks run through the module's
``overlapped_forward_backward`` hook (sequential by default), and point-to-point
transfers are posted asynchronously at each CommitP2P and waited for only where their
tensors are used (a forward waits for its activations, a backward for its output
gradients; sends complete in the background and are all waited for before the
gradient reduction), so transfers run while the rank computes.
"""

import time

from deepspeed import comm as dist
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
from deepspeed.runtime.pipe import schedule as ds_schedule

from . import schedules
from .zero_bubble import WeightGradStore


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
        if self.timeline is None:
            return super()._exec_schedule(pipe_schedule)
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                if type(cmd) not in self._INSTRUCTION_MAP:
                    raise RuntimeError(f"{self.__class__.__name__} does not understand instruction {repr(cmd)}")
                start = time.perf_counter()
                self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)
                self.timeline.record(cmd.name, cmd.kwargs, start, time.perf_counter())


class SeekspeedDualPipeVEngine(_TimedSchedule, DualPipeVEngine):

    def __init__(self, *args, zero_bubble=True, overlap_p2p=True, **kwargs):
        self._zero_bubble = zero_bubble
        self._overlap = overlap_p2p
        self._p2p_keys = []
        self._pending_recv = {}
        self._pending_sends = []
        self._queue_key = None
        super().__init__(*args, **kwargs)
        WeightGradStore.clear()

    # -- schedule ---------------------------------------------------------------------

    def _train_schedule(self):
        if not self._zero_bubble:
            return super()._train_schedule()
        return schedules.DualPipeVZBSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                             stage_id=self.stage_id)

    # -- asynchronous point-to-point ----------------------------------------------------

    def _queue_p2p(self, op, tensors, stage):
        before = len(self._p2p_ops)
        super()._queue_p2p(op, tensors, stage)
        self._p2p_keys += [self._queue_key] * (len(self._p2p_ops) - before)

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
            self._p2p_keys = []
            return super()._exec_commit_p2p()
        if not self._p2p_ops:
            return
        works = dist.batch_isend_irecv(self._p2p_ops)
        for key, work in zip(self._p2p_keys, works):
            if key is None:
                self._pending_sends.append(work)
            else:
                self._pending_recv.setdefault(key, []).append(work)
        self._p2p_ops, self._p2p_keys = [], []

    def _wait(self, key):
        for work in self._pending_recv.pop(key, ()):
            work.wait()

    def _wait_all(self):
        for works in self._pending_recv.values():
            for work in works:
                work.wait()
        for work in self._pending_sends:
            work.wait()
        self._pending_recv, self._pending_sends = {}, []

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
        if hook is None:
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


def _engine_class(schedule):
    from deepspeed.runtime.pipe.engine import PipelineEngine
    if schedule == "1f1b":
        return type("SeekspeedPipelineEngine", (_TimedSchedule, PipelineEngine), {}), {}
    if schedule == "dualpipev":
        return type("SeekspeedDualPipeVEngineAsIs", (_TimedSchedule, DualPipeVEngine), {}), {}
    if schedule == "dualpipev-zb":
        return SeekspeedDualPipeVEngine, {"zero_bubble": True, "overlap_p2p": True}
    raise ValueError(f"no engine for schedule {schedule!r}")


def initialize(*, model, config, model_parameters, schedule):
    """deepspeed.initialize for a pipeline module, with the engine class ``schedule``
    needs. Follows deepspeed.initialize's pipeline branch (config parsed with the
    module's grid as mpu, optimizer flags, engine), which has no hook for choosing
    the engine class. Returns the engine."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime import zero
    engine_cls, extra = _engine_class(schedule)
    zero.partition_parameters.shutdown_init_context()
    mpu = model.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    deepspeed.set_optimizer_flags(config_class, model)
    engine = engine_cls(args=None, model=model, optimizer=None, model_parameters=model_parameters,
                        training_data=None, lr_scheduler=None, mpu=mpu, dist_init_required=None, collate_fn=None,
                        config=config, config_class=config_class, **extra)
    zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine
