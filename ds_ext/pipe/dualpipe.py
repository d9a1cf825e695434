"""Bidirectional DualPipe (DeepSeek-V3): every pipeline rank r holds stage r of the
model for micro-batches travelling 0 -> R-1 (direction 0) and a copy of stage R-1-r
for micro-batches travelling R-1 -> 0 (direction 1). Half of a step's micro-batches
go each way; ranks r and R-1-r hold the same two stages and sum their gradients
before the optimizer step, so both copies stay identical. R must be even.

Instructions carry ``phase`` = direction; the schedule's steps follow the reference
(deepseek-ai/DualPipe, dualpipe.py), whose logical phase is direction XOR "rank in
the second half".
"""

import torch
from deepspeed import comm as dist
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.schedule import (BackwardPass, CommitP2P, ForwardPass, LoadMicroBatch, OptimizerStep,
                                             PipeSchedule, RecvActivation, RecvGrad, ReduceGrads, ReduceTiedGrads,
                                             SendActivation, SendGrad)

from .schedules import ForwardBackwardPass, WeightPass


def direction_and_stage(rank, direction, ranks):
    """(direction, model stage) of the stage copy ``rank`` runs for ``direction``."""
    return direction, rank if direction == 0 else ranks - 1 - rank


def stage_direction(rank, stage, ranks):
    """Which direction's copy of ``stage`` lives on ``rank``."""
    return 0 if stage == rank else 1


class DualPipeSchedule(PipeSchedule):
    """The DualPipe schedule for one pipeline rank.

    Args:
        micro_batches (int): even and at least ``2 * stages``; half go each way.
        stages (int): pipeline ranks, even.
        stage_id (int): this rank.
    """

    def __init__(self, micro_batches, stages, stage_id, forward_only=False):
        super().__init__(micro_batches, stages, stage_id)
        if stages % 2:
            raise ValueError(f"DualPipe needs an even number of pipeline ranks, got {stages}")
        if micro_batches % 2 or micro_batches < 2 * stages:
            raise ValueError(f"DualPipe needs an even number of micro-batches >= 2 x {stages}, got {micro_batches}")
        self.forward_only = forward_only

    def num_pipe_buffers(self):
        return self.micro_batches      # direction * (m / 2) + micro-batch

    def steps(self):
        rank, num_ranks, m = self.stage_id, self.stages, self.micro_batches
        half_chunks, num_half_ranks = m // 2, num_ranks // 2
        half_rank = min(rank, num_ranks - 1 - rank)
        second_half = int(rank >= num_half_ranks)
        is_middle = rank in (num_half_ranks - 1, num_half_ranks)
        counters = {name: [0, 0] for name in ("fwd", "bwd", "send_fwd", "send_bwd", "recv_fwd", "recv_bwd")}

        def direction(phase):
            return phase ^ second_half

        def first_stage(d):
            return (rank == 0 and d == 0) or (rank == num_ranks - 1 and d == 1)

        def last_stage(d):
            return (rank == 0 and d == 1) or (rank == num_ranks - 1 and d == 0)

        def buffer(d, counter):
            micro_batch = counters[counter][d]
            counters[counter][d] += 1
            return d * half_chunks + micro_batch

        def recv_forward(phase):
            d = direction(phase)
            return [] if first_stage(d) else [RecvActivation(buffer(d, "recv_fwd"), phase=d)]

        def send_forward(phase):
            d = direction(phase)
            return [] if last_stage(d) else [SendActivation(buffer(d, "send_fwd"), phase=d)]

        def recv_backward(phase):
            d = direction(phase)
            return [] if self.forward_only or last_stage(d) else [RecvGrad(buffer(d, "recv_bwd"), phase=d)]

        def send_backward(phase):
            d = direction(phase)
            return [] if self.forward_only or first_stage(d) else [SendGrad(buffer(d, "send_bwd"), phase=d)]

        def forward(phase):
            d = direction(phase)
            buffer_id = buffer(d, "fwd")
            return ([LoadMicroBatch(buffer_id)] if first_stage(d) else []) + [ForwardPass(buffer_id, phase=d)]

        def backward(phase, zb=False):
            d = direction(phase)
            return [] if self.forward_only else [BackwardPass(buffer(d, "bwd"), phase=d, zb=zb)]

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
            bwd = backward(phase1)[0]
            cmds += f[:-1] + [ForwardBackwardPass(fwd_buffer=f[-1].buffer_id, fwd_phase=direction(phase0),
                                                  bwd_buffer=bwd.buffer_id, bwd_phase=direction(phase1))]
            return cmds + send_forward(phase0) + send_backward(phase1)

        def weight_chunk():
            return [] if self.forward_only else [CommitP2P(), WeightPass()]

        # Step 1: nF0
        for _ in range((num_half_ranks - half_rank - 1) * 2):
            yield forward_chunk(0)

        # Step 2: nF0F1
        step_2 = half_rank + 1
        yield recv_forward(0)
        for i in range(step_2):
            cmds = forward_chunk(0, recv=False, send=is_middle) + recv_forward(0)
            cmds += forward_chunk(1, send=(not is_middle) or (i < step_2 - 1))
            yield cmds + ([] if is_middle else send_forward(0))

        # Step 3: nB1W1F1 (zero bubble)
        for _ in range(num_half_ranks - half_rank - 1):
            yield backward_chunk(1, zb=True) + recv_forward(1) + weight_chunk() + forward_chunk(1, recv=False)

        # Step 4 (main step): nF0B1F1B0
        for i in range(half_chunks - num_ranks + half_rank + 1):
            if i == 0 and is_middle:
                cmds = forward_chunk(0, recv=False, send=False) + send_forward(1)
                cmds += backward_chunk(1, send=False) + send_forward(0) + send_backward(1)
            else:
                cmds = forward_backward_chunk(0, 1, recv0=i > 0)
            yield cmds + forward_backward_chunk(1, 0)

        # Step 5: nB1F1B0
        for _ in range(num_half_ranks - half_rank - 1):
            yield backward_chunk(1) + forward_backward_chunk(1, 0)

        # Step 6: nB1B0 (the second half of the chunks zero bubble)
        step_6 = half_rank + 1
        zb = False
        for i in range(step_6):
            if i == step_6 // 2 and half_rank % 2 == 1:
                zb = True
            cmds = backward_chunk(1, zb=zb)
            if i == step_6 // 2 and half_rank % 2 == 0:
                zb = True
            yield cmds + backward_chunk(0, zb=zb)

        # Step 7: nWB0 (zero bubble)
        for _ in range(num_half_ranks - half_rank - 1):
            yield weight_chunk() + backward_chunk(0, zb=True)

        # Step 8: nW
        for _ in range(half_rank + 1):
            yield weight_chunk()

        cmds = [CommitP2P()]
        if not self.forward_only:
            cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        yield cmds


