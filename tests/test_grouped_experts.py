"""Routed experts as grouped matrix multiplies (recipes/layers/moe.py, _GroupedSwiGLU).

Covers: the grouped path equals the per-expert loop bitwise, forward and every
gradient (input, router, each expert's weights, shared expert), fp32 and bf16 (and
another activation than SiLU, through autograd's derivative), with
experts no token chose, and on two source ranks' segments as expert parallelism
delivers them; zero-bubble deferral (WeightGradStore) queues the experts' weight
gradients and popping them gives the immediate ones bitwise; the fallback to the loop
where grouped_mm refuses a dtype or shape, and the errors for a forced or unknown
implementation; the experts stay separate Parameters under DeepSpeed's names, laid
out so the grouped path reads them without a copy; and the recipe's layer against
transformers' DeepseekV3MoE on the same weights. Single process; about 3 s (5 s with
imports).

Why bitwise against the loop: on CPU grouped_mm runs one mm per group, on the same
views of the same rows and of the same weight tensors as ExpertMLP's ``linear`` calls
(x @ W^T with W transposed, grad @ W, grad^T @ x), and the SwiGLU's elementwise ops
are the same torch ops; only where the results are written differs.
"""

import numpy as np
import pytest
import torch

from ds_ext.pipe.zero_bubble import WeightGradStore
from recipes import deepseek_v3
from recipes.layers import moe
from tests.numerics import assert_within, gamma

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 64, 48, 8, 2, 48
UNCHOSEN = (0, 3, 5)      # experts whose router bias keeps every token away


def _config(**overrides):
    return deepseek_v3.make_config("tiny-moe", {"hidden_size": HIDDEN, "moe_intermediate_size": INTER,
                                                "n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K,
                                                "n_group": 1, "topk_group": 1, **overrides})


def _layer(impl, *, dtype=torch.float32, config=None):
    layer = moe.DeepSeekMoE(config or _config(), experts_impl=impl)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        layer.gate.e_score_correction_bias[list(UNCHOSEN)] = -100.0
    return layer.to(dtype).train()


