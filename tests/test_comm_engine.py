"""The compressed reduction inside DeepSpeed's pipeline engines: seekspeed's dense
path (compressor fp32) against DeepSpeed's own reduction, bitwise, for ZeRO 0 and 1,
fp32 and bf16, MoE expert groups (DeepSeek-V4 under Muon among them) and a DualPipe
schedule; communication only at the
accumulation boundary; a non-finite gradient reaching DeepSpeed's overflow handling.
Multi-rank (2 or 4 gloo ranks); about 90 s."""

import numpy as np
import pytest
import torch

from tests.distributed import run_ranks

MOE = {"first_k_dense_replace": 1, "n_routed_experts": 8, "moe_intermediate_size": 48, "n_shared_experts": 1,
       "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2}


def engine_and_batches(comm, *, zero, precision, stages, gas, steps, schedule, overrides, poison_step=None, seed=7,
                       clip=1.0, weight_decay=None, recipe="deepseek_v3", optimizer="AdamW", same_data=False):
    """A tiny 4-layer pipeline engine (``comm``: a seekspeed.comm section as a dict, or
    None for DeepSpeed's reduction; ``precision`` fp32, bf16, bf16-fp32-accum or fp16)
    and an iterator over ``steps`` x ``gas`` micro-batches of this replica's data
    (``same_data``: replica 0's on every replica). At
    ``poison_step`` rank 1's gradient of one matrix is multiplied by inf. ``recipe``
    deepseek_v4: its tiny preset (4 MoE layers) instead; ``optimizer`` AdamW or Muon."""
    from deepspeed import comm as dist
    from ds_ext.config import CommSection
    from ds_ext.pipe.engine import initialize
    from recipes import get_recipe
    spec = get_recipe(recipe)
    config = spec.make_config("tiny", overrides if recipe == "deepseek_v4" else {"num_hidden_layers": 4, **overrides})
    model = spec.build_pipeline(config, num_stages=stages, schedule=schedule, seed=seed)
    params = {"lr": 1e-3, "eps": 1e-6} | ({} if weight_decay is None else {"weight_decay": weight_decay})
    if optimizer == "Muon":
        params |= {"muon_lr": 1e-2, "momentum": 0.95}
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
          "steps_per_print": 10 ** 6, "optimizer": {"type": optimizer, "params": params},
          "zero_optimization": {"stage": zero}}
    if precision.startswith("bf16"):
        ds["bf16"] = {"enabled": True}
    if precision == "bf16-fp32-accum":
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    if precision == "fp16":
        ds["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine = initialize(model=model, config=ds, model_parameters=list(model.parameters()), schedule=schedule,
                        comm=CommSection(**comm) if comm else None, log=lambda _: None)
    dp_id = model._grid.get_data_parallel_id()
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (steps, 8, gas, 2, 33), generator=g)[:, 0 if same_data else dp_id]
    if poison_step is not None and dist.get_rank() == 1:
        param = next(p for p in engine.module.parameters() if p.dim() == 2)
        param.register_hook(lambda grad: grad * float("inf") if engine.global_steps == poison_step else grad)

    def batches():
        for step in range(steps):
            for m in range(gas):
                rows = data[step, m]
                yield rows[:, :-1], rows[:, 1:]
    return engine, batches()


def _run(comm, *, zero, precision, stages, gas, steps, schedule, overrides, poison_step=None, seed=7, **model):
    import torch._dynamo.utils
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    engine, it = engine_and_batches(comm, zero=zero, precision=precision, stages=stages, gas=gas, steps=steps,
                                    schedule=schedule, overrides=overrides, poison_step=poison_step, seed=seed,
                                    **model)
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    reducer = engine.grad_reducer
    # what a compressor that wants whole matrices should see: this stage's 2-D parameters
    # by name, with their sizes
    matrices = {name: p.numel() for name, p in engine.module.named_parameters() if p.dim() == 2}
    return {"losses": losses, "state": state, "skipped": engine.skipped_steps, "matrices": matrices,
            "compressed_numel": 0 if reducer is None else reducer.last.compressed_numel,
            "calls": [] if reducer is None else [list(map(str, c)) for c in reducer.last.calls],
            "steps_reduced": 0 if reducer is None else reducer.steps,
            "collectives": 0 if reducer is None else reducer.last.collectives,
            "frames_compiled": torch._dynamo.utils.counters["frames"]["ok"] - frames}


def _pair(comm, kw):
    """DeepSpeed's reduction and the compressed one, in one process, same data."""
    return {"ds": _run(None, **kw), "ours": _run(comm, **kw)}


