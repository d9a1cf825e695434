"""Rotary position embedding with DeepSeek's YaRN extension.

Follows transformers' DeepseekV3 (rope_parameters dict, ``rope_interleave``): the
inverse frequencies and the cos/sin scaling ("attention factor") of YaRN, and the
extra softmax scale (mscale squared) that DeepSeek applies when rope scaling is set.
"""

import math

import torch

from ds_ext.errors import ConfigError

ROPE_TYPES = ("default", "yarn")
ROPE_KEYS = {
    "default": {"rope_type", "rope_theta"},
    "yarn": {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"},
}


def check_rope_parameters(rope_parameters, *, where="rope_parameters"):
    """Raise ConfigError for an unknown rope type or key; returns the dict."""
    if not isinstance(rope_parameters, dict):
        raise ConfigError(f"{where} must be a dict like {{'rope_type': 'default', 'rope_theta': 10000.0}}, "
                          f"got {rope_parameters!r}")
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}.rope_type {rope_type!r} is not supported: use one of {list(ROPE_TYPES)}")
    unknown = sorted(set(rope_parameters) - ROPE_KEYS[rope_type])
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown} for rope_type {rope_type!r}; "
                          f"allowed: {sorted(ROPE_KEYS[rope_type])}")
    if "rope_theta" not in rope_parameters:
        raise ConfigError(f"{where}.rope_theta is missing: set it (DeepSeek-V3 uses 10000.0)")
    if rope_type == "yarn":
        for key, example in (("factor", 40.0), ("original_max_position_embeddings", 4096)):
            if key not in rope_parameters:
                raise ConfigError(f"{where}: yarn needs {key} (DeepSeek-V3: {example})")
    for key, value in rope_parameters.items():
        if key == "rope_type":
            continue
        if key == "truncate":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.truncate must be true or false, got {value!r}")
        elif value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0
                                    or (value == 0 and key in ("rope_theta", "factor",
                                                               "original_max_position_embeddings"))):
            raise ConfigError(f"{where}.{key} must be a positive number, got {value!r}")
    return rope_parameters


def yarn_mscale(scale, mscale=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(rope_parameters, max_position_embeddings):
    factor = rope_parameters.get("factor")
    if factor is None:
        factor = max_position_embeddings / rope_parameters["original_max_position_embeddings"]
    return factor


def inv_freq_and_attention_factor(rope_parameters, *, dim, max_position_embeddings):
    """Inverse frequencies (fp32, ``dim // 2`` entries) and the cos/sin scale."""
    base = rope_parameters["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    if rope_parameters.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0

    factor = _yarn_factor(rope_parameters, max_position_embeddings)
    attention_factor = rope_parameters.get("attention_factor")
    mscale = rope_parameters.get("mscale")
    mscale_all_dim = rope_parameters.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = rope_parameters.get("beta_fast") or 32
    beta_slow = rope_parameters.get("beta_slow") or 1
    original = rope_parameters["original_max_position_embeddings"]

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


def softmax_scale(qk_head_dim, rope_parameters, *, max_position_embeddings):
    """1/sqrt(d), times mscale(factor, mscale_all_dim)**2 when YaRN scaling is on."""
    scale = qk_head_dim ** (-0.5)
    if rope_parameters.get("rope_type", "default") != "default":
        mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_mscale(_yarn_factor(rope_parameters, max_position_embeddings), mscale_all_dim)
            scale = scale * m * m
    return scale


def cos_sin(inv_freq, attention_factor, *, seq_len, dtype, device):
    """cos and sin of shape [1, seq_len, dim] for positions 0..seq_len-1."""
    positions = torch.arange(seq_len, device=device).unsqueeze(0)
    freqs = positions[..., None].float() * inv_freq.to(device=device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q, k, cos, sin, *, interleave):
    """Rotate q [B, H, S, D] and k [B, 1, S, D].

    With ``interleave`` the rotary pairs are (x0, x1), (x2, x3), ... as in DeepSeek's
    released weights; the result is laid out de-interleaved, as transformers does.
    """
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    if not interleave:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_out = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_out = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_out, k_out
