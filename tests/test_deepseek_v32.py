"""The DeepSeek-V3.2 recipe (DeepSeek Sparse Attention) against transformers'
DeepseekV32ForCausalLM, and its two training stages.

- Parity (fp32, 48 tokens, index_topk 16: two thirds of the queries drop keys): the
  indexer selects the same keys as transformers' in every layer, logits and loss agree
  (bitwise for the dense tiny model, which does transformers' arithmetic in its order;
  within 1e-5 with MoE layers, whose expert sums run in another order), and so does
  every main-model gradient.
- Sparse stage: the main model's gradient does not depend on the KL weight (the indexer
  reads detached inputs); the indexer's gradient is that of L_I computed directly by
  autograd from transformers' own (eager) attention probabilities and selections, at
  the configured gradient scale; its weight gradients wait for zero-bubble's W slots.
- Dense warm-up: only the indexers require a gradient, attention is dense, and the
  indexer's gradient is the dense L_I's; under activation checkpointing (DeepSpeed's
  reentrant and non-reentrant checkpoint) the gradients are the same bits and L_I is
  recorded once per micro-batch.
- The deepseek-v3.2 preset's parameter count (meta device) against transformers and the
  published 685B; planner figures against autograd; config errors.
- Generation with the latent KV cache and cached indexer keys equals the full forward
  and transformers' greedy generate.
Single process (about 45 s of CPU, a third of it transformers' first model build and
generate), plus two 2-rank pipeline cases (DeepSpeed 1F1B, zero-bubble DualPipeV) of
about 15 s each.
"""

import pytest
import torch
import torch.nn.functional as F

from recipes import deepseek_v32
from recipes.layers import dsa
from recipes.layers.hf import copy_into_transformers, load_hf_state_dict, to_hf_state_dict
from recipes.layers.reference import SequentialReference
from tests.numerics import assert_sum_close, saved_bytes_per_token

SEQ = 48
# L_I of near-equal distributions is a small difference of sums of O(log T) terms
# (p log p - p log q): fp32 roundoff u = 6e-8 of p and log q gives about u log(48) = 2.3e-7
# per query and layer; times 4 layers and the weights used here (<= 2): 2e-6.
KL_ABS = 2e-6


def _ids(config, seed, batch=2, seq=SEQ):
    return torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _labels(ids):
    return torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)


def _hf(config, *, attn="sdpa", seed=0):
    from transformers import DeepseekV32ForCausalLM
    hf_config = config.to_hf_config()
    hf_config._attn_implementation = attn
    torch.manual_seed(seed)
    hf = DeepseekV32ForCausalLM(hf_config)
    with torch.no_grad():   # transformers initialises the router bias to zero; make it matter
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    return hf


def _ours(config, hf, **dsa_options):
    model = SequentialReference(deepseek_v32.layer_specs(config, seed=123, **dsa_options))
    load_hf_state_dict(model, hf.state_dict(), config)
    return model


def _hf_selections(hf, run):
    """bool [B, S, T] of the keys transformers' indexer kept, per layer, while ``run()``."""
    got = []
    hooks = [m.register_forward_hook(lambda mod, args, out: got.append(out))
             for m in hf.modules() if type(m).__name__ == "DeepseekV32Indexer"]
    try:
        result = run()
    finally:
        for h in hooks:
            h.remove()
    seq = got[0].shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return result, [torch.zeros(idx.shape[0], seq, seq, dtype=torch.bool).scatter(-1, idx.long(), True) & causal
                    for idx in got]


def _our_selections(monkeypatch):
    got = []

    def recording(index_scores, allowed, topk):
        out = select_topk(index_scores, allowed, topk)
        got.append(out[:, 0])
        return out

    select_topk = dsa.select_topk
    monkeypatch.setattr(dsa, "select_topk", recording)
    return got


