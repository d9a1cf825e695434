"""Gradient compressors.

A compressor turns one rank's part of a gradient into what goes on the wire and
the peers' parts back into their sum. ``exchange(key, region, views, group)`` is a
generator (``region``: the chunk, a contiguous fp32 buffer; ``views``: the tensors in
it, shaped, for compressors that work per tensor): it yields the collectives it needs (``Collective``), the driver in
``reducer.py`` runs them asynchronously and resumes it when they are done, and it
ends with the sum over the group's ranks, times ``scale``, written into ``region`` in
place (the scale folded in where it is cheap: on the few values top-k sends, on
PowerSGD's small factor). Written as
generators, several chunks can be in flight at once: chunk i+1 is compressed while
chunk i is on the wire.

State (error-feedback residuals, PowerSGD's warm-start Q, DGC momentum) is kept per
``key``: the driver cuts the gradient the same way every step, so a key always names
the same elements.

A non-finite value anywhere in a rank's input makes the whole output non-finite on
every rank (each payload carries a flag), so DeepSpeed's overflow check sees it as
it would without compression; the state is then left as it was, as the step will be
skipped.
"""

import math
import zlib
from dataclasses import dataclass, field

import torch


@dataclass
class Collective:
    """One collective the driver runs: ``all_reduce`` (sum ``tensor`` in place),
    ``all_gather`` (fill ``out`` with every rank's ``tensor``), ``broadcast`` (from
    global rank ``src``) or ``noop`` (keeps ranks that skip a phase in step)."""
    kind: str
    tensor: torch.Tensor | None = None
    group: object = None
    out: list = field(default_factory=list)
    src: int = 0


class ScratchPool:
    """fp32 buffers by size, handed out and given back: the chunks in flight use as
    many as are in flight at once. ``per_size`` bounds the buffers kept of one size and
    ``sizes`` the sizes kept (the least recently given back goes first), so a layout
    that changes from call to call (another chunk length, another tail) cannot make it
    grow: a buffer given back beyond the bounds is dropped, and the next take allocates."""

    # a compressor's bounds: per chunk in flight it takes a few buffers of a size (TwoPhase:
    # the encoded input, the decoded sum, the tail segment and the committed residuals handed
    # back; TopK: the magnitudes and the accumulators swapped in each step), so 8 of a size
    # covers 2 chunks in flight with room
    COMPRESSOR_BOUNDS = {"per_size": 8, "sizes": 8}

    def __init__(self, per_size=None, sizes=None):
        self.free = {}
        self.per_size, self.sizes = per_size, sizes

    def take(self, numel, device):
        stack = self.free.get((numel, device))
        return stack.pop() if stack else torch.empty(numel, dtype=torch.float32, device=device)

    def give(self, buf):
        key = (buf.numel(), buf.device)
        stack = self.free.pop(key, [])
        self.free[key] = stack          # most recently given back last
        if self.per_size is None or len(stack) < self.per_size:
            stack.append(buf)
        while self.sizes is not None and len(self.free) > self.sizes:
            del self.free[next(iter(self.free))]

    def bytes(self):
        return sum(b.numel() * b.element_size() for stack in self.free.values() for b in stack)


def _poison(region):
    region.fill_(float("nan"))


class Dense:
    """No compression, or a cast to 16 bits for the wire (``bf16``, ``fp16``)."""
    phases = 1
    splittable = True

    def __init__(self, dtype=torch.float32):
        self.dtype = dtype

    def wants(self, shape):
        return True

    def exchange(self, key, region, views, group, scale=1.0):
        flat = region
        if self.dtype == torch.float32:
            yield Collective("all_reduce", flat, group)
        else:
            wire = flat.to(self.dtype)
            yield Collective("all_reduce", wire, group)
            flat.copy_(wire)
        if scale != 1.0:
            flat.mul_(scale)


def _cpu_accelerator():
    """Whether DeepSpeed runs on its CPU accelerator (where gradients are CPU tensors)."""
    try:
        from deepspeed.accelerator import get_accelerator
        return get_accelerator().device_name() == "cpu"
    except Exception:            # no DeepSpeed: torch alone, build when a CPU gradient comes
        return False


