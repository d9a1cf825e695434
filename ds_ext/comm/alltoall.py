"""Asynchronous, differentiable all-to-all for expert parallelism.

An all-to-all is issued at once and its result read only where it is used, so the
compute in between runs while the bytes move:

    slot = Slot()
    received = dispatch(sent, slot, out_splits=..., in_splits=..., group=..., label="dispatch")
    shared = shared_expert(x)                   # runs while the dispatch is in flight
    received = arrive(received, slot)           # waits for it here

In the backward pass the roles swap: ``arrive``'s backward issues the reverse
all-to-all of the gradient, ``dispatch``'s backward waits for it, and autograd runs the
nodes recorded between them (the shared expert's backward) in the meantime. Every
issue hands the baton of an interleaved F&B chunk to its other half
(ds_ext.pipe.overlap.switch), which computes while this one's collective is in flight.

With ``group`` None (expert parallelism 1) no bytes move, but the graph has the same
nodes, so autograd visits the same nodes in the same order on every expert-parallel
degree (gradients that several branches add up are added in the same order).

With a ``codec`` (ds_ext.comm.fp8.Fp8Rows) the forward exchange sends ``codec.encode``'s
bytes and ``arrive`` returns them decoded; the backward sends the gradient as it is (the
encoding is an identity for the gradient, as in FP8 training). With ``group`` None the
rows still go through the codec, so every expert-parallel degree computes on the same
values.

While ``recording(timeline)`` is active every all-to-all is recorded twice: as
``AllToAll`` from issue to the end of its wait (in flight) and as ``WaitAllToAll`` for
the time the computing thread was blocked on it (exposed).
"""

import contextlib
import time

import torch

from .turns import switch

_timeline = None


@contextlib.contextmanager
def recording(timeline):
    """Record every all-to-all into ``timeline`` (an engine InstructionTimeline) while active."""
    global _timeline
    previous, _timeline = _timeline, timeline
    try:
        yield
    finally:
        _timeline = previous


class Exchange:
    """One issued all-to-all: ``wait()`` returns its output once the bytes are there
    (decoded into ``out`` when the exchange carries a codec's bytes)."""

    __slots__ = ("out", "work", "source", "label", "issued", "raw", "codec")

    def __init__(self, out, work, source, label, *, raw=None, codec=None):
        self.out, self.work, self.source, self.label = out, work, source, label
        self.raw, self.codec = raw, codec
        self.issued = time.perf_counter()

    def wait(self):
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            end = time.perf_counter()
            self.work = self.source = None
            if _timeline is not None:
                _timeline.record("AllToAll", {"what": self.label}, self.issued, end)
                _timeline.record("WaitAllToAll", {"what": self.label}, start, end)
        if self.raw is not None:
            self.out.copy_(self.codec.decode(self.raw))
            self.raw = None
        return self.out


def start(tensor, *, out_splits, in_splits, group, label, codec=None):
    """Issue ``all_to_all_single`` of ``tensor`` (rows split ``in_splits`` over the
    group's ranks, ``out_splits`` rows received from each) without waiting; then let the
    other half of an interleaved F&B chunk run. ``group`` None: the identity (through
    ``codec``'s round trip if given)."""
    if codec is not None:
        raw = codec.encode(tensor.contiguous())
        rows = sum(out_splits) if group is not None else tensor.shape[0]
        out = tensor.new_empty((rows, ) + tuple(tensor.shape[1:]))
        exchange = start(raw, out_splits=out_splits, in_splits=in_splits, group=group, label=label)
        return Exchange(out, exchange.work, exchange.source, label, raw=exchange.out, codec=codec)
    if group is None:
        return Exchange(tensor, None, None, label)
    from deepspeed import comm as dist
    source = tensor.contiguous()
    out = source.new_empty((sum(out_splits), ) + tuple(source.shape[1:]))
    work = dist.all_to_all_single(out, source, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=True)
    exchange = Exchange(out, work, source, label)
    switch()
    return exchange


class Slot:
    """Links a ``dispatch`` with its ``arrive``: the exchange in flight each way."""

    __slots__ = ("forward", "backward")

    def __init__(self):
        self.forward = self.backward = None


class _Dispatch(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, slot, out_splits, in_splits, group, label, codec):
        ctx.slot = slot
        slot.forward = start(x, out_splits=out_splits, in_splits=in_splits, group=group, label="F " + label,
                             codec=codec)
        out = slot.forward.out
        return out.view_as(out) if group is None and codec is None else out

    @staticmethod
    def backward(ctx, _):
        slot, ctx.slot = ctx.slot, None
        exchange, slot.backward = slot.backward, None
        return exchange.wait(), None, None, None, None, None, None


class _Arrive(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y, slot, out_splits, in_splits, group, label):
        # the backward sends the gradient back: what came in from each rank returns to it
        ctx.slot, ctx.args = slot, dict(out_splits=in_splits, in_splits=out_splits, group=group, label="B " + label)
        exchange, slot.forward = slot.forward, None
        exchange.wait()
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        slot, ctx.slot = ctx.slot, None
        slot.backward = start(grad, **ctx.args)
        # what reaches dispatch's backward is only its cue: it returns the exchange's result
        return grad, None, None, None, None, None


def dispatch(x, slot, *, out_splits, in_splits, group, label, codec=None):
    """Issue the all-to-all of ``x`` (differentiable; sent through ``codec`` if given);
    its result is read through ``arrive(result, slot, ...)`` with the same arguments."""
    return _Dispatch.apply(x, slot, out_splits, in_splits, group, label, codec)


def arrive(y, slot, *, out_splits, in_splits, group, label, codec=None):
    """Wait for the all-to-all that ``dispatch`` issued into ``slot``; returns its result
    (``codec``: dispatch's; the issued exchange carries it)."""
    return _Arrive.apply(y, slot, out_splits, in_splits, group, label)
