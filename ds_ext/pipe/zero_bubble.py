"""Zero-bubble weight-gradient deferral (the DualPipe reference's WeightGradStore).

During a backward chunk run with deferral on, every projection of the recipe (the
``linear`` below: MLA, MLP and routed/shared expert projections) returns its input
gradient at once and queues the computation of its weight gradient. The schedule's
W slots then run one queued chunk's weight gradients each, filling what would be
pipeline bubbles. With deferral off (the default, and outside pipelines), ``linear``
computes both gradients in its backward, as F.linear does.
"""

import collections

import torch
import torch.nn.functional as F


class WeightGradStore:
    """Weight-gradient work of the current backward chunk (``cache``) and of earlier
    chunks waiting for a W slot (``queue``, first in first out)."""

    enabled = False
    cache = []
    queue = collections.deque()

    @classmethod
    def put(cls, fn):
        cls.cache.append(fn)

    @classmethod
    def flush(cls):
        """Close the current backward chunk: its weight-gradient work becomes one queue entry."""
        cls.queue.append(cls.cache)
        cls.cache = []

    @classmethod
    def pop(cls):
        """Run the oldest queued chunk's weight gradients."""
        if not cls.queue:
            raise RuntimeError("W slot with no deferred weight gradients: the schedule's W slots and its "
                               "deferred backward chunks do not pair up")
        for fn in cls.queue.popleft():
            fn()

    @classmethod
    def pending(cls):
        return len(cls.queue) + (1 if cls.cache else 0)

    @classmethod
    def clear(cls):
        cls.enabled, cls.cache, cls.queue = False, [], collections.deque()


def _accumulate(param, grad):
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad += grad.to(param.dtype)


class _Linear(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if not ctx.needs_input_grad[1]:
            return grad_x, None, grad_bias

        def weight_grad():
            _accumulate(weight, grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))

        if WeightGradStore.enabled:
            WeightGradStore.put(weight_grad)
            return grad_x, None, grad_bias
        return grad_x, grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1]), grad_bias


def linear(x, weight, bias=None):
    """F.linear whose weight gradient can be deferred to a W slot."""
    return _Linear.apply(x, weight, bias)


class Linear(torch.nn.Linear):
    """nn.Linear with a deferrable weight gradient (same parameters and names)."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)
