"""Layer-level F&B overlap (``overlap="layer"``, ds_ext/pipe/overlap.py) trains exactly as
the sequential F&B chunk does: the tiny-moe model on 4 ranks (2 stages x 2 replicas,
expert-parallel degree 2, ZeRO-1, AdamW, clipping) for 3 optimizer steps under
``dualpipev-zb`` (with MTP) and ``dualpipe``, and DeepSeek-V4's tiny preset (hash and
score routing, the mHC streams and token ids between stages) under ``dualpipev-zb``;
overlap none and layer in the same
processes from the same initial weights and data: bitwise the same losses, gradient
norms and updated weights on every rank.

Why bitwise: interleaving changes when each piece of a micro-batch's forward and
backward runs, not what it computes. Every micro-batch's arithmetic is the same, the
backward halves of the chunks (which accumulate weight gradients) keep their order, and
the half on the worker thread computes with the same thread count. Also checked: the
interleave really switched (the trace shows all-to-alls of one micro-batch issued while
the other half's was in flight, in every F&B chunk whose two halves both hold MoE
layers), and the all-to-all lanes are recorded.
Multi-rank; about 40 s on 2 cores.
"""

import numpy as np
import pytest
import torch

from tests.distributed import run_ranks

STEPS, SEQ, MICRO, SEED = 3, 16, 2, 11


def _train(schedule, overlap, *, mtp, trace, recipe="deepseek_v3"):
    from deepspeed import comm as dist
    from recipes import get_recipe
    from ds_ext.pipe.engine import InstructionTimeline, initialize
    spec = get_recipe(recipe)
    if recipe == "deepseek_v3":
        overrides = {"num_hidden_layers": 4, "first_k_dense_replace": 1}
        if mtp:
            overrides["num_mtp_layers"] = 1
        config = spec.make_config("tiny-moe", overrides)
    else:       # DeepSeek-V4's tiny preset: MoE in all 4 layers, hash-routed first, mHC streams between stages
        config = spec.make_config("tiny")
    model = spec.build_pipeline(config, num_stages=2, schedule=schedule, seed=SEED, expert_parallel_size=2)
    gas = 4
    ds_config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
                 "gradient_clipping": 1.0, "steps_per_print": 10**6,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.1}},
                 "zero_optimization": {"stage": 1}}
    engine = initialize(model=model, config=ds_config, model_parameters=list(model.parameters()), schedule=schedule,
                        overlap=overlap)
    dp = model._grid.get_data_parallel_id()
    g = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, config.vocab_size, (STEPS, 2, gas, MICRO, SEQ + 1), generator=g)[:, dp]
    it = ((data[s, m, :, :-1], data[s, m, :, 1:]) for s in range(STEPS) for m in range(gas))
    losses, norms, events = [], [], []
    for step in range(STEPS):
        if trace and step == STEPS - 1:
            engine.timeline = InstructionTimeline()
        losses.append(engine.train_batch(it).item())
        norms.append(float(engine.get_global_grad_norm()))
    if engine.timeline is not None:
        events = [(name, kwargs.get("what"), start, end) for name, kwargs, start, end in engine.timeline.events]
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    dist.barrier()
    return {"losses": losses, "norms": norms, "weights": weights, "events": events}


def _both(schedule, mtp, recipe):
    return {mode: _train(schedule, mode, mtp=mtp, trace=mode == "layer", recipe=recipe) for mode in ("none", "layer")}


def _chunks_with_both(events):
    """(F&B chunks whose two halves both ran all-to-alls, those of them in which one
    half's all-to-all was in flight while the other half's was too)."""
    chunks = [(s, e) for name, _, s, e in events if name == "ForwardBackwardPass"]
    flights = [(what, s, e) for name, what, s, e in events if name == "AllToAll"]
    both = interleaved = 0
    for cs, ce in chunks:
        inside = [(w, s, e) for w, s, e in flights if cs <= s and e <= ce]
        fwd = [(s, e) for w, s, e in inside if w.startswith("F ")]
        bwd = [(s, e) for w, s, e in inside if w.startswith("B ")]
        if fwd and bwd:
            both += 1
            interleaved += any(fs < be and bs < fe for fs, fe in fwd for bs, be in bwd)
    return both, interleaved


@pytest.mark.multirank
@pytest.mark.parametrize("schedule,mtp,recipe", [("dualpipev-zb", True, "deepseek_v3"), ("dualpipe", False, "deepseek_v3"),
                                                 ("dualpipev-zb", False, "deepseek_v4")])
def test_layer_overlap_trains_as_sequential(schedule, mtp, recipe):
    results = run_ranks(_both, world_size=4, args=(schedule, mtp, recipe), timeout=300)
    chunks = 0
    for rank, r in enumerate(results):
        none, layer = r["none"], r["layer"]
        assert layer["losses"] == none["losses"], (rank, layer["losses"], none["losses"])
        assert layer["norms"] == none["norms"], (rank, layer["norms"], none["norms"])
        assert set(layer["weights"]) == set(none["weights"])
        for k, v in none["weights"].items():
            assert np.array_equal(layer["weights"][k], v), f"rank {rank}: {k} differs after {STEPS} steps"
        events = layer["events"]
        kinds = {what.split(" ")[1] for name, what, _, _ in events if name == "AllToAll"}
        assert kinds == {"counts", "dispatch", "combine"}, kinds
        assert any(name == "WaitAllToAll" for name, *_ in events)
        both, interleaved = _chunks_with_both(events)
        assert interleaved == both, f"rank {rank}: {both - interleaved} of {both} F&B chunks with MoE in both " \
                                    f"halves ran them one after the other"
        chunks += both
    assert chunks > 0, "no F&B chunk had MoE layers in both halves: the case tests no interleaving"


def test_layer_that_cannot_be_split_is_refused():
    from deepspeed.moe.layer import MoE
    from ds_ext.errors import ConfigError
    from ds_ext.pipe.overlap import check_splittable
    from recipes import deepseek_v3
    from recipes.layers.moe import DeepSeekMoE

    class BlockingMoE(MoE):       # a DeepSpeed MoE layer whose all-to-alls block
        def __init__(self):
            torch.nn.Module.__init__(self)

    check_splittable(torch.nn.Sequential(DeepSeekMoE(deepseek_v3.make_config("tiny-moe"))))
    with pytest.raises(ConfigError, match=r"BlockingMoE \(1\) runs its all-to-alls synchronously.*set overlap 'none'"):
        check_splittable(torch.nn.Sequential(torch.nn.Linear(2, 2), BlockingMoE()))