def _grads(model, config):
    return to_hf_state_dict({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, config)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_logits_loss_and_selection_match_transformers(preset, monkeypatch):
    config = deepseek_v32.make_config(preset)
    hf = _hf(config).eval()
    ours = _ours(config, hf).eval()
    ids = _ids(config, 1)
    ref, theirs = _hf_selections(hf, lambda: hf(input_ids=ids, labels=ids))
    mine = _our_selections(monkeypatch)
    with torch.no_grad():
        logits = ours(ids)
    loss = ours.loss_fn(logits, _labels(ids))
    assert len(mine) == len(theirs) == config.num_hidden_layers
    causal_keys = torch.arange(1, SEQ + 1)
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
        kept = a.sum(-1)
        assert torch.equal(kept, causal_keys.clamp(max=config.index_topk).expand_as(kept))
        assert (kept < causal_keys).sum() == 2 * (SEQ - config.index_topk)    # sparsity matters
    if config.num_moe_layers() == 0:
        assert torch.equal(ref.logits, logits) and ref.loss.item() == loss.item()
    assert (ref.logits - logits).abs().max().item() <= 1e-5
    assert abs(ref.loss.item() - loss.item()) <= 1e-5


def _reference_kl(hf, ids, config, *, weight, sparse):
    """weight * sum over layers of the mean over queries of KL(p_t || softmax(I_t)) over
    the kept keys, by autograd on transformers' modules: p from its eager attention's
    probabilities, I written out from its indexer's weights, S_t its selections."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
    hf.eval()
    with torch.no_grad():
        out, kept = _hf_selections(hf, lambda: hf(input_ids=ids, output_attentions=True, output_hidden_states=True))
    batch, seq = ids.shape
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    rope_dim = config.qk_rope_head_dim
    total = 0.0
    for i, layer in enumerate(hf.model.layers):
        x = layer.input_layernorm(out.hidden_states[i].detach())
        attn, idx = layer.self_attn, layer.self_attn.indexer
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x)).detach()
        x = x.detach()
        cos, sin = hf.model.rotary_emb(x, torch.arange(seq)[None])
        q = idx.wq_b(q_resid).view(batch, seq, idx.n_heads, idx.head_dim)
        k = idx.k_norm(idx.wk(x)).unsqueeze(2)
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :rope_dim], k[..., :rope_dim], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q[..., rope_dim:]], -1), torch.cat([k_rot, k[..., rope_dim:]], -1).squeeze(2)
        per_head = F.relu(torch.einsum("bshd,btd->bsht", q, k) * idx.head_dim ** -0.5)
        scores = torch.einsum("bsh,bsht->bst", idx.weights_proj(x) * idx.n_heads ** -0.5, per_head)
        keys = kept[i] if sparse else causal.expand(batch, -1, -1)
        p = out.attentions[i].detach().sum(1)
        p = p / p.sum(-1, keepdim=True)
        assert p.masked_fill(keys, 0).abs().max() == 0          # the attention read only those keys
        log_q = torch.log_softmax(scores.masked_fill(~keys, float("-inf")), -1)
        total = total + torch.where(keys, torch.special.xlogy(p, p) - p * log_q, 0.0).sum(-1).mean()
    return weight * total


def _assert_indexer_grads(ours, reference, hf, config):
    """Our indexer gradients against autograd of ``reference``: both fp32, with p from
    eager attention (transformers) or a chunked softmax (ours), I by einsum or matmul:
    the same arithmetic in other orders, so agreement to 1e-4 of each gradient's largest
    entry (2e-5 measured)."""
    names = [n for n, _ in hf.named_parameters() if ".indexer." in n]
    params = dict(hf.named_parameters())
    expected = torch.autograd.grad(reference, [params[n] for n in names])
    got = _grads(ours, config)
    for name, grad in zip(names, expected):
        assert (got[name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_sparse_stage_gradients(preset):
    """Main-model gradients equal transformers' (which has no indexer loss) for KL
    weights 0.5 and 0; the indexer's is L_I's gradient, scaled by grad_scale."""
    config = deepseek_v32.make_config(preset)
    hf = _hf(config).train()
    ids = _ids(config, 3)
    hf(input_ids=ids, labels=ids).loss.backward()
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    runs = {}
    for weight, scale in ((0.5, 1.0), (0.0, 1.0), (0.5, 0.25)):
        ours = _ours(config, hf, indexer_kl_weight=weight).train()
        dsa.configure_indexer(ours, grad_scale=scale)
        ours.loss_fn(ours(ids), _labels(ids)).backward()
        runs[weight, scale] = ours, _grads(ours, config), dsa.take_indexer_loss(ours)
    ours, grads, loss = runs[0.5, 1.0]
    main = {n: g for n, g in grads.items() if ".indexer." not in n}
    assert set(main) == {n for n, g in theirs.items() if g is not None}     # transformers' indexer: no_grad
    for name, grad in main.items():
        if config.num_moe_layers() == 0:
            assert torch.equal(grad, theirs[name]), name
        assert (grad - theirs[name]).abs().max().item() <= 1e-5, name
    no_kl = runs[0.0, 1.0][1]
    assert set(no_kl) == set(main) and runs[0.0, 1.0][2] is None
    for name, grad in main.items():
        assert torch.equal(grad, no_kl[name]), name            # the KL never reaches the main model
    quarter = runs[0.5, 0.25][1]
    for name, grad in grads.items():
        assert torch.equal(quarter[name], grad * (0.25 if ".indexer." in name else 1.0)), name
    hf.config._attn_implementation = "eager"      # its attention probabilities are the KL's target
    reference = _reference_kl(hf, ids, config, weight=0.5, sparse=True)
    assert loss == pytest.approx(reference.item(), abs=KL_ABS)
    _assert_indexer_grads(ours, reference, hf, config)


def test_warmup_trains_only_the_indexer_on_dense_attention():
    config = deepseek_v32.make_config("tiny")
    hf = _hf(config)
    ids = _ids(config, 4)
    warm = _ours(config, hf, dsa_stage="warmup", indexer_kl_weight=2.0).train()
    trainable = dsa.freeze_for_warmup(warm)
    names = [n for n, p in warm.named_parameters() if p.requires_grad]
    assert names and all(".indexer." in n for n in names)
    assert trainable == sum(p.numel() for n, p in warm.named_parameters() if ".indexer." in n)
    # dense: the same as the model that keeps every key (index_topk >= the sequence)
    dense_config = deepseek_v32.make_config("tiny", {"index_topk": SEQ})
    dense = _ours(dense_config, hf, indexer_kl_weight=2.0).train()
    sparse = _ours(config, hf, indexer_kl_weight=2.0).train()
    logits = warm(ids)
    with torch.no_grad():
        assert torch.equal(logits, dense(ids))
        assert (logits - sparse(ids)).abs().max() > 1e-3
    warm.loss_fn(logits, _labels(ids)).backward()
    assert all((p.grad is not None) == (".indexer." in n) for n, p in warm.named_parameters())
    dense_hf = _hf(dense_config, attn="eager")      # the same weights, every key kept
    reference = _reference_kl(dense_hf, ids, config, weight=2.0, sparse=False)
    assert dsa.take_indexer_loss(warm) == pytest.approx(reference.item(), abs=KL_ABS)
    _assert_indexer_grads(warm, reference, dense_hf, config)


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_activation_checkpointing_gives_the_same_gradients_and_records_once(stage):
    """Recomputation under DeepSpeed's checkpoint functions: the same gradient bits,
    and L_I counted once per micro-batch (reentrant: recorded when recomputed, the
    first pass has no graph; non-reentrant: recorded in the forward). The warm-up's
    first segment sees a frozen embedding's output, which only the non-reentrant
    function (build_pipeline's choice for the warm-up) can train through."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import checkpoint, non_reentrant_checkpoint
    config = deepseek_v32.make_config("tiny")
    ids = _ids(config, 5, seq=40)

    def run(checkpoint_fn):
        model = SequentialReference(deepseek_v32.layer_specs(config, seed=5, dsa_stage=stage,
                                                             indexer_kl_weight=1.0)).train()
        if stage == "warmup":
            dsa.freeze_for_warmup(model)
        funcs = model._funcs
        x = funcs[0](ids)
        for start in (1, 3):                     # two checkpointed segments of two layers
            def segment(h, start=start):
                for f in funcs[start:start + 2]:
                    h = f(h)
                return h
            x = segment(x) if checkpoint_fn is None else checkpoint_fn(segment, x)
        for f in funcs[5:]:
            x = f(x)
        model.loss_fn(x, _labels(ids)).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        loss = dsa.take_indexer_loss(model)
        assert dsa.take_indexer_loss(model) is None
        return grads, loss

    plain, plain_loss = run(None)
    fns = [non_reentrant_checkpoint] + ([checkpoint] if stage == "sparse" else [])
    for fn in fns:
        grads, loss = run(fn)
        assert loss == plain_loss and set(grads) == set(plain)
        for name in plain:
            assert torch.equal(grads[name], plain[name]), name


def test_zero_bubble_defers_the_indexer_weight_gradients():
    from ds_ext.pipe.zero_bubble import WeightGradStore
    config = deepseek_v32.make_config("tiny")
    ids = _ids(config, 6, batch=1, seq=32)
    grads = []
    for deferred in (False, True):
        model = SequentialReference(deepseek_v32.layer_specs(config, seed=6, indexer_kl_weight=1.0)).train()
        WeightGradStore.clear()
        WeightGradStore.enabled = deferred
        try:
            model.loss_fn(model(ids), _labels(ids)).backward()
            projections = [m.weight for n, m in model.named_modules() if ".indexer." in f".{n}."
                           and isinstance(m, torch.nn.Linear)]
            assert len(projections) == 3 * config.num_hidden_layers
            assert all((p.grad is None) == deferred for p in projections)
            if deferred:
                WeightGradStore.flush()
                WeightGradStore.pop()
        finally:
            WeightGradStore.clear()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name


def test_deepseek_v32_parameter_count():
    """On the meta device: exactly transformers' DeepseekV32ForCausalLM (671.88B: V3's
    671.03B plus 61 indexers of 13.96M). DeepSeek-V3.2-Exp's published 685B (its
    checkpoint's tensors, to the nearest billion) includes the MTP module (layer 61) as
    the checkpoint stores it, with its own copies of the embedding and the output head,
    which this recipe ties to the main model's: 685.36B here. The checkpoint's fp8 block
    scales (one fp32 per 128 x 128 weights, about 0.04B) are not parameters here."""
    from transformers import DeepseekV32ForCausalLM
    from ds_ext.pipe.partition import count_parameters, stage_parameter_counts
    config = deepseek_v32.make_config("deepseek-v3.2")
    with torch.device("meta"):
        hf_count = sum(p.numel() for p in DeepseekV32ForCausalLM(config.to_hf_config()).parameters())
    specs = deepseek_v32.layer_specs(config, seed=0)
    rows = stage_parameter_counts(specs, stages=16, schedule="dualpipev", partition_method=deepseek_v32.DEFAULT_PARTITION)
    indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert rows[0]["unique_total"] == hf_count == 671_026_404_352 + 61 * indexer == 671_877_929_216
    mtp = deepseek_v32.make_config("deepseek-v3.2", {"num_mtp_layers": 1})
    mtp_specs = deepseek_v32.layer_specs(mtp, seed=0)
    with_mtp = sum(count_parameters(s) for i, s in enumerate(mtp_specs) if getattr(s, "key", None) != "embed" or i == 0)
    checkpoint_total = with_mtp + 2 * 129280 * 7168          # the MTP layer's own embed_tokens and shared_head.head
    print(f"with the MTP module as the checkpoint stores it: {checkpoint_total:,}")
    assert abs(checkpoint_total - 685e9) < 0.5e9, checkpoint_total     # published to the nearest billion


def test_mtp_and_document_attention(monkeypatch):
    """The MTP module's block is a DSA block whose indexer learns too; with
    document-bounded attention every selected key lies in the query's document."""
    from recipes.layers.pipe import CausalLMLoss, document_mask
    config = deepseek_v32.make_config("tiny", {"num_mtp_layers": 1})
    model = SequentialReference(deepseek_v32.layer_specs(config, seed=9, indexer_kl_weight=1.0)).train()
    ids = _ids(config, 9, seq=40)
    CausalLMLoss(0.3, mtp=True)(model(ids), _labels(ids)).backward()
    mtp = getattr(model, str(config.num_hidden_layers + 2))
    assert isinstance(mtp, dsa.DSAMTPLayerPipe)
    assert all(p.grad is not None for p in mtp.self_attn.indexer.parameters())
    assert sum(a.kl_count for _, a in dsa.attentions(model)) == config.num_hidden_layers + 1
    config = deepseek_v32.make_config("tiny")
    ids[:, 25] = 7                                   # documents of 26 and 14 tokens (more if 7 occurs)
    model = SequentialReference(deepseek_v32.layer_specs(config, seed=9, document_token=7)).eval()
    selections = _our_selections(monkeypatch)
    with torch.no_grad():
        model(ids)
    inside = document_mask(ids, 7)[:, 0]
    assert len(selections) == config.num_hidden_layers
    for chosen in selections:
        assert not (chosen & ~inside).any()
        assert (chosen.sum(-1) < inside.sum(-1)).any()       # long documents attend sparsely


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_cached_generation_equals_the_full_forward(preset):
    config = deepseek_v32.make_config(preset)
    model = SequentialReference(deepseek_v32.layer_specs(config, seed=11)).eval()
    decoder = dsa.DSADecoder(model, config)
    ids = _ids(config, 2, seq=30)
    expected = decoder.logits_without_cache(ids)
    cache = dsa.DSAKVCache(config, batch=2, max_tokens=30, dtype=torch.float32)
    got = torch.cat([decoder.forward_cached(ids[:, :17], cache)] +
                    [decoder.forward_cached(ids[:, t:t + 1], cache) for t in range(17, 30)], dim=1)
    assert (got - expected).abs().max().item() <= 1e-5


def test_greedy_tokens_equal_transformers_step_by_step():
    """fp64 (the indexer scores in fp32 in both, from the same fp64 inputs rounded, so
    the same keys), 7 prompt tokens and 20 new ones: beyond 16 tokens every step
    attends sparsely. Each step's cached logits equal transformers' full forward (to
    1e-5: the absorbed attention's softmax runs in fp32), and sparsity changes the
    tokens (the same weights keeping every key generate others)."""
    config = deepseek_v32.make_config("tiny")
    model = SequentialReference(deepseek_v32.layer_specs(config, seed=11)).double().eval()
    decoder = dsa.DSADecoder(model, config)
    hf = _hf(config).double().eval()
    copy_into_transformers(hf, model.state_dict(), config)
    prompt = _ids(config, 4, batch=1, seq=7)
    theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    ours = decoder.generate(prompt, max_new_tokens=20)
    assert torch.equal(ours, theirs)
    cache = dsa.DSAKVCache(config, batch=1, max_tokens=27, dtype=torch.float64)
    steps = [decoder.forward_cached(ours[:, :7], cache)[:, -1]] + \
        [decoder.forward_cached(ours[:, t:t + 1], cache)[:, -1] for t in range(7, 26)]
    with torch.no_grad():
        full = hf(input_ids=ours[:, :26]).logits[:, 6:]
    assert (torch.stack(steps, dim=1) - full).abs().max().item() <= 1e-5
    dense = SequentialReference(deepseek_v32.layer_specs(deepseek_v32.make_config("tiny", {"index_topk": 64}),
                                                         seed=11)).double().eval()
    assert not torch.equal(dsa.DSADecoder(dense, config).generate(prompt, max_new_tokens=20), ours)


def test_cache_holds_the_indexer_keys():
    for preset in ("tiny", "deepseek-v3.2"):
        config = deepseek_v32.make_config(preset)
        with torch.device("meta"):
            cache = dsa.DSAKVCache(config, batch=1, max_tokens=1, dtype=torch.bfloat16)
        per_layer = config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim
        assert cache.bytes_per_token() == config.num_hidden_layers * per_layer * 2


@pytest.mark.parametrize("preset,layer_idx,kind", [("tiny", 0, "dense"), ("tiny-moe", 1, "moe")])
@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_activation_bytes_against_autograd(preset, layer_idx, kind, stage):
    """Within 15 % of what autograd keeps (fp32, CPU math attention), as for V3's layers
    in test_plan."""
    config = deepseek_v32.make_config(preset)
    layer = dsa.DSADecoderLayerPipe(config, layer_idx=layer_idx, seed=0, dsa_stage=stage, indexer_kl_weight=1.0).train()
    if stage == "warmup":
        dsa.freeze_for_warmup(layer)
    measured = saved_bytes_per_token(layer, torch.randn(2, 64, config.hidden_size, requires_grad=True))
    model = deepseek_v32.activation_bytes(config, kind, seq_len=64, act_bytes=4, fused_attention=False,
                                          dsa_stage=stage)
    assert abs(model - measured) / measured < 0.15, (model, measured)


def test_attention_flops():
    from recipes.layers.costs import full_attention_flops
    config = deepseek_v32.make_config("deepseek-v3.2")
    c = config
    indexer = c.index_n_heads * (2 * c.index_head_dim + 2)
    for seq in (1024, 2048):        # every key kept: V3's attention plus the indexer
        assert deepseek_v32.attention_flops(config, "moe", seq_len=seq, dsa_stage=None) == \
            full_attention_flops(config, seq_len=seq) + seq / 2 * indexer
    # beyond index_topk the attention's share approaches 2048 keys per query
    long = deepseek_v32.attention_flops(config, "dense", seq_len=131072, dsa_stage=None) - 131072 / 2 * indexer
    assert long == pytest.approx((2048 - 2048 ** 2 / (2 * 131072)) * 2 * 128 * (192 + 128))
    assert deepseek_v32.attention_flops(config, "head", seq_len=4096) == 0.0


def test_layer_kinds():
    config = deepseek_v32.make_config("tiny-moe", {"num_mtp_layers": 1})
    kinds = deepseek_v32.SPEC.layer_kinds(deepseek_v32.layer_specs(config, seed=0), config)
    assert kinds == ["embed", "dense", "moe", "moe", "moe", "embed", "mtp-moe", "norm", "head"]


def test_config_errors():
    from ds_ext.errors import ConfigError
    with pytest.raises(ConfigError, match="rope_interleave"):
        deepseek_v32.make_config("tiny", {"rope_interleave": False})
    with pytest.raises(ConfigError, match="q_lora_rank"):
        deepseek_v32.make_config("tiny", {"q_lora_rank": None})
    with pytest.raises(ConfigError, match="index_head_dim"):
        deepseek_v32.make_config("tiny", {"index_head_dim": 8})
    config = deepseek_v32.make_config("tiny")
    with pytest.raises(ConfigError, match="warm-up"):
        deepseek_v32.layer_specs(config, seed=0, dsa_stage="warmup", indexer_kl_weight=0.0)
    with pytest.raises(ConfigError, match="unknown"):
        deepseek_v32.layer_specs(config, seed=0, dsa_stage="dense")
    hf = deepseek_v32.make_config("deepseek-v3.2").to_hf_config()
    assert (hf.index_topk, hf.index_n_heads, hf.index_head_dim, hf.q_lora_rank) == (2048, 64, 128, 1536)
    assert hf.mlp_layer_types[:4] == ["dense"] * 3 + ["sparse"]


GAS = 4


def _micro_batches(config):
    data = torch.randint(0, config.vocab_size, (GAS, 2, 33), generator=torch.Generator().manual_seed(8))
    return [(data[m, :, :-1], data[m, :, 1:]) for m in range(GAS)]


def _pipelined_step(stage, schedule, interval):
    """One DeepSpeed step of the tiny recipe on 2 pipeline ranks: the gradients its
    optimizer receives, which parameters the step moved, the indexer loss reported."""
    from ds_ext.pipe.engine import initialize
    config = deepseek_v32.make_config("tiny")
    model = deepseek_v32.build_pipeline(config, num_stages=2, schedule=schedule, seed=3, dsa_stage=stage,
                                        indexer_kl_weight=1.0, activation_checkpoint_interval=interval)
    dsa.configure_indexer(model, grad_scale=1.0 / GAS)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 10**6,
          "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine = initialize(model=model, config=ds, model_parameters=trainable, schedule=schedule)
    names = {id(p): n for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    captured, step = {}, engine.optimizer.step

    def capture(*args, **kwargs):
        for group in engine.optimizer.param_groups:
            for p in group["params"]:
                captured[names[id(p)]] = p.grad.detach().clone()
        return step(*args, **kwargs)

    engine.optimizer.step = capture
    engine.train_batch(iter(_micro_batches(config)))
    moved = sorted(n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n]))
    return captured, moved, dsa.take_indexer_loss(model)


@pytest.mark.multirank
@pytest.mark.parametrize("stage,schedule,interval", [("warmup", "1f1b", 1), ("sparse", "dualpipev-zb", 1)])
def test_pipelined_step_equals_the_single_process_gradients(stage, schedule, interval):
    """DeepSpeed's 1F1B with activation checkpointing in the warm-up (the first stage's
    frozen embedding output feeds a checkpointed layer), and zero-bubble DualPipeV in the
    sparse stage (indexer weight gradients in W slots): the optimizer receives the
    single-process gradients (each micro-batch's by the same operations; 1F1B adds them
    in micro-batch order, bitwise; DualPipeV in its own, within the bound of a sum of 4
    terms in any order, tests/numerics.py), only the indexers move in the warm-up, and
    L_I is reported once per layer and micro-batch."""
    from tests.distributed import compute_threads, run_ranks
    config = deepseek_v32.make_config("tiny")
    reference = SequentialReference(deepseek_v32.layer_specs(config, seed=3, dsa_stage=stage,
                                                             indexer_kl_weight=1.0)).train()
    dsa.configure_indexer(reference, grad_scale=1.0 / GAS)
    if stage == "warmup":
        dsa.freeze_for_warmup(reference)
    threads = torch.get_num_threads()
    torch.set_num_threads(compute_threads())         # the ranks' kernels, so the ranks' reduction order
    terms = []                                       # each micro-batch's gradient (of loss / GAS: exact)
    try:
        for x, y in _micro_batches(config):
            reference.zero_grad(set_to_none=True)
            (reference.loss_fn(reference(x), y) / GAS).backward()
            terms.append({n: p.grad for n, p in reference.named_parameters() if p.requires_grad})
    finally:
        torch.set_num_threads(threads)
    expected_loss = dsa.take_indexer_loss(reference)
    results = run_ranks(_pipelined_step, world_size=2, args=(stage, schedule, interval), timeout=300)
    captured = {}
    for grads, moved, _ in results:
        captured.update(grads)
        if stage == "warmup":
            assert moved and all(".indexer." in n for n in moved)
    assert set(captured) == set(terms[0])
    for name in terms[0]:
        if schedule == "1f1b":              # micro-batches accumulated in order, as autograd adds them
            in_order = terms[0][name]
            for t in terms[1:]:
                in_order = in_order + t[name]
            assert torch.equal(torch.as_tensor(captured[name]), in_order), name
        else:                               # DualPipeV's order of micro-batches (and W slots)
            assert_sum_close(captured[name], [t[name].numpy() for t in terms], what=name)
    assert sum(loss for _, _, loss in results) == pytest.approx(expected_loss, rel=1e-6)


# ---- through the trainer, with expert parallelism -------------------------------------

def _ep_config(tmp_path, schedule, stage):
    import json
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "ds_configs", "tiny_v32_moe_cpu.json")) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=4)
    cfg.pop("scheduler")            # a constant learning rate: both steps move what trains
    s = cfg["seekspeed"]
    s.update(schedule=schedule, dsa={"stage": stage})
    s["moe"].update(expert_parallel_size=2, bias_update_speed=0.0 if stage == "warmup" else 0.01)
    s["data"]["seq_len"] = 64
    s["checkpoint"]["interval_steps"] = 0
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    return str(path), s["train"]["seed"]


