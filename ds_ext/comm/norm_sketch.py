"""The squared norm of a group's averaged gradient, estimated before the average exists.

Target momentum clips each rank's gradient before it enters the momentum, and the clip
coefficient needs the norm of the group's mean gradient, which only the exchange
produces (and, compressed, only approximately). ``seekspeed.comm.clip_norm: "sketch"``
estimates it first with a count sketch (Charikar, Chen and Farach-Colton 2002): a
linear map S of every gradient onto ``buckets`` numbers, the same map on every rank, so
that the group's all-reduce of the ranks' sketches is the sketch of their sum, and
|S x|^2 is an unbiased estimate of |x|^2.

The map: the call's tensors laid end to end, element p lands in bucket p mod k with a
random sign. Elements that share a bucket come from different rows of k consecutive
elements, or from different tensors, so one sign per (tensor, row) makes every pair in
a bucket independent: E[s_p s_q] = 0, hence E|S x|^2 = |x|^2, and the variance is
4 sum_b sum_{p<q in b} x_p^2 x_q^2 = 2 sum_b (m_b^2 - sum_{p in b} x_p^4), m_b the
bucket's share of |x|^2: about 2 |x|^4 / k when the mass spreads over the buckets
(relative standard deviation sqrt(2 / k) of the squared norm, half that of the norm:
2.2 % at k = 1024). A row's sign times the row is one matrix-vector product
per tensor, one pass over the gradient as the root-mean-square norm's is. The signs
come from a CPU generator seeded by the step and the call's key, so every member of
the group draws the same ones and a resumed run the same as the uninterrupted one.
"""

import zlib

import torch

# rows per matrix-vector product when the gradient is not fp32 (converted a block at a time)
_BLOCK_ELEMENTS = 1 << 22


def sketch_seed(step, key):
    """The generator seed of ``step``'s sketch of the reduce call ``key``: the same on
    every rank that reduces it, another at every step."""
    return (zlib.crc32(repr(key).encode()) * 1_000_003 + step * 0x9E3779B1) % (1 << 62)


def count_sketch(tensors, buckets, seed, scale=1.0):
    """``scale`` x the count sketch of ``tensors`` laid end to end: a vector of
    ``buckets`` entries whose squared norm estimates ``scale``^2 x their squared norm;
    fp32, or float64 when a tensor is (the tests' exact evaluation of the same map)."""
    device = tensors[0].device if tensors else torch.device("cpu")
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    out = torch.zeros(buckets, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    offset = 0
    for t in tensors:
        flat = t.reshape(-1)
        n = flat.numel()
        full, tail = divmod(n, buckets)
        signs = torch.randint(0, 2, (full + (tail > 0),), generator=gen).to(dtype).mul_(2).sub_(1)
        signs = signs.to(device)
        local = torch.zeros(buckets, dtype=dtype, device=device)
        if full:
            rows = flat[:full * buckets].view(full, buckets)
            if rows.dtype == dtype:
                local += torch.mv(rows.t(), signs[:full])
            else:
                step = max(1, _BLOCK_ELEMENTS // buckets)
                for lo in range(0, full, step):
                    hi = min(full, lo + step)
                    local += torch.mv(rows[lo:hi].to(dtype).t(), signs[lo:hi])
        if tail:
            local[:tail] += flat[full * buckets:].to(dtype) * signs[full]
        out += torch.roll(local, offset % buckets)
        offset += n
    return out.mul_(scale) if scale != 1.0 else out


def tensor_sketches(tensors, buckets, seed, scale=1.0):
    """One count sketch per tensor, laid end to end: ``scale`` x tensor i's sketch of
    min(numel, ``buckets``) entries (a tensor of at most ``buckets`` elements is itself up
    to a sign per element, so its squared norm is exact), each with its own seed drawn
    from ``seed``. Linear like ``count_sketch``: the all-reduce of the ranks' vectors is
    the vector of their sum. Returns the vector and the entries per tensor, for
    ``segment_norms``."""
    sizes = [min(t.numel(), buckets) for t in tensors]
    parts = [count_sketch([t], k, (seed + 0x632BE5AB * (i + 1)) % (1 << 62), scale=scale)
             for i, (t, k) in enumerate(zip(tensors, sizes))]
    if not parts:
        return torch.zeros(0), sizes
    return torch.cat(parts), sizes


def segment_norms(vector, sizes):
    """The squared norm of each consecutive segment of ``vector`` (``sizes`` entries
    each): float64, one value per tensor that ``tensor_sketches`` sketched."""
    if not sizes:
        return torch.zeros(0, dtype=torch.float64)
    index = torch.repeat_interleave(torch.arange(len(sizes), device=vector.device),
                                    torch.tensor(sizes, device=vector.device))
    out = torch.zeros(len(sizes), dtype=torch.float64, device=vector.device)
    return out.index_add_(0, index, vector.to(torch.float64).square())
