"""DeepSeek-V3 load balancing: the auxiliary-loss-free bias update (direction, size,
loads summed over data-parallel ranks, counting each micro-batch once even under
activation checkpointing) and the sequence-wise balance loss (value against the
report's formula, gradient delivered through the routing weights at the engine's
loss scale); dualpipe's two copies of each stage update their biases alike. Single
process plus two 2-rank cases; about 25 s."""

import pytest
import torch

from recipes import deepseek_v3
from recipes.layers import moe
from tests.distributed import run_ranks


def _router(**overrides):
    config = deepseek_v3.make_config("tiny-moe", overrides)
    router = moe.TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    return config, router


def test_bias_moves_against_the_imbalance():
    _, router = _router()
    router.train()
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    router(x)
    load = router.expert_load.clone()
    assert load.sum() == 64 * router.top_k
    loads = moe.update_expert_biases(router, speed=0.01)
    bias = router.e_score_correction_bias
    mean = load.mean()
    assert torch.equal(bias, 0.01 * torch.sign(mean - load))
    assert list(loads.values())[0] == load.tolist() and router.expert_load.sum() == 0


def test_each_micro_batch_counts_once_under_activation_checkpointing():
    config = deepseek_v3.make_config("tiny-moe")
    layer = moe.DeepSeekMoE(config).train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(2, 16, 128, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    out.sum().backward()          # recomputes the forward inside backward
    assert layer.gate.expert_load.sum().item() == 2 * 16 * config.num_experts_per_tok


def test_balance_loss_matches_the_report_formula():
    config, router = _router()
    B, S, E, K = 3, 10, config.n_routed_experts, config.num_experts_per_tok
    x = torch.randn(B * S, 128, generator=torch.Generator().manual_seed(2))
    scores = torch.nn.functional.linear(x, router.weight).sigmoid()
    _, indices = router(x)
    router.balance_alpha = 0.5
    got = router.sequence_balance_loss(scores, indices, seq_len=S)
    expected = 0.0
    for b in range(B):
        s = scores[b * S:(b + 1) * S]
        idx = indices[b * S:(b + 1) * S]
        f = torch.tensor([E / (K * S) * (idx == i).sum().item() for i in range(E)])
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        expected += (f * p).sum() / B
    assert torch.allclose(got, 0.5 * expected, atol=1e-6)


def test_balance_loss_gradient_reaches_the_router_at_the_loss_scale():
    config, router = _router()
    router.train()
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(3))
    moe.configure_balancing(router, alpha=0.1, grad_scale=0.25)
    weights, _ = router(x, seq_len=10)
    (weights * 0).sum().backward()                     # the main loss contributes nothing
    got = router.weight.grad.clone()
    router.weight.grad = None
    scores = torch.nn.functional.linear(x, router.weight).sigmoid()
    _, indices = router(x, seq_len=10)
    (0.25 * router.sequence_balance_loss(scores, indices, seq_len=10)).backward()
    assert got.abs().sum() > 0 and torch.allclose(got, router.weight.grad, atol=1e-7)
    assert moe.take_balance_loss(router) > 0 and moe.take_balance_loss(router) is None


def _two_rank_update():
    import torch.distributed as dist
    _, router = _router()
    router.expert_load.copy_(torch.arange(8, dtype=torch.float32) * (dist.get_rank() + 1))
    loads = moe.update_expert_biases(router, speed=1.0, group=dist.group.WORLD)
    return list(loads.values())[0], router.e_score_correction_bias.clone()


@pytest.mark.multirank
def test_loads_are_summed_over_data_parallel_ranks():
    results = run_ranks(_two_rank_update, world_size=2, timeout=120)
    expected = (torch.arange(8, dtype=torch.float32) * 3).tolist()
    for loads, bias in results:
        assert loads == expected
        assert bias.tolist() == torch.sign(torch.tensor(expected).mean() - torch.tensor(expected)).tolist()


def _dualpipe_copies(steps):
    from ds_ext.pipe.engine import initialize
    config = deepseek_v3.make_config("tiny-moe", {"num_hidden_layers": 4})
    model = deepseek_v3.build_pipeline(config, num_stages=2, schedule="dualpipe", seed=1)
    moe.configure_balancing(model, alpha=1e-4, grad_scale=1.0 / 4)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "steps_per_print": 10**6,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine = initialize(model=model, config=ds, model_parameters=list(model.parameters()), schedule="dualpipe")
    data = torch.randint(0, config.vocab_size, (steps, 4, 2, 17), generator=torch.Generator().manual_seed(0))
    it = ((data[s, m, :, :-1], data[s, m, :, 1:]) for s in range(steps) for m in range(4))
    balances = []
    for _ in range(steps):
        engine.train_batch(it)
        balances.append(moe.step_update(engine, speed=0.01)[1])
    return {n: r.e_score_correction_bias.clone() for n, r in moe.routers(engine.module)}, balances


@pytest.mark.multirank
def test_dualpipe_stage_copies_move_their_biases_alike():
    """dualpipe holds every stage twice (ranks r and R-1-r), each copy routing half of
    the micro-batches: the trainer's update sums both copies' loads, so the biases stay
    equal (summed over the data-parallel group only, they would be 0.02 apart after 3 steps),
    and reports each layer's balance loss once (the mean of its two copies')."""
    (a, balance_a), (b, balance_b) = run_ranks(_dualpipe_copies, world_size=2, args=(2,), timeout=120)
    assert set(a) == set(b) and a
    for name in a:
        assert torch.equal(torch.as_tensor(a[name]), torch.as_tensor(b[name])), name
        assert torch.as_tensor(a[name]).abs().sum() > 0         # the biases did move
    # each rank holds every MoE layer once (stage r and the copy of stage R-1-r): halved, the
    # two ranks' sums count the 3 layers' balance losses once. Each is alpha sum_i f_i P_i, and
    # sum_i f_i P_i is 1 for uniform routing (sum_i f_i = E, P_i = 1/E), 1.06 measured here at
    # init; counted twice it would be 2.1 x 3 alpha, above the bound
    for x, y in zip(balance_a, balance_b):
        assert 0.7 * 3e-4 < x + y < 1.5 * 3e-4, (x, y)
