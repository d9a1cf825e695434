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


class DualPipeVZBSchedule(PipeSchedule):
    """DualPipeV with zero-bubble W slots (steps 3, 7, 8) and F&B chunks.

    Args:
        micro_batches (int): at least ``2 * stages``.
        stages (int): pipeline ranks (each holds two stages).
        stage_id (int): this pipeline rank.
    """

    def __init__(self, micro_batches, stages, stage_id, forward_only=False):
        super().__init__(micro_batches, stages, stage_id)
        if micro_batches < 2 * stages:
            raise ValueError(f"DualPipeV needs at least 2 x {stages} micro-batches, got {micro_batches}")
        self.forward_only = forward_only

    def num_pipe_buffers(self):
        return 2 * self.micro_batches

    def steps(self):
        rank, num_ranks, m = self.stage_id, self.stages, self.micro_batches
        is_first, is_last = rank == 0, rank == num_ranks - 1
        counters = {name: [0, 0] for name in ("fwd", "bwd", "send_fwd", "send_bwd", "recv_fwd", "recv_bwd")}

        def buffer(phase, counter):
            micro_batch = counters[counter][phase]
            counters[counter][phase] += 1
            return phase * m + micro_batch

        def recv_forward(phase):
            if (is_first and phase == 0) or (is_last and phase == 1):
                return []
            return [RecvActivation(buffer(phase, "recv_fwd"), phase=phase)]

        def send_forward(phase):
            if (is_first and phase == 1) or (is_last and phase == 0):
                return []
            return [SendActivation(buffer(phase, "send_fwd"), phase=phase)]

        def recv_backward(phase):
            if self.forward_only or (is_first and phase == 1) or (is_last and phase == 0):
                return []
            return [RecvGrad(buffer(phase, "recv_bwd"), phase=phase)]

        def send_backward(phase):
            if self.forward_only or (is_first and phase == 0) or (is_last and phase == 1):
                return []
            return [SendGrad(buffer(phase, "send_bwd"), phase=phase)]

        def forward(phase):
            buffer_id = buffer(phase, "fwd")
            load = [LoadMicroBatch(buffer_id)] if is_first and phase == 0 else []
            return load + [ForwardPass(buffer_id, phase=phase)]

        def backward(phase, zb=False):
            if self.forward_only:
                return []
            return [BackwardPass(buffer(phase, "bwd"), phase=phase, zb=zb)]

        def forward_chunk(phase, recv=True, send=True):
            cmds = (recv_forward(phase) if recv else []) + [CommitP2P()] + forward(phase)
            return cmds + (send_forward(phase) if send else [])

        def backward_chunk(phase, zb=False, send=True):
            cmds = recv_backward(phase) + [CommitP2P()] + backward(phase, zb)
            return cmds + (send_backward(phase) if send else [])

        def forward_backward_chunk(phase0, phase1, recv0=True):
            if self.forward_only:
                return forward_chunk(phase0, recv=recv0)
            cmds = (recv_forward(phase0) if recv0 else []) + recv_backward(phase1) + [CommitP2P()]
            f = forward(phase0)
            load, fwd = f[:-1], f[-1]
            bwd = backward(phase1)[0]
            cmds += load + [ForwardBackwardPass(fwd_buffer=fwd.buffer_id, fwd_phase=phase0, bwd_buffer=bwd.buffer_id,
                                                bwd_phase=phase1)]
            return cmds + send_forward(phase0) + send_backward(phase1)

        def weight_chunk():
            return [] if self.forward_only else [CommitP2P(), WeightPass()]

        # Step 1: nF0
        for _ in range((num_ranks - rank - 1) * 2):
            yield forward_chunk(0)

        # Step 2: nF0F1
        step_2 = rank + 1
        yield recv_forward(0)
        for i in range(step_2):
            cmds = forward_chunk(0, recv=False, send=False) + recv_forward(0)
            cmds += forward_chunk(1, send=(not is_last) or (i < step_2 - 1))
            yield cmds + send_forward(0)

        # Step 3: nB1W1F1 (zero bubble)
        for _ in range(num_ranks - rank - 1):
            yield backward_chunk(1, zb=True) + recv_forward(1) + weight_chunk() + forward_chunk(1, recv=False)

        # Step 4 (main step): nF0B1F1B0
        for i in range(m - num_ranks * 2 + rank + 1):
            if i == 0 and is_last:
                # not overlapped, to keep the bubble small (as the reference)
                cmds = forward_chunk(0, recv=False, send=False) + send_forward(1)
                cmds += backward_chunk(1, send=False) + send_forward(0) + send_backward(1)
            else:
                cmds = forward_backward_chunk(0, 1, recv0=i > 0)
            yield cmds + forward_backward_chunk(1, 0)

        # Step 5: nB1F1B0
        for _ in range(num_ranks - rank - 1):
            yield backward_chunk(1) + forward_backward_chunk(1, 0)

        # Step 6: nB1B0 (the second half of the chunks zero bubble)
        step_6 = rank + 1
        zb = False
        for i in range(step_6):
            if i == step_6 // 2 and rank % 2 == 1:
                zb = True
            cmds = backward_chunk(1, zb=zb)
            if i == step_6 // 2 and rank % 2 == 0:
                zb = True
            yield cmds + backward_chunk(0, zb=zb)

        # Step 7: nWB0 (zero bubble)
        for _ in range(num_ranks - rank - 1):
            yield weight_chunk() + backward_chunk(0, zb=True)

        # Step 8: nW
        for _ in range(rank + 1):
            yield weight_chunk()

        cmds = [CommitP2P()]
        if not self.forward_only:
            cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        yield cmds


def flatten(schedule):
    """All instructions of a schedule, in order."""
    return [cmd for step in schedule.steps() for cmd in step]


__all__ = ["WeightPass", "ForwardBackwardPass", "DualPipeVZBSchedule", "flatten", "BufferOpInstruction"]
