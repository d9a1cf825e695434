"""DeepSpeed's CPU FusedAdam keeps beta^t in its C++ object, as a running float product
from the process's first step; a resumed process starts it with pow(beta, step), which
rounds otherwise from a few steps on (beta2 0.95: step 6). ds_ext.checkpoint.adam_history
replays the steps taken on empty tensors after a load, so a resume updates every weight
bitwise as the uninterrupted run does. Each resumed half runs in a fresh process (the
kernel's state is per process), forked from the test ranks' forkserver, which has loaded
the op but never stepped an optimizer (tests/rank_preload.py); about 15 s, most of it the
forkserver's own start when this test is the first to use it."""

import copy

import torch

from tests.distributed import rank_context

STEPS, STOP = 9, 6          # resume after step 6: steps 7.. need beta2^t from the product


def _grads(step, n=4099):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, generator=g) * 1e-2


def _optimizer(param):
    from deepspeed.ops.adam import FusedAdam
    return FusedAdam([param], lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1, adam_w_mode=True)


def _train(param, opt, steps):
    for step in steps:
        param.grad = _grads(step)
        opt.step()


def _resume_in_fresh_process(state, replay, out):
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from ds_ext.checkpoint.adam_history import replay as replay_history
    param = torch.nn.Parameter(state["param"].clone())
    opt = _optimizer(param)
    opt.load_state_dict(state["optimizer"])
    replayed = replay_history(opt) if replay else 0
    _train(param, opt, range(STOP + 1, STEPS + 1))
    out.put((replayed, param.detach().numpy().tobytes()))     # bytes: no shared-memory handle to outlive us


def _resumed(state, replay):
    ctx = rank_context()
    out = ctx.Queue()
    p = ctx.Process(target=_resume_in_fresh_process, args=(state, replay, out))
    p.start()
    replayed, raw = out.get(timeout=120)
    p.join(timeout=60)
    assert p.exitcode == 0
    return replayed, torch.frombuffer(bytearray(raw), dtype=torch.float32)


def test_a_resumed_fused_adam_updates_bitwise_as_the_uninterrupted_one():
    torch.manual_seed(0)
    start = torch.randn(4099)
    param = torch.nn.Parameter(start.clone())
    opt = _optimizer(param)
    _train(param, opt, range(1, STOP + 1))
    state = copy.deepcopy({"param": param.detach(), "optimizer": opt.state_dict()})   # a checkpoint
    _train(param, opt, range(STOP + 1, STEPS + 1))
    full = param.detach()

    replayed, with_replay = _resumed(state, replay=True)
    assert replayed == STOP
    assert torch.equal(with_replay, full)
    # what the replay repairs: without it the same resume leaves the trajectory
    _, without = _resumed(state, replay=False)
    assert not torch.equal(without, full)
    assert (without != full).float().mean() > 0.01