def _inputs(dtype, hidden=HIDDEN):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, TOKENS // 2, hidden, generator=g)
    return x.to(dtype), torch.randn(2, TOKENS // 2, hidden, generator=g).to(dtype)


def _step(layer, x, grad):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("dtype,act", [(torch.float32, "silu"), (torch.bfloat16, "silu"), (torch.float32, "gelu")],
                         ids=["fp32", "bf16", "fp32-gelu"])
def test_grouped_equals_loop_bitwise(dtype, act):
    x, grad = _inputs(dtype)
    config = _config(hidden_act=act)
    loop, grouped = _layer("loop", dtype=dtype, config=config), _layer("grouped", dtype=dtype, config=config)
    want, got = _step(loop, x, grad), _step(grouped, x, grad)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert set(got[2]) == set(want[2]) and len(got[2]) == 1 + 2 * EXPERTS + 3     # router, experts, shared
    for name, g in want[2].items():
        assert g is not None and got[2][name] is not None, name
        assert torch.equal(got[2][name], g), name
    for e in UNCHOSEN:        # no token, still a (zero) gradient: every rank reduces the same buckets
        assert not grouped.experts[e].gate_up_proj.grad.any() and not grouped.experts[e].down_proj.grad.any()
    assert grouped.experts[1].gate_up_proj.grad.any()


@pytest.mark.parametrize("call_rows", [None, 4], ids=["one-call-per-source", "calls-of-4-rows"])
def test_two_sources_equal_loop_bitwise(call_rows, monkeypatch):
    """The rows expert parallelism delivers: by source rank, then by local expert, one
    source sending nothing to some experts and a third sending nothing at all; and the
    same rows split into grouped_mm calls of at most 4 rows (or one segment), as CPU
    runs V2-Lite-sized layers (moe._CPU_CALL_BYTES)."""
    if call_rows:
        monkeypatch.setattr(moe, "_CPU_CALL_BYTES", call_rows * 2 * INTER * 4)
    layer_loop, layer_grouped = _layer("loop"), _layer("grouped")
    counts = [[3, 0, 5, 0, 2, 0, 0, 4], [0, 0, 0, 0, 0, 0, 0, 0], [1, 0, 2, 6, 0, 0, 3, 1]]
    g = torch.Generator().manual_seed(2)
    received = torch.randn(sum(map(sum, counts)), HIDDEN, generator=g)
    grad = torch.randn(received.shape, generator=g)
    results = []
    for layer in (layer_loop, layer_grouped):
        r = received.clone().requires_grad_(True)
        out = layer._run_experts(r, counts)
        out.backward(grad)
        results.append((out, r.grad, [p.grad for p in layer.experts.parameters()]))
    (out_a, dx_a, dw_a), (out_b, dx_b, dw_b) = results
    calls = moe._Segments(counts, device=received.device, row_bytes=2 * INTER * 4).calls
    assert len(calls) == (2 if call_rows is None else 7)
    assert torch.equal(out_a, out_b) and torch.equal(dx_a, dx_b)
    assert all(a is not None and torch.equal(a, b) for a, b in zip(dw_a, dw_b))


def test_deferred_weight_grads_equal_immediate(monkeypatch):
    monkeypatch.setattr(moe, "_CPU_CALL_BYTES", 8 * 2 * INTER * 4)     # several grouped_mm calls
    x, grad = _inputs(torch.float32)
    want = _step(_layer("grouped"), x, grad)[2]
    layer = _layer("grouped")
    try:
        WeightGradStore.enabled = True
        _, dx, grads = _step(layer, x, grad)
        assert dx is not None
        assert all(grads[n] is None for n in grads if "deepspeed_experts" in n or "shared_mlp" in n)
        WeightGradStore.flush()
        WeightGradStore.enabled = False
        WeightGradStore.pop()
    finally:
        WeightGradStore.clear()
    for name, param in layer.named_parameters():
        assert torch.equal(param.grad, want[name]), name


def test_fallback_and_errors(monkeypatch, capsys):
    monkeypatch.setattr(moe, "_CHOSEN", {})
    # bf16 rows of 60 elements are 120 bytes: grouped_mm on CPU asks for 16-byte multiples
    config = _config(hidden_size=60)
    layer = _layer("auto", dtype=torch.bfloat16, config=config)
    x, grad = _inputs(torch.bfloat16, hidden=60)
    out, dx, grads = _step(layer, x, grad)
    assert torch.isfinite(out.float()).all() and all(g is not None for g in grads.values())
    line = capsys.readouterr().err.strip().splitlines()
    assert line == ["seekspeed moe: routed experts on cpu bfloat16 (hidden 60, moe_intermediate 48): loop "
                    "(grouped_mm refused it: strides should be multiple of 16 bytes)"]
    layer(x)
    assert capsys.readouterr().err == ""       # decided and printed once
    with pytest.raises(ValueError, match="experts_impl 'grouped' on cpu torch.bfloat16 .* use experts_impl 'auto'"):
        _layer("grouped", dtype=torch.bfloat16, config=config)(x)
    with pytest.raises(ValueError, match=r"experts_impl 'fast' is unknown: use one of \['auto', 'grouped', 'loop'\]"):
        moe.DeepSeekMoE(config, experts_impl="fast")


def test_experts_stay_separate_parameters_in_one_buffer():
    layer = _layer("auto")
    names = [n for n, _ in layer.named_parameters() if "deepspeed_experts" in n]
    assert names == [f"deepspeed_moe.experts.deepspeed_experts.{i}.{w}" for i in range(EXPERTS)
                     for w in ("gate_up_proj", "down_proj")]
    view = moe.stacked_view([e.gate_up_proj for e in layer.experts])
    assert view is not None and torch.equal(view, torch.stack([e.gate_up_proj.detach() for e in layer.experts]))
    layer.to(torch.bfloat16)          # new tensors per parameter: laid out in one buffer again
    assert moe.stacked_view([e.down_proj for e in layer.experts]) is not None
    assert layer.experts[0].down_proj.dtype == torch.bfloat16 and layer.experts[0].down_proj.allreduce is False


def test_matches_transformers_deepseek_v3_moe():
    """The recipe's grouped layer against transformers' DeepseekV3MoE (eager experts)
    on the same weights. Output, router and shared-expert gradients: the same torch
    ops on the same operands in the same order (each token's expert outputs are added
    in expert order on both sides; an expert's rows come in another order, and an mm
    row does not depend on the other rows: so under MKL's AVX-512, AVX2 and SSE4.2
    kernels, on 1 and 2 threads), so bitwise. Expert weight gradients sum the same
    products over an expert's rows in another order (here by token, there by top-k
    slot, then token); any order of n products is within gamma(n) * sum |products|
    of the exact sum, so the two differ by at most 2 gamma(n) * sum |products|, with
    sum |products| taken from the operands of our weight-gradient products. The input
    gradient adds k + 2 terms per element (k routed rows, router, shared expert) in
    another order: at most 2 gamma(k + 1) * sum |terms|."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from recipes.layers.hf import moe_layer_to_hf
    config = _config()
    ours = _layer("grouped", config=config)
    hf_config = config.to_hf_config()
    hf_config._experts_implementation = "eager"
    theirs = DeepseekV3MoE(hf_config).train()
    theirs.load_state_dict(moe_layer_to_hf(ours.state_dict()), strict=True)
    x, grad = _inputs(torch.float32)

    # the absolute values of what our backward adds up
    abs_products, rows, terms = {}, {}, []
    original = moe._Segments.weight_grad

    def weight_grad(self, grads, inputs, *, shape, like):
        sums = torch.zeros((EXPERTS,) + shape, dtype=torch.float64)
        for c, (lo, hi, first, ends) in enumerate(self.calls):      # one source rank
            g = (grads[c] if isinstance(grads, list) else grads[lo:hi]).double().abs()
            a = (inputs[c] if isinstance(inputs, list) else inputs[lo:hi]).double().abs()
            for j, (s, e) in enumerate(zip([0] + ends[:-1].tolist(), ends.tolist())):
                sums[first + j] += g[s:e].t() @ a[s:e]
                rows["max"] = max(rows.get("max", 0), e - s)
        abs_products["gate_up_proj" if shape[0] == 2 * INTER else "down_proj"] = sums
        return original(self, grads, inputs, shape=shape, like=like)

    ours.gate.register_forward_hook(lambda m, i, out: terms.append(("indices", out[1])))
    ours.gate.register_full_backward_hook(lambda m, gin, gout: terms.append(("router", gin[0])))
    ours.shared_mlp.register_full_backward_hook(lambda m, gin, gout: terms.append(("shared", gin[0])))
    run_experts = ours._run_experts

    def keep_received_grad(received, counts):
        received.register_hook(lambda g: terms.append(("received", g)))
        return run_experts(received, counts)

    ours._run_experts = keep_received_grad
    try:
        moe._Segments.weight_grad = weight_grad
        out, dx, grads = _step(ours, x, grad)
    finally:
        moe._Segments.weight_grad = original
    x_hf = x.clone().requires_grad_(True)
    out_hf = theirs(x_hf)
    out_hf.backward(grad)

    assert torch.equal(out, out_hf.detach())
    mine = moe_layer_to_hf(grads)
    for name, param in theirs.named_parameters():
        if name.startswith("experts."):
            bound = 2 * gamma(rows["max"]) * abs_products[name.split(".")[1]].numpy()
            assert_within(mine[name].numpy(), param.grad.numpy(), bound, what=name)
        else:
            assert torch.equal(mine[name], param.grad), name
    got = dict(terms)
    token_of = torch.argsort(got["indices"].reshape(-1), stable=True) // TOP_K
    routed = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64).index_add(0, token_of, got["received"].double().abs())
    abs_terms = routed + got["router"].double().abs().reshape(TOKENS, HIDDEN) + \
        got["shared"].double().abs().reshape(TOKENS, HIDDEN)
    bound = 2 * gamma(TOP_K + 1) * abs_terms.numpy()
    assert_within(dx.reshape(TOKENS, HIDDEN).numpy(), x_hf.grad.reshape(TOKENS, HIDDEN).numpy(), bound, what="input")
    assert np.any(dx.numpy() != 0)
