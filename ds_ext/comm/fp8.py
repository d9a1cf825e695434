"""FP8 rows for the MoE dispatch, as DeepSeek-V3 sends them: e4m3 values with one fp32
scale per 128 channels (a 1 x 128 tile), the scale the tile's largest magnitude over
e4m3's largest finite value (448), so no value saturates.

A row of H channels travels as H bytes of codes followed by the H / 128 scales' bytes:
``encode`` [R, H] -> uint8 [R, H + H / 32]; ``decode`` gives the rows back in the
activation dtype.

Error (derived from e4m3's format: 3 mantissa bits, so a unit roundoff of 2^-4 for
normal values, |v| >= 2^-6; subnormals spaced 2^-9 below that): for x in a tile with
scale s = amax / 448, the code of x / s is within 2^-4 |x / s| (normal) or 2^-10
(subnormal, half the spacing) of it, so

    |decode(encode(x)) - x| <= 2^-4 |x| + 2^-10 s

plus the fp32 roundings of the division and the product (under 2^-22 |x| together), and, in bf16,
the final rounding to bf16 (2^-8 of the result). ``error_bound`` gives it elementwise.
"""

import torch

BLOCK = 128
E4M3_MAX = 448.0


def unsupported(device):
    """None when this torch can cast to and from float8_e4m3fn on ``device``, else why not."""
    if not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no float8_e4m3fn"
    try:
        torch.ones(2, device=device).to(torch.float8_e4m3fn).view(torch.uint8).view(torch.float8_e4m3fn).float()
    except (RuntimeError, TypeError) as exc:
        return f"float8_e4m3fn casts fail on {torch.device(device).type}: {str(exc).splitlines()[0]}"
    return None


def _tiles(x):
    rows, hidden = x.shape
    return x.float().view(rows, hidden // BLOCK, BLOCK)


def _scales(tiles):
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def encode(x):
    """[R, H] rows (H a multiple of 128) -> uint8 [R, H + H / 32]: the e4m3 codes, then
    the fp32 scales' bytes."""
    rows, hidden = x.shape
    tiles = _tiles(x)
    scale = _scales(tiles)
    codes = (tiles / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.cat([codes.view(torch.uint8).view(rows, hidden),
                      scale.view(rows, hidden // BLOCK).view(torch.uint8)], dim=1)


def decode(raw, *, dtype):
    """uint8 [R, H + H / 32] from ``encode`` -> [R, H] in ``dtype``."""
    rows, width = raw.shape
    hidden = width * 32 // 33
    codes = raw[:, :hidden].contiguous().view(torch.float8_e4m3fn).float().view(rows, hidden // BLOCK, BLOCK)
    scale = raw[:, hidden:].contiguous().view(torch.float32).view(rows, hidden // BLOCK, 1)
    return (codes * scale).view(rows, hidden).to(dtype)


def row_bytes(hidden):
    """Bytes one row of ``hidden`` channels takes on the wire."""
    return hidden + 4 * (hidden // BLOCK)


def error_bound(x, *, dtype=torch.float32):
    """Elementwise bound on |decode(encode(x)) - x| (module docstring), as fp64."""
    tiles = _tiles(x).double()
    scale = _scales(tiles.float()).double()
    bound = 2.0**-4 * tiles.abs() + 2.0**-10 * scale + 2.0**-22 * tiles.abs()
    if dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * (tiles.abs() + bound)
    return bound.view(x.shape)


class Fp8Rows:
    """The codec ds_ext.comm.alltoall takes: rows sent as ``encode``, received as
    ``decode`` in the rows' own dtype. ``keep`` (a forwarder's first hop): the received
    bytes are kept as they came (``kept``) instead of decoded, to be sent on as they are;
    ``raw``: the bytes to send (a forwarder's second hop: rows encoded at their source),
    whatever the rows handed to ``encode`` hold."""

    def __init__(self, dtype, *, keep=False, raw=None):
        self.dtype, self.keep, self.raw, self.kept = dtype, keep, raw, None

    def encode(self, x):
        return encode(x) if self.raw is None else self.raw

    def unpack(self, raw, out):
        """The received bytes ``raw`` into ``out`` (decoded), or kept."""
        if self.keep:
            self.kept = raw
        else:
            out.copy_(decode(raw, dtype=self.dtype))