class TopK:
    """Keep ``ratio`` of each tensor's entries, the largest in magnitude; the sparse
    all-reduce is an all-gather of (value, index) pairs summed locally.

    ``selection``: ``exact`` is torch.topk over the chunk; ``sampled`` (DGC) takes the
    threshold from the top entries of a random sample and selects by threshold, with an
    exact top-k only over the few candidates when the threshold lets through too many.
    ``error_feedback`` adds what was not sent to the next step's gradient.
    ``momentum`` > 0 is DGC's momentum correction: the momentum is accumulated locally
    and selected from, so it is meant for plain SGD (an optimizer with its own momentum
    would apply it twice).
    """
    phases = 1
    splittable = True

    def __init__(self, *, ratio, selection="sampled", sample_ratio=0.01, error_feedback=True, momentum=0.0,
                 kernel="auto", seed=0):
        self.ratio, self.selection, self.sample_ratio = ratio, selection, sample_ratio
        self.error_feedback, self.momentum = error_feedback, momentum
        self.state = {}
        # this step's accumulators and the magnitudes selected from, in buffers the chunks
        # before gave back: a chunk's own accumulators are all it keeps between steps
        self.pool = ScratchPool(**ScratchPool.COMPRESSOR_BOUNDS)
        self.generator = torch.Generator().manual_seed(seed)
        self.kernel = kernel
        self._kernel_module = None
        if self.uses_kernel() and _cpu_accelerator():     # build now, not in the first step's reduction
            self._load_kernel()

    def uses_kernel(self):
        """Whether CPU gradients go through the fused kernel (when it builds)."""
        return self.kernel != "torch" and self.selection == "sampled"

    def _load_kernel(self):
        from . import kernels
        self._kernel_module = kernels.topk_select(required=self.kernel == "fused")
        return self._kernel_module

    def _fused(self, device):
        """The fused CPU kernel when it applies (sampled selection of CPU tensors)."""
        if device.type != "cpu" or not self.uses_kernel():
            return None
        return self._kernel_module if self._kernel_module is not None else self._load_kernel()

    def wants(self, shape):
        return True

    def count(self, numel):
        return max(1, int(math.ceil(numel * self.ratio)))

    def _exact(self, n, k):
        return self.selection == "exact" or k * 8 >= n

    def _threshold(self, n, magnitude_at):
        """DGC's threshold: the ``ratio`` quantile of the magnitudes at a random sample
        of positions (``magnitude_at(positions)``)."""
        samples = min(n, max(int(n * self.sample_ratio), 64 * int(math.ceil(1 / self.ratio))))
        pick = torch.randint(n, (samples,), generator=self.generator)
        return torch.topk(magnitude_at(pick), max(1, int(math.ceil(samples * self.ratio))), sorted=False).values.min()

    @staticmethod
    def _at_most(idx, magnitude_at, k):
        return idx[torch.topk(magnitude_at(idx), k, sorted=False).indices] if idx.numel() > k else idx

    def select(self, mag, k):
        """Indices of (at most) the k largest of ``mag`` (magnitudes)."""
        n = mag.numel()
        if self._exact(n, k):
            return torch.topk(mag, k, sorted=False).indices
        threshold = self._threshold(n, lambda pick: mag.index_select(0, pick.to(mag.device)))
        idx = torch.nonzero(mag >= threshold).view(-1)
        return self._at_most(idx, lambda i: mag[i], k)

    def _select_per_tensor(self, mag, sizes):
        """Each tensor keeps its own ``ratio`` (per layer, as DGC does), so layers
        whose gradients are small in magnitude still send their largest entries."""
        picks, offset = [], 0
        for n in sizes:
            picks.append(self.select(mag[offset:offset + n], self.count(n)) + offset)
            offset += n
        return torch.cat(picks)

    def exchange(self, key, region, views, group, scale=1.0):
        # This step's accumulators are written into pooled buffers and committed (the
        # old ones given back) only when the exchange succeeded, so a skipped step leaves
        # the state exactly as it was; in steady state no step allocates gradient-sized memory.
        flat = region
        sizes = [v.numel() for v in views]
        k = sum(self.count(n) for n in sizes)
        st = self.state.get(key, {})
        payload = torch.zeros(2 * k + 1, device=flat.device)
        fused, new = self._fused(flat.device), {}
        if fused is not None:
            new, acc, idx, finite = self._accumulate_select_fused(fused, flat, st, sizes)
        else:
            finite = bool(torch.isfinite(flat.sum()))   # one pass; an overflowing sum is a gradient worth skipping
            if finite:
                new = self._accumulate(flat, st)
                acc = new.get("v", new.get("residual", new.get("u", flat)))
                mag = torch.abs(acc, out=self._take(acc))
                idx = self._select_per_tensor(mag, sizes)
                self.pool.give(mag)
        if finite:
            payload[:idx.numel()] = acc[idx]
            payload[k:k + idx.numel()] = idx.to(torch.int32).view(torch.float32)
        else:
            payload[-1] = float("nan")
            self._give_back(new)
        out = [torch.empty_like(payload) for _ in range(torch.distributed.get_world_size(group))]
        yield Collective("all_gather", payload, group, out=out)
        gathered = torch.stack(out)
        if not bool(torch.isfinite(gathered[:, -1]).all()):
            if finite:
                self._give_back(new)
            _poison(region)
            return
        values = gathered[:, :k].reshape(-1) * scale
        indices = gathered[:, k:2 * k].contiguous().view(torch.int32).reshape(-1).long()
        flat.zero_().index_add_(0, indices, values)
        if new:                # what was sent leaves the accumulators (momentum factor masking too)
            for name in ("u", "v", "residual"):
                if name in new:
                    new[name][idx] = 0.0
            self._give_back(st)
            self.state[key] = new

    def _give_back(self, accumulators):
        for buf in accumulators.values():
            self.pool.give(buf)

    def _take(self, like):
        return self.pool.take(like.numel(), like.device)

    def _accumulate_select_fused(self, fused, flat, st, sizes):
        """The fused kernel's version of _accumulate and _select_per_tensor, with the
        same result: the last accumulator (residual = residual + gradient, or with
        momentum v = v + u) is summed and selected from in one pass per tensor, from a
        threshold sampled first, so the selection is the one torch ops would make. A
        NaN always counts as selected and any non-finite value is reported (the torch
        path sums the chunk for that). Returns (new accumulators, acc, idx, finite)."""
        new = {}
        # a skipped step must not move the sampling generator either, or the selections
        # after it would no longer be the torch path's
        generator_state = self.generator.get_state()
        if self.momentum > 0:      # u = gradient + m u, in torch (the multiply-add is torch's to round)
            u = self._take(flat)
            if "u" in st:
                torch.add(flat, st["u"], alpha=self.momentum, out=u)
            else:
                u.copy_(flat)
            new["u"] = u
            x, name = u, "v"
        else:
            x, name = flat, "residual"
        y = out = None
        if self.error_feedback:
            out = self._take(x)
            if name in st:
                y = st[name]
            else:
                out.copy_(x)      # the first step's accumulator is the input itself
            new[name] = out
        acc = out if out is not None else x
        picks, offset = [], 0
        for n in sizes:
            part = slice(offset, offset + n)
            xs, ys, outs = x[part], (y[part] if y is not None else None), (out[part] if y is not None else None)
            k = self.count(n)
            if self._exact(n, k):
                _, bad = fused.accumulate_select(xs, ys, outs, math.inf)   # sums; reports non-finite
                sel = None if bad else torch.topk(acc[part].abs(), k, sorted=False).indices
            else:
                def magnitude_at(pick, xs=xs, ys=ys):
                    sample = xs.index_select(0, pick)
                    return (ys.index_select(0, pick) + sample if ys is not None else sample).abs()
                threshold = self._threshold(n, magnitude_at)
                hits, bad = fused.accumulate_select(xs, ys, outs, float(threshold))
                sel = None if bad else self._at_most(hits, lambda i: acc[part][i].abs(), k)  # noqa: B023
            if bad:              # the step is skipped: no need to select from the rest
                self.generator.set_state(generator_state)
                return new, acc, None, False      # the caller gives ``new`` back
            picks.append(sel + offset)
            offset += n
        return new, acc, torch.cat(picks), True

    def _accumulate(self, flat, st):
        """This step's accumulators, {} when there are none (no error feedback, no momentum),
        each in a pooled buffer."""
        def into(name, value_fn, clone_of):
            out = self._take(clone_of)
            if name in st:
                return value_fn(out)
            return out.copy_(clone_of)
        if self.momentum > 0:
            u = into("u", lambda out: torch.add(flat, st["u"], alpha=self.momentum, out=out), flat)
            if not self.error_feedback:
                return {"u": u}
            v = into("v", lambda out: torch.add(st["v"], u, out=out), u)
            return {"u": u, "v": v}
        if self.error_feedback:
            return {"residual": into("residual", lambda out: torch.add(st["residual"], flat, out=out), flat)}
        return {}