CASES = {
    "zero0-fp32": dict(zero=0, precision="fp32", stages=1, gas=2, schedule="1f1b", overrides={}),
    "zero1-fp32": dict(zero=1, precision="fp32", stages=1, gas=2, schedule="1f1b", overrides={}),
    "zero0-bf16": dict(zero=0, precision="bf16", stages=1, gas=2, schedule="1f1b", overrides={}),
    "zero1-bf16": dict(zero=1, precision="bf16", stages=1, gas=2, schedule="1f1b", overrides={}),
    "zero1-fp32-moe": dict(zero=1, precision="fp32", stages=1, gas=2, schedule="1f1b", overrides=MOE),
    # DeepSeek-V4 (MoE in every layer, mHC, compressed attention) under DeepSpeed's Muon
    "zero1-fp32-v4-moe-muon": dict(zero=1, precision="fp32", stages=1, gas=2, schedule="1f1b", overrides={},
                                   recipe="deepseek_v4", optimizer="Muon"),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_path_is_bitwise_deepspeeds_reduction(case):
    kw = dict(CASES[case], steps=3)
    results = run_ranks(_pair, world_size=2, args=({"compressor": "fp32", "min_numel": 256, "chunk_mb": 0.05}, kw),
                        timeout=240)
    for r in results:
        assert r["ds"]["losses"] == r["ours"]["losses"]
        # on the CPU accelerator nothing is compiled, DeepSpeed's Muon update included (ds_ext/muon.py)
        assert r["ds"]["frames_compiled"] == r["ours"]["frames_compiled"] == 0
        for name, want in r["ds"]["state"].items():
            np.testing.assert_array_equal(r["ours"]["state"][name], want, err_msg=name)
        # communication only at the accumulation boundary: one reduce() per gradient group per step
        assert r["ours"]["steps_reduced"] == 3
        assert r["ours"]["calls"] and all(c[2] == "True" for c in r["ours"]["calls"])
    groups = 2 if "moe" in case else 1
    assert len(results[0]["ours"]["calls"]) == groups


@pytest.mark.multirank
def test_topk_trains_under_dualpipev_zb_with_pipeline_and_data_parallel():
    kw = dict(zero=1, precision="fp32", stages=2, gas=4, steps=3, schedule="dualpipev-zb", overrides={})
    results = run_ranks(_pair, world_size=4, args=({"compressor": "topk", "ratio": 0.1, "min_numel": 256}, kw),
                        timeout=240)
    for r in results:
        assert r["ours"]["steps_reduced"] == 3 and all(c[2] == "True" for c in r["ours"]["calls"])
        assert np.isfinite(r["ours"]["losses"]).all()
        # the first step's loss comes before any reduction: the same arithmetic, bitwise
        assert r["ours"]["losses"][0] == r["ds"]["losses"][0]
        # then lossy, so not equal: a behavioural check that it is the same training (no
        # bound carries top-k's dropped 90 % through an Adam step), losses within 5 %
        np.testing.assert_allclose(r["ours"]["losses"], r["ds"]["losses"], rtol=0.05)
        assert any(not np.array_equal(r["ours"]["state"][k], v) for k, v in r["ds"]["state"].items())


def _powersgd_engines(case):
    """One step with PowerSGD's default dense list, one with every parameter compressed."""
    kw = dict(CASES[case], steps=1)
    comm = {"compressor": "powersgd", "rank": 2, "min_numel": 256}
    return _run(comm, **kw), _run({**comm, "dense_params": []}, **kw)


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["zero0-bf16", "zero0-fp32", "zero1-fp32"])
def test_powersgd_sees_matrices_and_leaves_embedding_and_head_dense(case):
    """PowerSGD gets each weight matrix whole, also from DeepSpeed's BF16_Optimizer
    (which reduces one flat buffer per parameter group); by default the embedding and
    output head go dense, and ``dense_params: []`` compresses them too."""
    default, every = run_ranks(_powersgd_engines, world_size=2, args=(case,), timeout=240)[0]
    matrices = default["matrices"]
    heads = {n for n in matrices if n.endswith(("embed_tokens.weight", "lm_head.weight"))}
    assert len(heads) == 2, sorted(matrices)
    assert default["compressed_numel"] == sum(v for n, v in matrices.items() if n not in heads)
    assert every["compressed_numel"] == sum(matrices.values())


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["topk", "powersgd", "int8"])
def test_non_finite_gradient_is_skipped_as_deepspeed_skips_it(name):
    """ZeRO 1 checks the reduced gradients for inf/NaN and skips the step (fp16 would
    too, but DeepSpeed has no fp16 on CPU): an inf in one rank's gradient at step 1 is
    skipped with compression as without it."""
    kw = dict(zero=1, precision="fp32", stages=1, gas=2, steps=3, schedule="1f1b", overrides={}, poison_step=1)
    results = run_ranks(_pair, world_size=2, args=({"compressor": name, "min_numel": 256}, kw), timeout=240)
    for r in results:
        assert r["ds"]["skipped"] == 1
        assert r["ours"]["skipped"] == r["ds"]["skipped"]
        assert all(np.isfinite(v).all() for v in r["ours"]["state"].values())
