"""Pipeline schedules beyond DeepSpeed's, as DeepSpeed instruction streams.

``DualPipeVZBSchedule`` is DeepSpeed's DualPipeV schedule with the two things the
DualPipe reference adds: zero-bubble weight-gradient deferral (backward chunks
marked ``zb`` leave their weight gradients for a later ``WeightPass``) and a single
``ForwardBackwardPass`` for each F&B chunk, which the engine may run overlapped.
Steps are numbered as in the reference (deepseek-ai/DualPipe, dualpipev.py).
"""

from deepspeed.runtime.pipe.schedule import (BackwardPass, BufferOpInstruction, CommitP2P, ForwardPass,
                                             LoadMicroBatch, OptimizerStep, PipeInstruction, PipeSchedule,
                                             RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads, SendActivation,
                                             SendGrad)


class WeightPass(PipeInstruction):
    """Run the weight gradients of the oldest deferred backward chunk."""


class ForwardBackwardPass(PipeInstruction):
    """Forward of one micro-batch and backward of another, as one F&B chunk.

    kwargs: ``fwd_buffer``, ``fwd_phase``, ``bwd_buffer``, ``bwd_phase``.
    """


class DualPipeSteps(PipeSchedule):
    """The eight steps of the DualPipe reference's schedules (shared by DualPipeV and
    the bidirectional DualPipe), zero-bubble W slots (steps 3, 7, 8) and F&B chunks.

    A subclass says where this rank sits: ``span`` ranks, this one at ``position``
    (counted from the nearer end), ``chunks`` micro-batches per phase, ``turn`` (the
    rank where the two phases meet), and, per phase, the direction it runs, whether it
    loads micro-batches and which of the four transfers exist.
    """

    span = position = chunks = turn = None

    def __init__(self, micro_batches, stages, stage_id, forward_only=False):
        super().__init__(micro_batches, stages, stage_id)
        self.forward_only = forward_only

    def direction(self, phase):
        return phase

    def buffer_id(self, direction, index):
        raise NotImplementedError

    def loads(self, phase):
        raise NotImplementedError

    def has_transfer(self, kind, phase):
        """``kind``: recv_fwd, send_fwd, recv_bwd or send_bwd."""
        raise NotImplementedError

    def steps(self):
        span, pos, chunks, turn = self.span, self.position, self.chunks, self.turn
        counters = {name: [0, 0] for name in ("fwd", "bwd", "send_fwd", "send_bwd", "recv_fwd", "recv_bwd")}
        grads = not self.forward_only

        def buffer(phase, counter):
            d = self.direction(phase)
            index = counters[counter][d]
            counters[counter][d] += 1
            return self.buffer_id(d, index)

        def transfer(cls, kind, phase):
            if kind.endswith("bwd") and not grads or not self.has_transfer(kind, phase):
                return []
            return [cls(buffer(phase, kind), phase=self.direction(phase))]

        def recv_forward(phase):
            return transfer(RecvActivation, "recv_fwd", phase)

        def send_forward(phase):
            return transfer(SendActivation, "send_fwd", phase)

        def recv_backward(phase):
            return transfer(RecvGrad, "recv_bwd", phase)

        def send_backward(phase):
            return transfer(SendGrad, "send_bwd", phase)

        def forward(phase):
            buffer_id = buffer(phase, "fwd")
            load = [LoadMicroBatch(buffer_id)] if self.loads(phase) else []
            return load + [ForwardPass(buffer_id, phase=self.direction(phase))]

        def backward(phase, zb=False):
            return [BackwardPass(buffer(phase, "bwd"), phase=self.direction(phase), zb=zb)] if grads else []

        def forward_chunk(phase, recv=True, send=True):
            cmds = (recv_forward(phase) if recv else []) + [CommitP2P()] + forward(phase)
            return cmds + (send_forward(phase) if send else [])

        def backward_chunk(phase, zb=False, send=True):
            cmds = recv_backward(phase) + [CommitP2P()] + backward(phase, zb)
            return cmds + (send_backward(phase) if send else [])

        def forward_backward_chunk(phase0, phase1, recv0=True):
            if not grads:
                return forward_chunk(phase0, recv=recv0)
            cmds = (recv_forward(phase0) if recv0 else []) + recv_backward(phase1) + [CommitP2P()]
            f = forward(phase0)
            bwd = backward(phase1)[0]
            cmds += f[:-1] + [ForwardBackwardPass(fwd_buffer=f[-1].buffer_id, fwd_phase=self.direction(phase0),
                                                  bwd_buffer=bwd.buffer_id, bwd_phase=self.direction(phase1))]
            return cmds + send_forward(phase0) + send_backward(phase1)

        def weight_chunk():
            return [CommitP2P(), WeightPass()] if grads else []

        # Step 1: nF0
        for _ in range((span - pos - 1) * 2):
            yield forward_chunk(0)

        # Step 2: nF0F1
        step_2 = pos + 1
        yield recv_forward(0)
        for i in range(step_2):
            cmds = forward_chunk(0, recv=False, send=turn) + recv_forward(0)
            cmds += forward_chunk(1, send=(not turn) or (i < step_2 - 1))
            yield cmds + ([] if turn else send_forward(0))

        # Step 3: nB1W1F1 (zero bubble)
        for _ in range(span - pos - 1):
            yield backward_chunk(1, zb=True) + recv_forward(1) + weight_chunk() + forward_chunk(1, recv=False)

        # Step 4 (main step): nF0B1F1B0
        for i in range(chunks - span * 2 + pos + 1):
            if i == 0 and turn:
                # not overlapped, to keep the bubble small (as the reference)
                cmds = forward_chunk(0, recv=False, send=False) + send_forward(1)
                cmds += backward_chunk(1, send=False) + send_forward(0) + send_backward(1)
            else:
                cmds = forward_backward_chunk(0, 1, recv0=i > 0)
            yield cmds + forward_backward_chunk(1, 0)

        # Step 5: nB1F1B0
        for _ in range(span - pos - 1):
            yield backward_chunk(1) + forward_backward_chunk(1, 0)

        # Step 6: nB1B0 (the second half of the chunks zero bubble)
        step_6 = pos + 1
        zb = False
        for i in range(step_6):
            if i == step_6 // 2 and pos % 2 == 1:
                zb = True
            cmds = backward_chunk(1, zb=zb)
            if i == step_6 // 2 and pos % 2 == 0:
                zb = True
            yield cmds + backward_chunk(0, zb=zb)

        # Step 7: nWB0 (zero bubble)
        for _ in range(span - pos - 1):
            yield weight_chunk() + backward_chunk(0, zb=True)

        # Step 8: nW
        for _ in range(pos + 1):
            yield weight_chunk()

        cmds = [CommitP2P()]
        if grads:
            cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        yield cmds


