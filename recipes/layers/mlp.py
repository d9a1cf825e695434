import torch.nn.functional as F
from torch import nn

from ds_ext.pipe.zero_bubble import Linear

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)); names as transformers' DeepseekV3MLP."""

    def __init__(self, hidden_size, intermediate_size, hidden_act="silu"):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACTIVATIONS[hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