class DualPipeModule(DualPipeVModule):
    """The model cut into ``num_stages`` parts; rank r builds part r (phase 0,
    direction 0) and a copy of part R-1-r (phase 1, direction 1). Embedding and head
    are both on ranks 0 and R-1, so tied weights are shared locally; the copies of
    every stage are reconciled by summing gradients across rank pairs."""

    def _partition_layers(self, method="uniform"):
        PipelineModule._partition_layers(self, method)
        r, stages = self.stage_id, self.num_stages
        if stages % 2:
            raise ValueError(f"DualPipe needs an even number of pipeline stages, got {stages}")
        self.phase_bounds = [(self.parts[r], self.parts[r + 1]), (self.parts[stages - 1 - r], self.parts[stages - r])]

    def stage_owner(self, layer_idx):
        return PipelineModule.stage_owner(self, layer_idx)

    def _build(self):
        super()._build()
        # every stage exists twice; gradient norms (clipping) must count it once: the
        # direction-0 copy counts, the direction-1 copy is marked replicated, as
        # DeepSpeed marks the non-owning copies of tied weights
        start, stop = self.phase_bounds[1]
        for idx in range(start, stop):
            module = getattr(self, str(idx), None)
            for p in (module.parameters() if module is not None else ()):
                p.ds_pipe_replicated = True
        if self.stage_id == self.num_stages - 1:
            for module in self.tied_modules.values():
                for p in module.parameters():
                    p.ds_pipe_replicated = True

    def _index_tied_modules(self):
        return {}

    def save_state_dict(self, *args, **kwargs):
        self.activate_phase(0)        # the direction-1 copy on the partner rank is identical
        PipelineModule.save_state_dict(self, *args, **kwargs)

    def copy_parameters(self):
        """This rank's parameters in an order its partner (rank R-1-r) shares: by model
        stage, then layer, then name; tied modules last."""
        params = []
        ordered = sorted(self.phase_bounds)
        for start, stop in ordered:
            for idx in range(start, stop):
                module = getattr(self, str(idx), None)
                if module is not None:
                    params += [p for _, p in sorted(module.named_parameters())]
        for key in sorted(self.tied_modules):
            params += [p for _, p in sorted(self.tied_modules[key].named_parameters())]
        return params


def pair_groups(grid, stages):
    """Process groups of the rank pairs (stage r, stage R-1-r) of each data-parallel
    index; every rank calls this (dist.new_group is collective)."""
    mine = None
    for dp in range(grid.data_parallel_size):
        for r in range(stages // 2):
            ranks = sorted([grid.stage_to_global(stage_id=r, data=dp),
                            grid.stage_to_global(stage_id=stages - 1 - r, data=dp)])
            group = dist.new_group(ranks=ranks)
            if dist.get_rank() in ranks:
                mine = group
    return mine


def sum_copy_gradients(module, group):
    """Sum the gradients of the two copies of each stage (this rank's and its partner's)."""
    params = module.copy_parameters()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
        offset += n