class Int8:
    """Block-wise int8: one fp32 scale (max |x| / 127) per ``block_size`` entries; the
    all-reduce is an all-gather of codes and scales, dequantised and summed locally."""
    phases = 1
    splittable = True

    def __init__(self, *, block_size=256, error_feedback=True):
        self.block_size, self.error_feedback = block_size, error_feedback
        self.state = {}

    def wants(self, shape):
        return True

    def exchange(self, key, region, views, group, scale=1.0):
        flat = region
        n, b = flat.numel(), self.block_size
        blocks = -(-n // b)
        st = self.state.get(key)
        acc = flat + st["residual"] if st is not None and self.error_feedback else flat.clone()
        padded = torch.zeros(blocks * b, device=flat.device)
        padded[:n] = acc
        rows = padded.view(blocks, b)
        block_scale = rows.abs().amax(dim=1) / 127.0
        finite = bool(torch.isfinite(block_scale).all())
        safe = torch.where(block_scale > 0, block_scale, torch.ones_like(block_scale))
        codes = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8) if finite else \
            torch.zeros(blocks, b, dtype=torch.int8, device=flat.device)
        head = torch.cat([block_scale if finite else torch.full_like(block_scale, float("nan")),
                          block_scale.new_zeros(1)])
        payload = torch.cat([head.view(torch.uint8), codes.view(-1).view(torch.uint8)])
        out = [torch.empty_like(payload) for _ in range(torch.distributed.get_world_size(group))]
        yield Collective("all_gather", payload, group, out=out)
        head_bytes = (blocks + 1) * 4
        scales = torch.stack([p[:head_bytes].view(torch.float32)[:blocks] for p in out])
        if not bool(torch.isfinite(scales).all()):
            _poison(region)
            return
        total = torch.zeros(blocks, b, device=flat.device)
        scales = scales * scale
        for r, p in enumerate(out):
            total += p[head_bytes:].view(torch.int8).view(blocks, b).float() * scales[r][:, None]
        flat.copy_(total.view(-1)[:n])
        if self.error_feedback:
            mine = codes.float() * block_scale[:, None]
            self.state[key] = {"residual": acc - mine.view(-1)[:n]}


