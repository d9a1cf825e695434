"""Expert parallelism: the tiny-moe model trained for a few optimizer steps with
expert-parallel degree 1 and 2 (4 ranks = 2 stages x 2 data-parallel, ZeRO-1, 1F1B,
AdamW, clipping) gives bitwise the same losses, gradient norms and weights; with degree
2 each routed expert exists on exactly one rank of each expert-parallel group,
DeepSpeed sees the experts as its own (MoE param groups, expert-data-parallel gradient
groups), and a degree that does not divide the data-parallel size or the experts is
refused. Multi-rank; about 40 s.

Why bitwise holds on every CPU: with degree 2 each (source rank, expert) segment of the
received tokens is its own matrix multiply, the one the source rank runs with degree 1
(recipes/layers/moe.py), so forward and backward do the same arithmetic on the same
shapes; the expert weight gradient is then the sum of the two ranks' parts, added by
autograd with degree 2 and by the data-parallel reduction with degree 1, a sum of two
terms, which commutes. With several micro-batches per step that would no longer hold:
degree 1 adds a rank's micro-batches first and then the ranks, degree 2 the ranks inside
each micro-batch (the same sum, associated differently); so each step is one micro-batch
per replica, and there are more steps. The gradient norm that clipping divides by is the
exact one (``seekspeed.grad_norm: "exact"``, ds_ext/grad_norm.py): DeepSpeed's own ZeRO-1
norm sums the expert squares per expert-parallel rank, a different association with each
degree, and came out an ulp apart."""

import numpy as np
import pytest
import torch

from tests.distributed import run_ranks

STEPS, SEQ, MICRO, GAS, SEED = 4, 32, 2, 1, 5


def _ep_rank(ep, recipe="deepseek_v3", clip=1.0, grad_norm=None, bf16=False):
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils import groups
    from recipes import get_recipe
    from recipes.layers.moe import DeepSeekMoE
    spec = get_recipe(recipe)
    config = spec.make_config("tiny-moe", {"num_hidden_layers": 4}) if recipe == "deepseek_v3" else \
        spec.make_config("tiny")
    model = spec.build_pipeline(config, num_stages=2, seed=SEED, expert_parallel_size=ep)
    ds_config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                 "gradient_clipping": clip, "steps_per_print": 10**6,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.1}},
                 "zero_optimization": {"stage": 1}}
    if bf16:
        ds_config |= {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    if grad_norm is None:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=list(model.parameters()))
    else:
        from ds_ext.pipe.engine import initialize
        engine = initialize(model=model, config=ds_config, model_parameters=list(model.parameters()),
                            schedule="1f1b", grad_norm=grad_norm, log=lambda line: None)
    grid = model._grid
    dp = grid.get_data_parallel_id()
    g = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, config.vocab_size, (STEPS, 2, GAS, MICRO, SEQ + 1), generator=g)[:, dp]
    it = ((data[s, m, :, :-1], data[s, m, :, 1:]) for s in range(STEPS) for m in range(GAS))
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(it).item())
        norms.append(float(engine.get_global_grad_norm() or 0.0))
    experts = {}
    moe_layers = [(n, m) for n, m in engine.module.named_modules() if isinstance(m, DeepSeekMoE)]
    for name, layer in moe_layers:
        for local, expert in enumerate(layer.experts):
            experts[f"{name}.{layer.first_expert() + local}"] = torch.cat([p.detach().flatten()
                                                                          for p in expert.parameters()])
    dense = {n: p.detach().clone() for n, p in engine.module.named_parameters() if "deepspeed_moe" not in n}
    name = f"ep_size_{ep}"
    return {"losses": losses, "norms": norms, "stage": grid.get_stage_id(), "dp": dp, "experts": experts, "dense": dense,
            "has_moe": engine.has_moe_layers, "ep_rank": groups._get_expert_parallel_rank(name),
            "edp_size": groups._get_expert_data_parallel_world_size(name),
            "moe_groups": sum(1 for g in engine.optimizer.optimizer.param_groups if g.get("moe")),
            "rank": dist.get_rank()}


