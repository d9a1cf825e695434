"""A layer whose forward, input-gradient backward and weight-gradient backward take
fixed times (sleeps), for measuring pipeline schedules without the CPU's noise.

The activation path sleeps F in forward and B - W in backward; a separate weight
path, which only the layer's parameter feeds, sleeps W in backward. A zero-bubble
schedule can therefore defer exactly W: seekspeed's engines through WeightGradStore,
torch.distributed.pipelining by its input/weight backward split.

The model's first layer gets an input that needs no gradient, so autograd never runs
its activation path: its backward costs W alone (the benchmark simulates it so).
"""

import time

import torch
from torch import nn

from ds_ext.pipe.zero_bubble import WeightGradStore


class _ActivationPath(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _WeightPath(torch.autograd.Function):

    @staticmethod
    def forward(ctx, weight, weight_s):
        ctx.weight_s = weight_s
        ctx.save_for_backward(weight)
        return weight.sum() * 0.0

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        seconds = ctx.weight_s

        def weight_grad():
            time.sleep(seconds)
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)

        if WeightGradStore.enabled:
            WeightGradStore.put(weight_grad)
            return None, None
        time.sleep(seconds)
        return torch.zeros_like(weight), None


class CostedLayer(nn.Module):
    """y = x, costing F ms forward and B ms backward, of which W ms weight gradient."""

    def __init__(self, F, B, W):
        super().__init__()
        self.F, self.B, self.W = F / 1e3, B / 1e3, W / 1e3
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return _ActivationPath.apply(x, self.F, self.B - self.W) + _WeightPath.apply(self.weight, self.W)


def mean_loss(outputs, labels=None):
    return outputs.float().mean()
