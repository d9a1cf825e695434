"""Pipelined training equals a single-process run of the same model.

DeepSpeed's 1F1B (2 stages: dense, MoE, and 2 replicas with tied embeddings)
and DeepSpeed's DualPipeV (2 ranks x 2 stages each; tied embeddings; MTP; document-bounded attention,
the token ids travelling along the pipeline) train the tiny recipe for a few
optimizer steps on fixed data (ZeRO-1, gradient clipping, DeepSpeed's AdamW); losses
(rtol 1e-6) and updated weights (relative L2 1e-6 per tensor) are compared with a
single-process reference (same layers, same seeds, torch.optim.AdamW, fp32).
Multi-rank (2-4 gloo ranks); about 15 s per case on 2 cores.
"""

import numpy as np
import pytest
import torch

from tests.distributed import run_ranks
from tests.numerics import assert_weights_close

STEPS = 3
SEQ = 32
MICRO = 2
LR = 1e-3
SEED = 7
# eps 1e-6: Adam turns roundoff-sized gradients (1e-12) into lr-sized steps of random sign;
# a larger eps keeps the comparison about the schedules, not about that amplification
OPT = {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}


def _model_config(overrides):
    from recipes import deepseek_v3
    return deepseek_v3.make_config("tiny", {"num_hidden_layers": 4, **overrides})


def _data(*, dp, gas, vocab, document_token=None):
    g = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, vocab, (STEPS, dp, gas, MICRO, SEQ + 1), generator=g)
    if document_token is not None:          # documents of 3 to 9 tokens
        ends = torch.randint(3, 10, (STEPS, dp, gas, MICRO, SEQ + 1), generator=g)
        data[(torch.arange(SEQ + 1) % ends) == 0] = document_token
    return data


def _backward_first(forward, backward):
    """An overlapped_forward_backward hook that runs the F&B chunk's two halves in the
    other order; any order is correct, they belong to different micro-batches."""
    backward()
    forward()


def _pipeline_rank(schedule, stages, gas, overrides, hook=False, document_token=None):
    import deepspeed
    from deepspeed import comm as dist
    from recipes import deepseek_v3
    config = _model_config(overrides)
    world = dist.get_world_size()
    dp = world // stages
    model = deepseek_v3.build_pipeline(config, num_stages=stages, schedule=schedule, seed=SEED,
                                       document_token=document_token)
    if hook:
        model.overlapped_forward_backward = _backward_first
    ds_config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
                 "gradient_clipping": 1.0, "steps_per_print": 10**6,
                 "optimizer": {"type": "AdamW", "params": OPT},
                 "zero_optimization": {"stage": 1}}
    from ds_ext.pipe.engine import initialize
    engine = initialize(model=model, config=ds_config, model_parameters=list(model.parameters()), schedule=schedule)
    data = _data(dp=dp, gas=gas, vocab=config.vocab_size, document_token=document_token)[
        :, model._grid.get_data_parallel_id()]

    def batches():
        for step in range(STEPS):
            for m in range(gas):
                rows = data[step, m]
                yield rows[:, :-1], rows[:, 1:]

    it = batches()
    losses = [engine.train_batch(it).item() for _ in range(STEPS)]
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    return {"losses": losses, "state": state if model._grid.get_data_parallel_id() == 0 else {}}


def _reference(*, dp, gas, overrides, document_token=None):
    from recipes import deepseek_v3
    from recipes.layers.pipe import CausalLMLoss, SequentialReference
    torch.set_num_threads(1)
    config = _model_config(overrides)
    model = SequentialReference(deepseek_v3.layer_specs(config, seed=SEED, document_token=document_token),
                                loss_fn=CausalLMLoss(0.3, mtp=config.num_mtp_layers > 0))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=tuple(OPT["betas"]), eps=OPT["eps"],
                            weight_decay=OPT["weight_decay"])
    data = _data(dp=dp, gas=gas, vocab=config.vocab_size, document_token=document_token)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for r in range(dp):
            for m in range(gas):
                rows = data[step, r, m]
                loss = model.loss_fn(model(rows[:, :-1]), rows[:, 1:]) / (dp * gas)
                loss.backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return losses, {k: v.numpy() for k, v in model.state_dict().items()}


CASES = {
    "1f1b-pp2": dict(schedule="1f1b", world=2, stages=2, gas=4, overrides={}),
    "1f1b-pp2-dp2-tied": dict(schedule="1f1b", world=4, stages=2, gas=2, overrides={"tie_word_embeddings": True}),
    "dualpipev-pp2-tied": dict(schedule="dualpipev", world=2, stages=2, gas=4, overrides={"tie_word_embeddings": True}),
    "1f1b-pp2-moe": dict(schedule="1f1b", world=2, stages=2, gas=2, overrides={
        "first_k_dense_replace": 1, "n_routed_experts": 8, "moe_intermediate_size": 48, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}),
    "dualpipev-pp2-mtp": dict(schedule="dualpipev", world=2, stages=2, gas=4, overrides={"num_mtp_layers": 1}),
    "dualpipev-zb-pp2-tied-hook": dict(schedule="dualpipev-zb", world=2, stages=2, gas=4,
                                       overrides={"tie_word_embeddings": True}, hook=True),
    "dualpipev-zb-pp2-document": dict(schedule="dualpipev-zb", world=2, stages=2, gas=4, overrides={},
                                      document_token=256),
    "dualpipe-pp2-tied": dict(schedule="dualpipe", world=2, stages=2, gas=4, overrides={"tie_word_embeddings": True}),
    "dualpipe-pp4-dp1": dict(schedule="dualpipe", world=4, stages=4, gas=8, overrides={"num_hidden_layers": 8}),
    "dualpipev-zb-pp4-moe": dict(schedule="dualpipev-zb", world=4, stages=4, gas=8, overrides={
        "num_hidden_layers": 8, "first_k_dense_replace": 1, "n_routed_experts": 8, "moe_intermediate_size": 48,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2}),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_matches_single_process(case):
    c = CASES[case]
    results = run_ranks(_pipeline_rank, world_size=c["world"], args=(c["schedule"], c["stages"], c["gas"],
                                                                        c["overrides"], c.get("hook", False),
                                                                        c.get("document_token")),
                        timeout=240)
    ref_losses, ref_state = _reference(dp=c["world"] // c["stages"], gas=c["gas"], overrides=c["overrides"],
                                       document_token=c.get("document_token"))
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-6, atol=0)
    merged = {}
    for r in results:
        merged.update(r["state"])
    assert not np.allclose(ref_state["2.self_attn.o_proj.weight"], _initial_state(c["overrides"])["2.self_attn.o_proj.weight"])
    assert_weights_close(merged, ref_state)


def _initial_state(overrides):
    from recipes import deepseek_v3
    from recipes.layers.pipe import SequentialReference
    model = SequentialReference(deepseek_v3.layer_specs(_model_config(overrides), seed=SEED))
    return {k: v.numpy() for k, v in model.state_dict().items()}