@pytest.mark.multirank
def test_expert_parallel_degree_two_equals_one():
    one = run_ranks(_ep_rank, world_size=4, args=(1, "deepseek_v3", 1.0, "exact"), timeout=300)
    two = run_ranks(_ep_rank, world_size=4, args=(2, "deepseek_v3", 1.0, "exact"), timeout=300)
    for a, b in zip(one, two):
        assert b["losses"] == a["losses"] and b["norms"] == a["norms"]
    assert all(n > 1.0 for n in one[0]["norms"])          # clipping at 1.0 acted on every step
    assert all(r["has_moe"] and r["moe_groups"] >= 1 for r in one + two)
    # each expert on exactly one rank of each expert-parallel group (same stage, same replica set)
    for stage in (0, 1):
        ranks = [r for r in two if r["stage"] == stage]
        assert sorted(r["ep_rank"] for r in ranks) == [0, 1] and all(r["edp_size"] == 1 for r in ranks)
        held = [set(r["experts"]) for r in ranks]
        assert not held[0] & held[1]
        everything = set(next(r for r in one if r["stage"] == stage)["experts"])
        assert held[0] | held[1] == everything and (everything or stage == 0)
    # the same weights after training: experts by global index, dense weights by name
    got, ref = {}, {}
    for r in two:
        got.update(r["experts"])
        got.update({f"{r['stage']}/{k}": v for k, v in r["dense"].items()})
    for r in one:
        ref.update(r["experts"])
        ref.update({f"{r['stage']}/{k}": v for k, v in r["dense"].items()})
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert np.array_equal(got[name], want), name


def _weights(results):
    out = {}
    for r in results:
        out.update(r["experts"])
        out.update({f"{r['stage']}/{k}": v for k, v in r["dense"].items()})
    return out


@pytest.mark.multirank
def test_deepseek_v4_degree_two_equals_one_with_the_exact_norm():
    """DeepSeek-V4's tiny preset (MoE in all 4 layers, a hash-routed one, the clamped
    SwiGLU's per-expert loop, mHC streams and token ids between stages), clipping at 1.0
    acting on every step, ``seekspeed.grad_norm: "exact"``: bitwise as degree 1, losses,
    gradient norms and every weight. DeepSpeed's own ZeRO-1 norm sums the expert squares
    per expert-parallel rank and came out 1 ulp apart on one step of four (2.814164639
    against 2.814164877); through the clip coefficient that moved weights by up to 4.7e-7.
    The exact norm (ds_ext/grad_norm.py) is a function of the gradients alone."""
    one = run_ranks(_ep_rank, world_size=4, args=(1, "deepseek_v4", 1.0, "exact"), timeout=300)
    two = run_ranks(_ep_rank, world_size=4, args=(2, "deepseek_v4", 1.0, "exact"), timeout=300)
    for a, b in zip(one, two):
        assert b["losses"] == a["losses"] and b["norms"] == a["norms"]
    assert all(n > 1.0 for n in one[0]["norms"])          # clipping at 1.0 acted on every step
    assert all(r["has_moe"] for r in one + two) and all(r["edp_size"] == 1 for r in two)
    got, ref = _weights(two), _weights(one)
    assert set(got) == set(ref) and any(k.endswith("mlp.7") for k in ref)
    for name, want in ref.items():
        assert np.array_equal(got[name], want), name


def test_degree_must_divide_data_parallel_and_experts(tmp_path):
    import json
    import os
    from ds_ext.config import load_config
    from ds_ext.errors import ConfigError
    from ds_ext import trainer
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "ds_configs", "tiny_moe_cpu.json")) as f:
        cfg = json.load(f)
    cfg["seekspeed"]["moe"]["expert_parallel_size"] = 3
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="expert_parallel_size 3 does not divide the data-parallel size 2"):
        load_config(str(path), world_size=4)
    cfg["seekspeed"]["moe"]["expert_parallel_size"] = 3
    path.write_text(json.dumps(cfg))
    os.environ["WORLD_SIZE"] = "6"
    try:
        args = trainer.parse_args(["--deepspeed", str(path), "--checkpoint-dir", str(tmp_path / "ck")])
        with pytest.raises(ConfigError, match="does not divide n_routed_experts 8"):
            trainer.validate(args, world_size=6)
    finally:
        os.environ.pop("WORLD_SIZE")