# 1f1b and dualpipev-zb also train in tests/test_recipes.py (2 ranks, no expert parallelism);
# every schedule with expert parallelism in both stages: benchmarks/deepseek_v32_schedules.py
@pytest.mark.multirank
@pytest.mark.parametrize("schedule,stage", [("1f1b", "warmup")])
def test_trains_with_expert_parallelism(schedule, stage, tmp_path):
    """4 ranks (2 stages x 2 replicas, expert parallelism 2), tiny-moe, 2 steps through
    launch/train.py's main: the indexer loss is reported apart, and the warm-up changes
    the indexers' weights only (every other tensor as initialised, bitwise)."""
    import json
    from ds_ext.hf_io import load_checkpoint_model
    from tests.distributed import run_ranks
    from tests.training import trainer_rank
    cfg, seed = _ep_config(tmp_path, schedule, stage)
    ckpt, summary = tmp_path / "ckpt", tmp_path / "summary.json"
    res = run_ranks(trainer_rank, world_size=4, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "2", "--checkpoint-dir", str(ckpt),
                           "--summary-json", str(summary)],))
    assert [r[0] for r in res] == [0] * 4, res
    out = json.loads(summary.read_text())
    assert out["layer_losses"]["indexer"] > 0 and "| indexer " in res[0][1], res[0][1][-2000:]
    assert all(0 < x < 20 for x in out["losses"]), out["losses"]
    if stage != "warmup":
        return
    config, trained, _ = load_checkpoint_model(str(ckpt))
    initial = SequentialReference(deepseek_v32.layer_specs(config, seed=seed)).state_dict()
    for name, value in trained.state_dict().items():
        same = torch.equal(value, initial[name])
        assert same != dsa.is_indexer_parameter(name), name