class _BlockCodec:
    """A block quantiser over [blocks, block_size] fp32 rows: ``encode(rows, residual=)``
    gives (scales [blocks] fp32, codes uint8) and, with ``residual``, leaves in ``rows``
    what the encoding held back (rows - decoded); ``decode_into(scales, codes, out,
    accumulate=, factor=)`` writes (or adds) ``factor`` x the decoded rows into ``out``. In
    torch ops each code byte is looked up in a 256-entry table of the values it stands
    for (one gather), then scaled per block. A non-finite input gives a non-finite scale
    (which the receivers check)."""
    per_byte = 1
    table = None

    def __init__(self, kernel="auto"):
        self.kernel = kernel
        self._module = None

    def fused(self, device):
        """The C++ kernel module for CPU tensors when this codec has one and it applies."""
        return None

    def _table(self, device):
        if self.table is None or self.table.device != device:
            self.table = self.values(torch.arange(256, dtype=torch.int64)).to(torch.float32).to(device)
        return self.table

    def encode_momentum(self, rows, g, m, w, *, local, beta1, residual=False):
        """``rows`` (the padded blocks) := local x g + beta1 x m (+ w, the worker
        residual), each product and sum rounded on its own, zero past g's length; then
        encoded as ``encode`` does. 1-bit Adam's momentum of this rank, formed where it
        is encoded. ``m``: fp32 entries, or (scales, codes) of this codec on ``rows``'
        block grid (M as the all-gather delivered it), which stand for their decoding."""
        n, x = g.numel(), rows.view(-1)
        if isinstance(m, tuple):
            self.decode_into(*m, rows)
            x[:n].mul_(beta1).add_(torch.mul(g, local))     # b1 m + local g: the sum is the same either way round
        else:
            torch.mul(g, local, out=x[:n])
            x[:n].add_(torch.mul(m, beta1))
        if w is not None:
            x[:n].add_(w[:n])
        x[n:].zero_()
        return self.encode(rows, residual)

    def encode(self, rows, residual=False):
        scales, codes = self.encode_torch(rows)
        if residual:
            rows.sub_(self.decode_into(scales, codes, torch.empty_like(rows)))
        return scales, codes

    def decode_into(self, scales, codes, out, accumulate=False, factor=1.0):
        if factor != 1.0:
            scales = scales * factor
        target = torch.empty_like(out) if accumulate else out
        torch.index_select(self._table(codes.device), 0, codes.long(), out=target.view(-1, self.per_byte))
        target.mul_(scales[:, None])
        if accumulate:
            out.add_(target)
        return out


