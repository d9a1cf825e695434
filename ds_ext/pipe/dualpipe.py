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
from .schedules import DualPipeSteps


class DualPipeSchedule(DualPipeSteps):
    """The DualPipe schedule for one pipeline rank: the reference's steps with its
    logical phase = direction XOR "rank in the second half", counted from the nearer
    end of the pipeline, turning at the two middle ranks.

    Args:
        micro_batches (int): even and at least ``2 * stages``; half go each way.
        stages (int): pipeline ranks, even.
        stage_id (int): this rank.
    """

    def __init__(self, micro_batches, stages, stage_id, forward_only=False):
        super().__init__(micro_batches, stages, stage_id, forward_only=forward_only)
        if stages % 2:
            raise ValueError(f"DualPipe needs an even number of pipeline ranks, got {stages}")
        if micro_batches % 2 or micro_batches < 2 * stages:
            raise ValueError(f"DualPipe needs an even number of micro-batches >= 2 x {stages}, got {micro_batches}")
        half = stages // 2
        self.span, self.chunks = half, micro_batches // 2
        self.position = min(stage_id, stages - 1 - stage_id)
        self.second_half = int(stage_id >= half)
        self.turn = stage_id in (half - 1, half)

    def num_pipe_buffers(self):
        return self.micro_batches      # direction * (m / 2) + micro-batch

    def direction(self, phase):
        return phase ^ self.second_half

    def buffer_id(self, direction, index):
        return direction * self.chunks + index

    def _first_stage(self, d):
        return (self.stage_id == 0 and d == 0) or (self.stage_id == self.stages - 1 and d == 1)

    def _last_stage(self, d):
        return (self.stage_id == 0 and d == 1) or (self.stage_id == self.stages - 1 and d == 0)

    def loads(self, phase):
        return self._first_stage(self.direction(phase))

    def has_transfer(self, kind, phase):
        d = self.direction(phase)
        return not (self._first_stage(d) if kind in ("recv_fwd", "send_bwd") else self._last_stage(d))


class DualPipeModule(DualPipeVModule):
    """The model cut into ``num_stages`` parts; rank r builds part r (phase 0,
    direction 0) and a copy of part R-1-r (phase 1, direction 1). Embedding and head
    are both on ranks 0 and R-1, so tied weights are shared locally; the copies of
    every stage are reconciled by summing gradients across rank pairs."""

    def _partition_layers(self, method="uniform"):
        # the cut itself is PipelineModule's (or the preset balanced cut), not DualPipeV's doubled one
        super(DualPipeVModule, self)._partition_layers(method)
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


# the copy-sum all-reduces at most this many fp32 elements at a time (256 MiB)
COPY_SUM_BUCKET = 2**26


def optimizer_gradients(optimizer, params):
    """The tensor each of ``params`` has its gradient in when ReduceGrads runs: the
    one DeepSpeed's optimizer reduces, clips and steps on.

    Under DeepSpeed's BF16_Optimizer (bf16 weights with ZeRO-1 and
    ``data_types.grad_accum_dtype: fp32``, or bf16 with ZeRO 0) that is its accumulation
    buffer (``fp32_groups_gradients``, in grad_accum_dtype): every backward, and every
    zero-bubble W slot, adds the bf16 ``.grad`` into it, so ``.grad`` holds only the last
    part. The buffer is marked as holding a gradient (its partner's part makes it one),
    for the norm. Otherwise (fp32; bf16 with ZeRO-1 accumulating in bf16) it is ``.grad``,
    created as zeros where the parameter got none."""
    if hasattr(optimizer, "bf16_groups") and hasattr(optimizer, "fp32_groups_gradients"):
        where = {id(lp): (i, j) for i, group in enumerate(optimizer.bf16_groups) for j, lp in enumerate(group)}
        out = []
        for p in params:
            if id(p) not in where:
                raise RuntimeError(f"a stage-copy parameter of shape {tuple(p.shape)} is not in the BF16 optimizer's "
                                   f"groups: pass every trainable parameter to deepspeed.initialize")
            i, j = where[id(p)]
            optimizer.fp32_groups_has_gradients[i][j] = True
            p._hp_grad = optimizer.fp32_groups_gradients[i][j]
            out.append(p._hp_grad)
        return out
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


def copy_sum_buckets(grads):
    """(bucket, its fp32 flat copy) of consecutive gradients of at most COPY_SUM_BUCKET
    elements (a larger tensor alone): the buckets the copies' sum runs in."""
    start = 0
    while start < len(grads):
        stop, size = start, 0
        while stop < len(grads) and (stop == start or size + grads[stop].numel() <= COPY_SUM_BUCKET):
            size += grads[stop].numel()
            stop += 1
        bucket = grads[start:stop]
        yield bucket, torch.cat([g.reshape(-1).float() for g in bucket])
        start = stop


def sum_copy_gradients(module, group, *, optimizer=None):
    """Sum the gradients of the two copies of each stage (this rank's and its
    partner's) where ``optimizer`` keeps them (``optimizer_gradients``), adding in
    fp32: under BF16_Optimizer with fp32 accumulation, the fp32 accumulated gradients,
    never their bf16 parts. Both ranks add the same two numbers, so they get the same
    bits."""
    params = [p for p in module.copy_parameters() if p.requires_grad]
    grads = optimizer_gradients(optimizer, params)
    for bucket, flat in copy_sum_buckets(grads):
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
