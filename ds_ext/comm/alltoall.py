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
bytes and ``arrive`` returns them as ``codec.unpack`` writes them (decoded, or kept as
bytes by a forwarder that sends them on); the backward sends the gradient as it is (the
encoding is an identity for the gradient, as in FP8 training). With ``group`` None the
rows still go through the codec, so every expert-parallel degree computes on the same
values.

``extra`` tensors (the same rows, any dtypes: a token's routing beside its hidden state)
travel in the same exchange, each row's bytes packed after the main tensor's: one
``all_to_all_single`` of bytes instead of one per tensor. ``dispatch`` and ``arrive``
then return a tuple; the gradients of the floating extras travel back with the main
tensor's, packed the same way (integer extras have none).

While ``recording(timeline)`` is active every all-to-all is recorded twice: as
``AllToAll`` from issue to the end of its wait (in flight; with the bytes one row takes
on the wire) and as ``WaitAllToAll`` for the time the computing thread was blocked on it
(exposed).
"""

import contextlib
import math
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


# The MoE dispatchers' routing beside each row (recipes/layers/dispatch.py), here so that
# the planner counts the bytes the layers send.
def expert_id_dtype(num_experts):
    """The integer dtype a copy's expert travels in (-1 marks an empty slot); the same on
    every rank, since each unpacks what it receives by its own layout."""
    return torch.int16 if num_experts < 2**15 else torch.int32


def slot_bytes(num_experts):
    """Bytes of one routing slot on the wire: the fp32 weight and the expert's index."""
    return 4 + torch.empty((), dtype=expert_id_dtype(num_experts)).element_size()


# a forwarded row's origin (the source rank, the row's place in the source's token
# order), sent on by the MoE dispatcher's forwarder as two int32
ORIGIN_BYTES = 8


class Exchange:
    """One issued all-to-all: ``wait()`` returns its output once the bytes are there.
    ``outs``: every tensor it carries; when it moved packed bytes (a codec, or extra
    tensors), ``wait`` unpacks them into ``outs`` (the first through the codec)."""

    __slots__ = ("outs", "work", "source", "label", "issued", "raw", "parts", "row_bytes")

    def __init__(self, outs, work, source, label, *, raw=None, parts=None, row_bytes=None):
        self.outs, self.work, self.source, self.label = outs, work, source, label
        self.raw, self.parts = raw, parts
        # what one row weighs on the wire (recorded with the exchange)
        self.row_bytes = row_bytes if row_bytes is not None else (
            math.prod(source.shape[1:]) * source.element_size() if source is not None else 0)
        self.issued = time.perf_counter()

    @property
    def out(self):
        return self.outs[0]

    def wait(self):
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            end = time.perf_counter()
            self.work = self.source = None
            if _timeline is not None:
                _timeline.record("AllToAll", {"what": self.label, "row_bytes": self.row_bytes}, self.issued, end)
                _timeline.record("WaitAllToAll", {"what": self.label}, start, end)
        if self.raw is not None:
            for out, (begin, end, codec) in zip(self.outs, self.parts):
                if codec is not None:
                    codec.unpack(self.raw[:, begin:end], out)
                else:
                    _as_bytes(out).copy_(self.raw[:, begin:end])
            self.raw = None
        return self.out


def _as_bytes(t):
    """A contiguous [R, ...] tensor's rows as bytes, uint8 [R, B] (a view; R may be 0)."""
    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def start(tensor, *, out_splits, in_splits, group, label, codec=None, extra=()):
    """Issue ``all_to_all_single`` of ``tensor`` (rows split ``in_splits`` over the
    group's ranks, ``out_splits`` rows received from each) without waiting; then let the
    other half of an interleaved F&B chunk run. ``group`` None: the identity (through
    ``codec``'s round trip if given). ``extra``: tensors of the same rows packed into the
    same exchange (module docstring)."""
    if codec is not None or extra:
        tensors = [t.contiguous() for t in (tensor, *extra)]
        pieces = [codec.encode(tensors[0]) if codec is not None else _as_bytes(tensors[0])]
        pieces += [_as_bytes(t) for t in tensors[1:]]
        parts, end = [], 0
        for i, piece in enumerate(pieces):
            parts.append((end, end + piece.shape[1], codec if i == 0 else None))
            end += piece.shape[1]
        rows = sum(out_splits) if group is not None else tensor.shape[0]
        outs = [t.new_empty((rows, ) + tuple(t.shape[1:])) for t in tensors]
        raw = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        exchange = start(raw, out_splits=out_splits, in_splits=in_splits, group=group, label=label)
        return Exchange(outs, exchange.work, exchange.source, label, raw=exchange.out, parts=parts, row_bytes=end)
    if group is None:
        return Exchange([tensor], None, None, label)
    from deepspeed import comm as dist
    source = tensor.contiguous()
    out = source.new_empty((sum(out_splits), ) + tuple(source.shape[1:]))
    work = dist.all_to_all_single(out, source, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=True)
    exchange = Exchange([out], work, source, label)
    switch()
    return exchange


class Slot:
    """Links a ``dispatch`` with its ``arrive``: the exchange in flight each way."""

    __slots__ = ("forward", "backward")

    def __init__(self):
        self.forward = self.backward = None


class _Dispatch(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, slot, out_splits, in_splits, group, label, codec, *extra):
        ctx.slot, ctx.floats = slot, [e.is_floating_point() for e in extra]
        slot.forward = start(x, out_splits=out_splits, in_splits=in_splits, group=group, label="F " + label,
                             codec=codec, extra=extra)
        outs = slot.forward.outs
        if not extra:
            out = outs[0]
            return out.view_as(out) if group is None and codec is None else out
        # with group None, uncoded and unpacked tensors come back as they went: as views
        return tuple(o.view_as(o) if o is t else o for o, t in zip(outs, (x, *extra)))

    @staticmethod
    def backward(ctx, *_):
        slot, ctx.slot = ctx.slot, None
        exchange, slot.backward = slot.backward, None
        exchange.wait()
        grads = iter(exchange.outs[1:])
        return (exchange.out, None, None, None, None, None, None,
                *[next(grads) if floating else None for floating in ctx.floats])


class _Arrive(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y, slot, out_splits, in_splits, group, label, *extra):
        # the backward sends the gradient back: what came in from each rank returns to it
        ctx.slot, ctx.args = slot, dict(out_splits=in_splits, in_splits=out_splits, group=group, label="B " + label)
        ctx.floats = [e.is_floating_point() for e in extra]
        exchange, slot.forward = slot.forward, None
        exchange.wait()
        if not extra:
            return y.view_as(y)
        return (y.view_as(y), *(e.view_as(e) for e in extra))

    @staticmethod
    def backward(ctx, grad, *extra_grads):
        slot, ctx.slot = ctx.slot, None
        floats = [g for g, floating in zip(extra_grads, ctx.floats) if floating]
        slot.backward = start(grad, extra=floats, **ctx.args)
        # what reaches dispatch's backward is only its cue: it returns the exchange's result
        return (grad, None, None, None, None, None,
                *[g if floating else None for g, floating in zip(extra_grads, ctx.floats)])


def dispatch(x, slot, *, out_splits, in_splits, group, label, codec=None, extra=()):
    """Issue the all-to-all of ``x`` (differentiable; sent through ``codec`` if given, with
    ``extra`` tensors of the same rows packed beside it); its result is read through
    ``arrive(result, slot, ...)`` with the same arguments: ``x``'s rows, or with
    ``extra`` a tuple (``x``'s rows, then each extra's)."""
    return _Dispatch.apply(x, slot, out_splits, in_splits, group, label, codec, *extra)


def arrive(y, slot, *, out_splits, in_splits, group, label, codec=None):
    """Wait for the all-to-all that ``dispatch`` issued into ``slot``; returns its result
    (``y``: what dispatch returned; ``codec``: dispatch's, the issued exchange carries it)."""
    if isinstance(y, tuple):
        return _Arrive.apply(y[0], slot, out_splits, in_splits, group, label, *y[1:])
    return _Arrive.apply(y, slot, out_splits, in_splits, group, label)
