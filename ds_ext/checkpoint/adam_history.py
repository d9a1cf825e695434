"""The step history DeepSpeed's CPU FusedAdam keeps outside its state dict.

DeepSpeed's fused Adam on the CPU accelerator (ops/csrc/adam/cpu_adam_impl.cpp) keeps
beta1^t and beta2^t in the C++ optimizer object, per process: the first step computes
them with ``pow(beta, step)``, each later step multiplies the previous value by beta in
float. A resumed process starts with ``pow`` at the checkpoint's step, which differs from
the uninterrupted run's running product in the last bit from a few steps on (beta2 = 0.95:
from step 6), so every parameter update after a resume rounds differently and the run
leaves the uninterrupted trajectory. The CUDA kernel computes the powers from the step at
every call and has no such history.

``replay(engine.optimizer)`` brings a freshly loaded process to the uninterrupted run's state by calling the
same kernel, for every step already taken, on empty tensors: the kernel advances its beta
powers exactly as training did and touches no element.
"""

import torch


def _fused_adam(optimizer):
    """DeepSpeed's FusedAdam: ``optimizer`` itself or the one under its ZeRO / BF16
    wrappers; None when there is none."""
    from deepspeed.ops.adam import FusedAdam
    opt = optimizer
    for _ in range(4):
        if isinstance(opt, FusedAdam):
            return opt
        opt = getattr(opt, "optimizer", None)
    return None


def needs_replay(optimizer):
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name() == "cpu" and _fused_adam(optimizer) is not None


def _group_step(opt, group):
    steps = {int(opt.state[p]["step"]) for p in group["params"] if "step" in opt.state.get(p, {})}
    if len(steps) > 1:
        raise RuntimeError(f"FusedAdam parameter group holds parameters at steps {sorted(steps)}")
    return steps.pop() if steps else 0


def replay(optimizer):
    """Advance the CPU kernel's beta powers through every step the loaded optimizer has
    taken, in the order training called it (each step, each parameter group). Returns
    the number of steps replayed (0 where nothing needed it)."""
    if not needs_replay(optimizer):
        return 0
    opt = _fused_adam(optimizer)
    groups = [(g, _group_step(opt, g)) for g in opt.param_groups if g["params"]]
    last = max((s for _, s in groups), default=0)
    empty = [[torch.empty(0, dtype=torch.float32)] for _ in range(4)]
    for step in range(1, last + 1):
        for group, taken in groups:
            if step <= taken:
                beta1, beta2 = group["betas"]
                opt.multi_tensor_adam(2048 * 32, opt._dummy_overflow_buf, empty, group["lr"], beta1, beta2,
                                      group["eps"], step, opt.adam_w_mode, 1 if group["bias_correction"] else 0,
                                      group["weight_decay"])
    return last
