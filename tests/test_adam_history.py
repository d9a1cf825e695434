"""DeepSpeed's CPU FusedAdam keeps beta^t in its C++ object between calls (a running
float product, reset by a call with other betas or a step that does not follow on);
a resumed process starts it with pow(beta, step), which rounds otherwise from a few
steps on (beta2 0.95: step 6). ds_ext.checkpoint.adam_history makes every call compute
pow(beta, step), so a resumed optimizer steps bitwise as the uninterrupted one, for
every layout: one tensor per group (ZeRO, the BF16 optimizer), a group of many tensors
of which only the last one's state counts the steps (ZeRO stage 0: DeepSpeed's
FusedAdam increments the state of the last parameter it looped over), several groups
with other betas, and Muon's auxiliary Adam. Each resumed half runs in a fresh process
(the kernel's state is per process), forked from the test ranks' forkserver, which has
loaded the op but never stepped an optimizer (tests/rank_preload.py). Through the
trainer, for every config: tests/test_kill_resume.py. About 10 s."""

import copy

import pytest
import torch

from tests.distributed import rank_context

STEPS, STOP = 9, 6          # resume after step 6: steps 7.. need beta2^t


def _grads(step, shapes):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*shape, generator=g) * 1e-2 for shape in shapes]


# name -> (parameter shapes, how the optimizer is built)
LAYOUTS = {
    # ZeRO 1 / the BF16 optimizer: one flat tensor per group
    "one-tensor": ([(4099,)], "groups", [{"betas": (0.9, 0.95)}]),
    # ZeRO 0: many tensors in one group, only the last one's state['step'] counts
    "many-tensors": ([(33, 17), (4099,), (5,)], "groups", [{"betas": (0.9, 0.95)}]),
    # two groups with other betas: each call resets the other's running powers in the kernel
    "two-groups": ([(257,), (1031,)], "groups", [{"betas": (0.9, 0.95)}, {"betas": (0.8, 0.99)}]),
    # Muon's auxiliary Adam (DeepSpeed's MuonWithAuxAdam with FusedAdam for the non-Muon group;
    # the Muon group's tensor is flat, as a ZeRO partition is, so Muon applies its update as
    # given instead of compiling its Newton-Schulz iteration here)
    "muon-aux-adam": ([(2048,), (513,)], "muon", None),
}


def _optimizer(params, layout):
    from deepspeed.ops.adam import FusedAdam
    _, kind, groups = LAYOUTS[layout]
    if kind == "groups":
        if len(groups) == 1:
            return FusedAdam([{"params": params, **groups[0]}], lr=2e-3, weight_decay=0.1, adam_w_mode=True)
        return FusedAdam([{"params": [p], **g} for p, g in zip(params, groups)], lr=2e-3, weight_decay=0.1,
                         adam_w_mode=True)
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    return MuonWithAuxAdam([{"params": [params[0]], "use_muon": True, "lr": 2e-2, "momentum": 0.95,
                             "weight_decay": 0.1},
                            {"params": [params[1]], "use_muon": False, "lr": 2e-3, "betas": (0.9, 0.95),
                             "eps": 1e-8, "weight_decay": 0.1}],
                           adam_optimizer=FusedAdam, adam_optimizer_kwargs={"adam_w_mode": True})


def _train(params, opt, steps, shapes):
    for step in steps:
        for p, g in zip(params, _grads(step, shapes)):
            p.grad = g
        opt.step()


def _params(values):
    return [torch.nn.Parameter(v.clone()) for v in values]


def _resume_in_fresh_process(layout, state, history_free, out):
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ds_ext.checkpoint.adam_history import install
    shapes = LAYOUTS[layout][0]
    params = _params(state["params"])
    opt = _optimizer(params, layout)
    opt.load_state_dict(state["optimizer"])
    installed = install(opt) if history_free else 0
    _train(params, opt, range(STOP + 1, STEPS + 1), shapes)
    out.put((installed, [p.detach().numpy().tobytes() for p in params]))   # bytes: no shared-memory handle


def _resumed(layout, state, history_free):
    ctx = rank_context()
    out = ctx.Queue()
    p = ctx.Process(target=_resume_in_fresh_process, args=(layout, state, history_free, out))
    p.start()
    installed, raw = out.get(timeout=120)
    p.join(timeout=60)
    assert p.exitcode == 0
    return installed, [torch.frombuffer(bytearray(b), dtype=torch.float32) for b in raw]


def _uninterrupted(layout, *, history_free):
    """(checkpoint after STOP steps, weights after STEPS), in this process."""
    from ds_ext.checkpoint.adam_history import install
    shapes = LAYOUTS[layout][0]
    torch.manual_seed(0)
    params = _params([torch.randn(*s) for s in shapes])
    opt = _optimizer(params, layout)
    if history_free:
        install(opt)
    _train(params, opt, range(1, STOP + 1), shapes)
    state = copy.deepcopy({"params": [p.detach() for p in params], "optimizer": opt.state_dict()})
    _train(params, opt, range(STOP + 1, STEPS + 1), shapes)
    return state, [p.detach().flatten() for p in params]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_resumed_fused_adam_steps_bitwise_as_the_uninterrupted_one(layout):
    state, full = _uninterrupted(layout, history_free=True)
    installed, resumed = _resumed(layout, state, history_free=True)
    assert installed == 1
    assert all(torch.equal(a, b) for a, b in zip(resumed, full))


def test_only_the_last_tensor_of_a_group_counts_the_steps_and_without_the_fix_a_resume_drifts():
    """Why 50 of 51 states of a ZeRO stage 0 checkpoint say step 0, and what the
    history-free kernel repairs: DeepSpeed's kernel as it is, resumed, leaves the
    uninterrupted trajectory in many elements."""
    state, full = _uninterrupted("many-tensors", history_free=False)
    steps = [int(s["step"]) for s in state["optimizer"]["state"].values()]
    assert steps == [0, 0, STOP], steps
    _, without = _resumed("many-tensors", state, history_free=False)
    assert not torch.equal(without[1], full[1])
    assert (without[1] != full[1]).float().mean() > 0.01


def test_the_history_free_kernel_changes_nothing_on_a_fresh_optimizer_at_step_one():
    """pow(beta, 1) is beta: the first step is the same number with and without the fix."""
    from ds_ext.checkpoint.adam_history import install
    shapes = LAYOUTS["one-tensor"][0]
    torch.manual_seed(0)
    start = [torch.randn(*s) for s in shapes]
    plain, fixed = _params(start), _params(start)
    a, b = _optimizer(plain, "one-tensor"), _optimizer(fixed, "one-tensor")
    install(b)
    _train(plain, a, [1], shapes)
    _train(fixed, b, [1], shapes)
    assert torch.equal(plain[0], fixed[0])