class _SignCodec(_BlockCodec):
    """1 bit per entry (its sign), one scale per block: the block's mean magnitude,
    which minimises the squared error of scale x sign (1-bit Adam's scale is the
    norm over sqrt(n); per block, layers of different magnitude keep their own). On CPU
    the fused kernel (csrc/sign_codec.cpp) encodes in one pass, the residual included,
    and decodes in one."""
    per_byte = 8
    # bit j of a byte (from the top) is entry j; 8 entries of 0/1 packed by one multiply:
    # the product's top byte gathers entry j's byte shifted to bit 7 - j (no carries)
    _PACK = 0x8040201008040201

    @staticmethod
    def values(byte):
        return ((byte[:, None] >> torch.arange(7, -1, -1)) & 1) * 2 - 1

    def __init__(self, kernel="auto"):
        super().__init__(kernel)
        if kernel != "torch" and _cpu_accelerator():     # build now, not in the first step's reduction
            self.fused(torch.device("cpu"))

    def fused(self, device):
        if device.type != "cpu" or self.kernel == "torch":
            return None
        if self._module is None:
            from . import kernels
            self._module = kernels.sign_codec(required=self.kernel == "fused") or False
        return self._module or None

    def encode_torch(self, rows):
        scales = torch.linalg.vector_norm(rows, ord=1, dim=1).div_(rows.shape[1])
        bits = (rows >= 0).view(-1, 8).to(torch.uint8).view(torch.int64)
        return scales, (bits * self._PACK).bitwise_right_shift_(56).to(torch.uint8).view(-1)

    def encode(self, rows, residual=False):
        module = self.fused(rows.device)
        if module is None:
            return super().encode(rows, residual)
        scales = torch.empty(rows.shape[0], device=rows.device)
        codes = torch.empty(rows.numel() // 8, dtype=torch.uint8, device=rows.device)
        module.encode(rows.view(-1), scales, codes, rows.shape[1], residual)
        return scales, codes

    def encode_momentum(self, rows, g, m, w, *, local, beta1, residual=False):
        module = self.fused(rows.device)
        if module is None:
            return super().encode_momentum(rows, g, m, w, local=local, beta1=beta1, residual=residual)
        scales = torch.empty(rows.shape[0], device=rows.device)
        codes = torch.empty(rows.numel() // 8, dtype=torch.uint8, device=rows.device)
        w = torch.empty(0, device=rows.device) if w is None else w
        if isinstance(m, tuple):        # M as sign's own scales and codes: read at a bit an entry
            module.encode_momentum_packed(g, m[0], m[1], w, rows.view(-1), scales, codes, rows.shape[1], local,
                                          beta1, residual)
        else:
            module.encode_momentum(g, m, w, rows.view(-1), scales, codes, rows.shape[1], local, beta1, residual)
        return scales, codes

    def decode_into(self, scales, codes, out, accumulate=False, factor=1.0):
        module = self.fused(out.device)
        if module is None:
            return super().decode_into(scales, codes, out, accumulate, factor)
        module.decode(scales.contiguous(), codes.contiguous(), out.view(-1), out.shape[-1], accumulate, factor)
        return out


class _Int4Codec(_BlockCodec):
    """Symmetric 4-bit codes in [-7, 7] (two per byte, the first in the high nibble),
    one scale per block: max |x| / 7."""
    per_byte = 2

    @staticmethod
    def values(byte):
        return torch.stack([byte >> 4, byte & 15], dim=1) - 8

    def encode_torch(self, rows):
        scales = torch.linalg.vector_norm(rows, ord=float("inf"), dim=1).div_(7.0)
        inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
        q = torch.mul(rows, inverse[:, None]).round_().clamp_(-7, 7).add_(8).to(torch.uint8).view(-1, 2)
        return scales, q[:, 0].bitwise_left_shift(4).bitwise_or_(q[:, 1])


class TwoPhase:
    """A compressed all-reduce in two phases, with error feedback on both sides (1-bit
    Adam's, Tang et al. 2021, arXiv 2102.02888): the chunk (plus this rank's worker
    residual) is cut into one segment per rank and each segment encoded; an all-to-all
    gives rank j every rank's segment j; rank j decodes and sums them, adds its server
    residual, encodes the sum again; an all-gather gives every rank every segment. Each
    rank sends about 2 (W-1)/W of the encoded chunk, as a ring all-reduce of it would:
    the bytes do not grow with the ranks as an all-gather of every rank's payload does.
    What each encoding held back is kept and added next step (worker: of its input;
    server: of its segment's sum)."""
    phases = 2
    splittable = True
    # with target momentum the reducer hands over the gradient, M and the factors, and the
    # codec forms the momentum in its encoding pass (``exchange(momentum=...)``); the mean
    # momentum it returns is this codec's scales and codes as the all-gather delivered them
    # (``gathered``), which the reducer keeps as M instead of its fp32 decoding
    fuses_momentum = True

    def __init__(self, codec, *, block_size=256, error_feedback=True, residual_dtype=torch.float32):
        self.codec, self.block_size, self.error_feedback = codec, block_size, error_feedback
        # the dtype the worker and server residuals are kept in between steps; the step itself
        # works in fp32. bf16 keeps each residual rounded (relative error <= 2^-8 an entry):
        # that rounding is what error feedback does not carry forward (docs/compression.md)
        self.residual_dtype = residual_dtype
        self.state = {}
        # this step's residuals and scratch, from buffers the chunks before gave back (a
        # fresh gradient-sized allocation costs its page faults; one set per chunk in flight)
        self.pool = ScratchPool(**ScratchPool.COMPRESSOR_BOUNDS)
        self.finite = {}        # key: whether its last exchange was finite (a non-finite one poisons the region)
        self.gathered = {}      # key: with momentum, the mean momentum as (scales, codes) on the chunk's block grid

    def decode_gathered(self, packed, out):
        """``out`` (a chunk's entries, fp32) := the decoding of ``packed`` ((scales, codes)
        from ``gathered``), whose last segment runs on past the chunk's end."""
        scales, codes = packed
        b = self.block_size
        full = out.numel() // b * b
        if full:
            self.codec.decode_into(scales[:full // b], codes[:full // b * (b // self.codec.per_byte)],
                                   out[:full].view(-1, b))
        if full < out.numel():
            tail = self.pool.take(b, out.device)
            self.codec.decode_into(scales[full // b:full // b + 1],
                                   codes[full // b * (b // self.codec.per_byte):(full // b + 1) * (b // self.codec.per_byte)],
                                   tail.view(1, b))
            out[full:].copy_(tail[:out.numel() - full])
            self.pool.give(tail)
        return out

    def wants(self, shape):
        return True

    def _segment(self, n, world):
        """Entries per segment: n / world rounded up to whole blocks."""
        per_rank = -(-n // world)
        return -(-per_rank // self.block_size) * self.block_size

    def _decode_payload(self, payload, blocks, out, **kw):
        """Decode one segment's payload into ``out`` ([blocks, block_size]); returns
        whether its scales are finite."""
        scales = payload[:blocks * 4].view(torch.float32)
        self.codec.decode_into(scales, payload[blocks * 4:], out, **kw)
        return bool(torch.isfinite(scales).all())

    def exchange(self, key, region, views, group, scale=1.0, momentum=None):
        """``momentum`` (m, local, beta1): ``region`` holds this rank's gradient, and what
        is averaged is its momentum local x region + beta1 x m (m: fp32 entries, or the
        (scales, codes) ``gathered`` left for this key on the step before); the mean is
        left in ``gathered[key]`` as well (when finite)."""
        world = torch.distributed.get_world_size(group)
        n, b = region.numel(), self.block_size
        seg = self._segment(n, world)
        blocks = seg // b
        ef = self.error_feedback
        st = self.state.get(key, {})
        dev = region.device
        # this step's residuals go into pooled buffers, committed when the step is finite
        x = self.pool.take(world * seg, dev)
        worker = st["worker"] if ef and "worker" in st else None
        wide = None
        if momentum is not None:
            m, local, beta1 = momentum
            if worker is not None and worker.dtype != torch.float32:     # the fused pass reads an fp32 residual
                wide = self.pool.take(world * seg, dev)
                worker = wide.copy_(worker)
            scales, codes = self.codec.encode_momentum(x.view(world * blocks, b), region, m, worker, local=local,
                                                       beta1=beta1, residual=ef)
            if wide is not None:
                self.pool.give(wide)
        else:
            x[n:].zero_()
            if worker is not None:
                torch.add(region, worker[:n], out=x[:n])
            else:
                x[:n].copy_(region)
            scales, codes = self.codec.encode(x.view(world * blocks, b), residual=ef)   # x: the worker residual now
        send = torch.cat([scales.view(world, blocks).view(torch.uint8), codes.view(world, -1)], dim=1)
        recv = torch.empty_like(send)
        yield Collective("all_to_all", send.view(-1), group, out=[recv.view(-1)])
        summed = self.pool.take(seg, dev).view(blocks, b)
        finite = True
        for r in range(world):
            finite &= self._decode_payload(recv[r], blocks, summed, accumulate=r > 0, factor=scale)
        if not finite:
            summed.fill_(float("nan"))
        if ef and "server" in st:
            summed += st["server"].view(blocks, b)
        server_scales, server_codes = self.codec.encode(summed, residual=ef)     # summed: the server residual now
        mine = torch.cat([server_scales.view(torch.uint8), server_codes.view(-1)])
        out = [torch.empty_like(mine) for _ in range(world)]
        yield Collective("all_gather", mine, group, out=out)
        # every rank's segment decoded straight into the region; the one the region ends in
        # (padded to whole blocks) through a scratch segment
        tail = self.pool.take(seg, dev)
        for r, payload in enumerate(out):
            whole = (r + 1) * seg <= n
            target = region[r * seg:(r + 1) * seg] if whole else tail
            finite &= self._decode_payload(payload, blocks, target.view(blocks, b))
            if not whole and r * seg < n:
                region[r * seg:].copy_(tail[:n - r * seg])
        self.state[key] = st
        self.pool.give(tail)
        self.finite[key] = finite
        self.gathered.pop(key, None)
        if momentum is not None and finite:
            self.gathered[key] = (torch.cat([p[:blocks * 4] for p in out]).view(torch.float32),
                                  torch.cat([p[blocks * 4:] for p in out]))
        if not finite or not ef:
            self.pool.give(x)
            self.pool.give(summed.view(-1))
            if not finite:
                _poison(region)
            return              # a non-finite step is skipped: the residuals stay as they were
        if self.residual_dtype == torch.float32:
            for old in (st.get("worker"), st.get("server")):
                if old is not None:
                    self.pool.give(old)
            st.update(worker=x, server=summed.view(-1))
            return
        for name, fresh in (("worker", x), ("server", summed.view(-1))):
            kept = st.get(name)
            if kept is None:
                kept = st[name] = torch.empty(fresh.numel(), dtype=self.residual_dtype, device=dev)
            kept.copy_(fresh)          # rounded to the kept dtype; last step's value was read above
            self.pool.give(fresh)


def _orthonormalise(p):
    """Columns of p made orthonormal (reduced QR)."""
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


class PowerSGD:
    """Rank-``rank`` approximation M ~ P Q^T of each gradient matrix, one power
    iteration per step with Q warm-started from the last step (Vogels et al. 2019):
    P = M Q, all-reduce P, orthonormalise, Q = M^T P, all-reduce Q. Matrices where
    (rows + cols) x rank is not well below rows x cols go dense (``wants``)."""
    phases = 2
    splittable = False
    # the token embedding's gradient has a row per token seen and the output head's a
    # column of softmax errors per token: sums of many unrelated rank-1 terms, which a
    # rank-r approximation loses (measured in docs/compression.md); a small share of a large model
    default_dense_params = ("*embed_tokens.weight", "*lm_head.weight")

    def __init__(self, *, rank=4, error_feedback=True, seed=0):
        self.rank, self.error_feedback, self.seed = rank, error_feedback, seed
        self.state = {}

    def wants(self, shape):
        if len(shape) < 2:
            return False
        rows, cols = shape[0], math.prod(shape[1:])
        return (rows + cols) * self.rank * 2 < rows * cols       # torch's hook: compression rate above 2

    def _q(self, key, cols, device):
        st = self.state.get(key)
        if st is not None and "q" in st:
            q = st["q"]
        else:
            g = torch.Generator().manual_seed(self.seed + zlib.crc32(repr(key).encode()))
            q = torch.randn(cols, self.rank, generator=g).to(device)
        # orthonormal, as torch's hook keeps it: the summed Q of the last step has columns
        # of very different lengths (M's singular values); the same span, better conditioned
        return _orthonormalise(q)

    def exchange(self, key, region, views, group, scale=1.0):
        # M = gradient + last step's error, formed in the gradient's own buffer (the
        # driver owns it and the result overwrites it); products arranged so that the
        # big matrix is read row by row (M^T P as (P^T M)^T)
        qs, ms, states = [], [], []
        for i, v in enumerate(views):
            m = v.view(v.shape[0], -1)
            st = self.state.get((key, i))
            if st is not None and self.error_feedback and "e" in st:
                m.add_(st["e"])
            ms.append(m)
            states.append(st)
            qs.append(self._q((key, i), m.shape[1], m.device))
        ps = torch.cat([(m @ q).view(-1) for m, q in zip(ms, qs)])
        yield Collective("all_reduce", ps, group)
        if not bool(torch.isfinite(ps).all()):
            yield Collective("noop")       # every rank sees the same reduced P, so every rank skips alike
            _poison(region)
            return
        offs, p_hats = 0, []
        for m in ms:
            size = m.shape[0] * self.rank
            p_hats.append(_orthonormalise(ps[offs:offs + size].view(m.shape[0], self.rank)))
            offs += size
        local_q = [(p.t() @ m).t() for m, p in zip(ms, p_hats)]
        errors = None
        if self.error_feedback:          # e = M - P Q_local^T, into last step's buffer when there is one
            errors = []
            for m, p, q, st in zip(ms, p_hats, local_q, states):
                out = st["e"] if st is not None and "e" in st else torch.empty_like(m)
                errors.append(torch.addmm(m, p, q.t(), alpha=-1, out=out))
        qsum = torch.cat([q.reshape(-1) for q in local_q])
        yield Collective("all_reduce", qsum, group)
        if not bool(torch.isfinite(qsum).all()):
            _poison(region)
            return
        offs = 0
        for i, (m, p) in enumerate(zip(ms, p_hats)):
            size = m.shape[1] * self.rank
            q = qsum[offs:offs + size].view(m.shape[1], self.rank)
            offs += size
            torch.mm(p, (q * scale).t(), out=m)
            st = {"q": q.clone()}
            if errors is not None:
                st["e"] = errors[i]
            self.state[(key, i)] = st


COMPRESSORS = ("none", "fp32", "bf16", "fp16", "int8", "int4", "sign", "topk", "powersgd")


def make_compressor(section, *, seed=0):
    """The compressor a ``seekspeed.comm`` section names (``none`` has none)."""
    name = section.compressor
    if name == "fp32":
        return Dense(torch.float32)
    if name == "bf16":
        return Dense(torch.bfloat16)
    if name == "fp16":
        return Dense(torch.float16)
    if name == "int8":
        return Int8(block_size=section.resolved_block_size, error_feedback=section.error_feedback)
    residual_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[section.residual_dtype]
    if name == "int4":
        return TwoPhase(_Int4Codec(), block_size=section.resolved_block_size, error_feedback=section.error_feedback,
                        residual_dtype=residual_dtype)
    if name == "sign":
        return TwoPhase(_SignCodec(kernel=section.kernel), block_size=section.resolved_block_size,
                        error_feedback=section.error_feedback, residual_dtype=residual_dtype)
    if name == "topk":
        return TopK(ratio=section.ratio, selection=section.selection, sample_ratio=section.sample_ratio,
                    kernel=section.kernel,
                    error_feedback=section.error_feedback, momentum=section.momentum, seed=seed)
    if name == "powersgd":
        return PowerSGD(rank=section.rank, error_feedback=section.error_feedback, seed=seed)
    raise ValueError(f"no compressor for {name!r}")