class DualPipeVZBSchedule(DualPipeSteps):
    """DualPipeV with zero-bubble W slots and F&B chunks: phase 0 runs the first half
    of the model down the ranks, phase 1 the second half back up (rank r holds stages
    r and 2R-1-r).

    Args:
        micro_batches (int): at least ``2 * stages``.
        stages (int): pipeline ranks (each holds two stages).
        stage_id (int): this pipeline rank.
    """

    def __init__(self, micro_batches, stages, stage_id, forward_only=False):
        super().__init__(micro_batches, stages, stage_id, forward_only=forward_only)
        if micro_batches < 2 * stages:
            raise ValueError(f"DualPipeV needs at least 2 x {stages} micro-batches, got {micro_batches}")
        self.span, self.position, self.chunks = stages, stage_id, micro_batches
        self.turn = self.is_last = stage_id == stages - 1
        self.is_first = stage_id == 0

    def num_pipe_buffers(self):
        return 2 * self.micro_batches

    def buffer_id(self, direction, index):
        return direction * self.micro_batches + index

    def loads(self, phase):
        return self.is_first and phase == 0

    def has_transfer(self, kind, phase):
        # phase 0 enters at rank 0 and turns at the last rank; phase 1 leaves at rank 0
        starts_here = (self.is_first and phase == 0) or (self.is_last and phase == 1)
        ends_here = (self.is_first and phase == 1) or (self.is_last and phase == 0)
        return not (starts_here if kind in ("recv_fwd", "send_bwd") else ends_here)


__all__ = ["WeightPass", "ForwardBackwardPass", "DualPipeSteps", "DualPipeVZBSchedule",
           "BufferOpInstruction"]
