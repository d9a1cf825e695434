import torch.nn.functional as F
from torch import nn

from ds_ext.pipe.zero_bubble import Linear

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def clamped_swiglu(act_fn, gate, up, limit):
    """act(gate) * up with DeepSeek-V4's clamp: gate at most ``limit``, up in [-limit,
    limit] (no clamp with ``limit`` None)."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return act_fn(gate) * up


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)); names as transformers' DeepseekV3MLP. With ``limit``
    (DeepSeek-V4's swiglu_limit) gate is clamped to at most limit and up to [-limit, limit]."""

    def __init__(self, hidden_size, intermediate_size, hidden_act="silu", limit=None):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACTIVATIONS[hidden_act]
        self.limit = limit

    def forward(self, x):
        return self.down_proj(clamped_swiglu(self.act_fn, self.gate_proj(x), self.up_proj(x), self.limit))
