"""DeepSpeed's CPU FusedAdam made to compute its beta powers from the step, as the CUDA
kernel does, so that an optimizer step depends on the state dict alone and a resumed
process updates every weight bitwise as the uninterrupted one.

The CPU kernel (ops/csrc/cpu/adam/fused_adam.cpp, ops/csrc/includes/cpu_adam.h) keeps
one C++ optimizer per process and mode, shared by every FusedAdam and every parameter
group in it, holding beta1^t and beta2^t between calls: a call with the same betas and
``step`` one more than the last multiplies them by beta in float; any other step, or
other betas, sets them to ``pow(beta, step)``. A process that has trained N steps holds
the running product; a resumed one starts with ``pow(beta, N + 1)``, which differs in
the last bit from a few steps on (beta2 = 0.95: step 6), so every update after a resume
would round otherwise. Which ``step`` the kernel is called with also depends on the
layout: FusedAdam.step increments ``state["step"]`` once per dtype list after its loop
over the group's parameters, so only the group's last parameter with a gradient counts
(ZeRO stage 0 in fp32: 51 parameters in one group, 50 of them at step 0 in a
checkpoint); under ZeRO and the BF16 optimizer each group is one flat tensor.

``install(optimizer)`` wraps the kernel of every FusedAdam under ``optimizer`` (ZeRO's
and the BF16 optimizer's inner one, Muon's auxiliary Adam) so that each call is preceded
by one on empty tensors with betas no call uses (NaN): the real call then always takes
the ``pow(beta, step)`` branch, whatever ran before in the process, and touches no
element more. Nothing is replayed on resume and no step has to be read back. The CUDA
kernel computes the powers from the step at every call and is left as it is.
"""

import math

import torch

# the kernel's "no history" betas: NaN differs from every beta, itself included
_RESET_BETA = math.nan


def fused_adams(optimizer):
    """DeepSpeed's FusedAdam instances reachable from ``optimizer``: itself, the one
    under its ZeRO / BF16 wrappers (``.optimizer``), Muon's auxiliary Adam
    (``.aux_optimizer``)."""
    from deepspeed.ops.adam import FusedAdam
    found, seen, todo = [], set(), [optimizer]
    while todo:
        opt = todo.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        if isinstance(opt, FusedAdam):
            found.append(opt)
        todo += [getattr(opt, name, None) for name in ("optimizer", "aux_optimizer")]
    return found


def history_free(kernel):
    """``kernel`` (FusedAdam's ``multi_tensor_adam``) preceded at every call by a call on
    empty tensors with NaN betas, so that the real call computes ``pow(beta, step)``."""
    if getattr(kernel, "seekspeed_history_free", False):
        return kernel
    empty = [[torch.empty(0, dtype=torch.float32)] for _ in range(4)]

    def call(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode, bias_correction,
             weight_decay):
        kernel(chunk_size, noop_flag, empty, lr, _RESET_BETA, _RESET_BETA, eps, step, mode, bias_correction,
               weight_decay)
        return kernel(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode, bias_correction,
                      weight_decay)

    call.seekspeed_history_free = True
    return call


def install(optimizer):
    """Make every CPU FusedAdam under ``optimizer`` history-free (see the module
    docstring). Returns how many were changed (0 on accelerators other than the CPU)."""
    from deepspeed.accelerator import get_accelerator
    if optimizer is None or get_accelerator().device_name() != "cpu":
        return 0
    adams = fused_adams(optimizer)
    for opt in adams:
        opt.multi_tensor_adam = history_free(opt.multi_tensor_adam)
    return len(adams)
