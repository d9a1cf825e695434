"""The DeepSeek-V4 recipe against transformers' DeepseekV4ForCausalLM, and its own
training pieces.

- Parity (fp32; the tiny preset with YaRN on the compressed layers; 2 x 256 tokens, so
  HCA emits 2 entries per row and CSA 64, of which the indexer keeps 16; hash and score
  routed layers; the parameters transformers initialises to 0 or 1 randomised): every
  layer's compressed entries, the indexer's scores and its selected entries equal
  transformers', bitwise (the same operations in the same order, one intra-op thread;
  transformers' ``topk`` given the recipe's rule for ties, the earliest entry, since
  torch.topk leaves it to the row's length; the ties present are counted), logits and
  loss within 1e-5, and every gradient transformers computes within the derived bound
  below.
- Generation with V4's cache: every step's logits equal the full forward's within 1e-5,
  the cache holds what the long-context arithmetic prices, and greedy tokens equal
  transformers' generate with its own cache (the same tie rule) and decoding without one.
- The indexer learns from its KL loss only: the main model's gradients do not change
  with the KL weight, the indexer's are non-zero; in the dense warm-up only the indexers
  have gradients.
- The hash table: a seeded balanced assignment (distinct experts per token, every
  expert within one slot of an equal share), a persistent buffer; a table naming an
  expert outside the model is refused on load.
- Parameter counts of the published shapes (meta device) equal transformers' for the
  same config; config errors; config_from_hf reads transformers' own and legacy forms.
- DeepSpeed's Muon: which matrices go to Newton-Schulz; on the CPU accelerator its
  update runs eagerly, compiling nothing.
Single process; about 30 s.
"""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from ds_ext.errors import ConfigError
from recipes import deepseek_v4
from recipes.layers import hybrid_attention as ha
from recipes.layers.hf import copy_into_transformers, to_hf_state_dict
from recipes.layers.reference import SequentialReference

SEQ = 256
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
        "beta_slow": 1.0}


def _config(**overrides):
    return deepseek_v4.make_config("tiny", {"rope_parameters": YARN, **overrides})


def _model(config, *, seed=1, **options):
    model = SequentialReference(deepseek_v4.layer_specs(config, seed=seed, **options))
    with torch.no_grad():        # make the parameters transformers starts at 0 or 1 matter
        g = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if any(k in name for k in ("position_bias", "sinks", ".base", "hc_base", "scale")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def _hf(config, model):
    hf = deepseek_v4.SPEC.hf.model(config).float()
    copy_into_transformers(hf, model.state_dict(), config)
    return hf


def _ids(config, seed=1, seq=SEQ + 1):
    return torch.randint(0, config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seed))


def _record(modules, names):
    """Forward outputs of the modules whose class name is in ``names``, in call order."""
    got = []
    hooks = [m.register_forward_hook(lambda mod, args, out: got.append((type(mod).__name__, out)))
             for m in modules if type(m).__name__ in names]
    return got, hooks


def _grads(model, config):
    return to_hf_state_dict({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, config)


@contextlib.contextmanager
def _first_topk(monkeypatch):
    """transformers' topk calls with the recipe's rule for ties (the earliest index);
    without ties it is torch.topk's result."""
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "topk", lambda t, k, dim=-1, largest=True, sorted=True:
                  ha.first_topk(t, k, dim, largest, sorted))
        yield


@pytest.fixture
def one_thread():
    """One intra-op thread: with more, a GEMM's reduction blocking follows its shape and
    the thread split, and transformers' projections (other shapes than ours) would round
    differently; with one, the same operations give the same bits on any CPU count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_entries_selection_logits_loss_and_gradients_match_transformers(monkeypatch, one_thread):
    config = _config()
    ours = _model(config).train()
    hf = _hf(config, ours).train()
    ids = _ids(config)
    x, y = ids[:, :-1], ids[:, 1:]

    theirs, hooks = _record(hf.modules(), {"DeepseekV4HCACompressor", "DeepseekV4CSACompressor",
                                           "DeepseekV4IndexerScorer", "DeepseekV4Indexer"})
    with _first_topk(monkeypatch):
        logits_hf = hf(x).logits
    for h in hooks:
        h.remove()
    loss_hf = F.cross_entropy(logits_hf.reshape(-1, logits_hf.shape[-1]), y.reshape(-1))
    loss_hf.backward()

    mine, hooks = _record(ours.modules(), {"HeavyCompressor", "SparseCompressor", "IndexerScorer"})
    logits = ours(x)
    for h in hooks:
        h.remove()
    loss = ours.loss_fn(logits, y)
    loss.backward()

    assert (logits - logits_hf).abs().max().item() <= 1e-5 and abs(loss.item() - loss_hf.item()) <= 1e-5
    # entries: HCA 2 a row, CSA 64 (the same tensors, bitwise)
    their_entries = [out[0] for name, out in theirs if name.endswith("Compressor")]
    my_entries = [out[0] for name, out in mine if name.endswith("Compressor")]
    assert [e.shape[2] for e in my_entries] == [SEQ // 4, SEQ // 128, SEQ // 4]
    for a, b in zip(my_entries, their_entries, strict=True):
        assert torch.equal(a, b)
    # the indexer's scores, then its picks: transformers' picks (-1: not visible) against the
    # entries each query attends here (bias 0)
    their_scores = [out for name, out in theirs if name == "DeepseekV4IndexerScorer"]
    my_scores = [out for name, out in mine if name == "IndexerScorer"]
    their_picks = [out for name, out in theirs if name == "DeepseekV4Indexer"]
    my_bias = [out[1] for name, out in mine if name == "SparseCompressor"]
    ties = 0
    for scores_a, scores_b, picks, bias in zip(my_scores, their_scores, their_picks, my_bias, strict=True):
        assert torch.equal(scores_a, scores_b)
        windows = bias.shape[-1]
        safe = torch.where(picks >= 0, picks, torch.full_like(picks, windows))
        expected = torch.zeros(picks.shape[:-1] + (windows + 1,), dtype=torch.bool).scatter_(-1, safe, True)
        assert torch.equal(bias[:, 0] == 0, expected[..., :windows])
        kept = expected[..., :windows].sum(-1)
        assert (kept == config.index_topk).any() and (kept < torch.arange(1, SEQ + 1) // 4).any()  # sparsity matters
        visible = torch.arange(windows) < ((torch.arange(SEQ) + 1) // 4).unsqueeze(-1)
        kth = scores_a.masked_fill(~visible, float("-inf")).topk(config.index_topk, dim=-1).values[..., -1:]
        ties += int(((scores_a == kth) & visible).sum(-1).gt(1).sum())
    print(f"index-score ties at the top-k boundary: {ties} queries")
    # gradients: ours and transformers' run the same products, the weight gradients of the
    # projections (ds_ext.pipe.zero_bubble.linear: grad^T @ x) in another association than
    # autograd's mm over the 512 tokens; each sum of n = 512 products is within gamma(512) =
    # 512 x 2^-24 = 3.1e-5 of its exact value relative to sum |terms| <= n max|term|, and the
    # upstream gradients carry the same relative error: 1e-4 of each tensor's largest entry.
    got = _grads(ours, config)
    compared = 0
    for name, p in hf.named_parameters():
        if p.grad is None:
            assert ".indexer." in name, name                    # transformers' indexer has no gradient
            continue
        assert (got[name] - p.grad).abs().max() <= 1e-4 * p.grad.abs().max(), name
        compared += 1
    assert compared == sum(1 for _, p in hf.named_parameters() if p.grad is not None) > 90


def test_indexer_learns_from_its_kl_only():
    config = _config()
    ids = _ids(config)
    x, y = ids[:, :-1], ids[:, 1:]
    grads = {}
    for weight in (0.0, 1.0):
        model = _model(config, indexer_kl_weight=weight).train()
        model.loss_fn(model(x), y).backward()
        grads[weight] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    main = [n for n in grads[1.0] if ".indexer." not in n]
    for n in main:
        assert torch.equal(grads[0.0][n], grads[1.0][n]), n
    indexer = [n for n in grads[1.0] if ".indexer." in n]
    assert len(indexer) == 2 * 6 and not any(".indexer." in n for n in grads[0.0])  # 2 CSA layers x 6 tensors
    assert all(grads[1.0][n].abs().max() > 0 for n in indexer)


def test_warmup_trains_only_the_indexers():
    config = _config()
    ids = _ids(config)
    module = SequentialReference(deepseek_v4.layer_specs(config, seed=1, dsa_stage="warmup"))
    from recipes.layers.dsa import freeze_for_warmup
    freeze_for_warmup(module)
    module.train()
    module.loss_fn(module(ids[:, :-1]), ids[:, 1:]).backward()
    with_grad = {n for n, p in module.named_parameters() if p.grad is not None}
    assert with_grad and all(".indexer." in n for n in with_grad)
    assert len(with_grad) == 2 * 6


def test_hash_table_is_a_seeded_balanced_assignment():
    config = _config()
    model = _model(config)
    layer = getattr(model, "1")                           # decoder layer 0: hash-routed in tiny
    table = layer.mlp.gate.tid2eid
    k, experts, vocab = config.num_experts_per_tok, config.n_routed_experts, config.vocab_size
    assert table.shape == (vocab, k)
    assert all(len(set(row.tolist())) == k for row in table)                 # distinct experts per token
    counts = torch.bincount(table.flatten(), minlength=experts)
    assert counts.max() - counts.min() <= 1 and counts.sum() == vocab * k
    again = getattr(_model(config), "1").mlp.gate.tid2eid
    other = getattr(_model(config, seed=2), "1").mlp.gate.tid2eid
    assert torch.equal(table, again) and not torch.equal(table, other)
    key = next(n for n in model.state_dict() if n.endswith("tid2eid"))
    bad = dict(model.state_dict())
    bad[key] = bad[key].clone().fill_(experts)
    with pytest.raises(ConfigError, match=r"tid2eid names experts 8\.\.8, outside the 8 of n_routed_experts"):
        model.load_state_dict(bad)
    from recipes.layers.moe import HashRouter
    with pytest.raises(ValueError, match="hash-routed MoE layer needs the token ids"):
        HashRouter(config)(torch.zeros(4, config.hidden_size))


@pytest.mark.parametrize("preset", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_published_parameter_counts_equal_transformers(preset):
    """On the meta device: the recipe's parameters (and persistent buffers: the hash
    tables) against transformers' model of to_hf_config(); the published totals (Flash 284
    B, Pro 1.6 T, both counting their MTP module, which neither builds) within 3 %."""
    from transformers import AutoModelForCausalLM
    config = deepseek_v4.make_config(preset)
    specs = deepseek_v4.layer_specs(config, seed=0)
    total = 0
    for spec in specs:
        with torch.device("meta"):
            module = spec.build()
        total += sum(p.numel() for p in module.parameters())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config.to_hf_config())
    assert total == sum(p.numel() for p in hf.parameters())
    published = {"deepseek-v4-flash": 284e9, "deepseek-v4-pro": 1.6e12}[preset]
    assert abs(total / published - 1) < 0.03, total
    activated = deepseek_v4.SPEC.activated_parameters(specs)
    print(f"{preset}: {total / 1e9:.1f} B parameters, {activated / 1e9:.1f} B activated per token")


def test_config_from_hf_reads_transformers_own_and_legacy_forms():
    config = _config()
    hf_config = config.to_hf_config()
    assert hf_config.layer_types == config.layer_types and hf_config.qk_rope_head_dim == 16
    back = deepseek_v4.SPEC.config_from_fields(deepseek_v4.config_from_hf(hf_config.to_dict()), where="hf")
    assert back == config
    legacy = dict(hf_config.to_dict(), layer_types=None, compress_ratios=[0, 4, 128, 4], mlp_layer_types=None,
                  num_hash_layers=1)
    assert deepseek_v4.SPEC.config_from_fields(deepseek_v4.config_from_hf(legacy), where="hf") == config
    with pytest.raises(ConfigError, match=r"compress_ratios has \[16\]: each entry must be 0 \(sliding window\), 4 "):
        deepseek_v4.config_from_hf(dict(legacy, compress_ratios=[0, 4, 16, 4]))


def test_config_errors():
    with pytest.raises(ConfigError, match=r"layer_types has 3 entries and num_hidden_layers is 4"):
        _config(layer_types=[ha.SLIDING, ha.CSA, ha.HCA])
    with pytest.raises(ConfigError, match=r"layer_types names \['global'\]"):
        _config(layer_types=[ha.SLIDING, ha.CSA, ha.HCA, "global"])
    with pytest.raises(ConfigError, match=r"mlp_layer_types must give one of"):
        _config(mlp_layer_types=["hash_moe"])
    with pytest.raises(ConfigError, match=r"num_mtp_layers 1: DeepSeek-V4's MTP module is not built"):
        _config(num_mtp_layers=1)
    with pytest.raises(ConfigError, match=r"document-bounded attention .* not built for DeepSeek-V4"):
        deepseek_v4.layer_specs(_config(), seed=0, document_token=0)


def test_attention_entries_per_query():
    """What a query at the end of a 1M-token row attends in each kind of layer (window +
    compressed entries), for the planner: Flash's 128-token window, HCA's 8,192 entries,
    CSA's 512 selected."""
    config = deepseek_v4.make_config("deepseek-v4-flash")
    seq = 2**20
    assert ha.attention_entries(config, ha.SLIDING, seq_len=seq) == 128
    assert ha.attention_entries(config, ha.HCA, seq_len=seq) == 128 + seq // 128
    assert ha.attention_entries(config, ha.CSA, seq_len=seq) == 128 + 512
    assert math.isclose(deepseek_v4._mean_keys(config, ha.SLIDING, seq_len=seq), 128 - 128 * 128 / (2 * seq))


def test_muon_update_runs_eagerly_on_the_cpu_accelerator(monkeypatch):
    """Compiled on the CPU accelerator, DeepSpeed's muon_update recompiles per matrix
    shape (14 frames for this preset's matrices) and its first step takes half a minute
    (benchmarks/muon_compile_cpu.py); ``seekspeed.muon_update`` "auto" runs it eagerly
    there: the same values as DeepSpeed's function run eagerly, bitwise, and no frame
    compiled; "compiled" gives DeepSpeed's function back. Set without Muon, the key is
    refused in one line."""
    import torch._dynamo.utils
    from deepspeed.runtime.zero.muon import original_muon
    from ds_ext.muon import check_muon_update, set_update
    from ds_ext.sections import SeekspeedSection, TrainSection
    monkeypatch.setattr(original_muon, "muon_update", original_muon.muon_update)    # restored afterwards
    compiled = original_muon.muon_update
    assert "eagerly" in set_update("auto") and "eagerly" in set_update("eager")
    assert original_muon.muon_update.__wrapped__ is compiled                          # wrapped once
    frames = dict(torch._dynamo.utils.counters["frames"])
    g = torch.Generator().manual_seed(0)
    for shape in ((8, 12), (12, 8), (16, 16)):
        grad, momentum = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        mine = momentum.clone()
        got = original_muon.muon_update(grad.clone(), mine, 0.95)
        with torch.compiler.set_stance("force_eager"):
            want = compiled(grad.clone(), momentum, 0.95)
        assert torch.equal(got, want) and torch.equal(mine, momentum)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames
    assert "compiled" in set_update("compiled") and original_muon.muon_update is compiled

    section = SeekspeedSection(train=TrainSection(steps=1), muon_update="eager")
    check_muon_update({"optimizer": {"type": "Muon"}}, section)
    with pytest.raises(ConfigError, match=r"seekspeed.muon_update 'eager' .* optimizer.type is 'AdamW': remove the "
                                          r"key or set optimizer.type Muon"):
        check_muon_update({"optimizer": {"type": "AdamW"}}, section)


def test_muon_split_sends_position_biases_to_the_auxiliary_adam_and_refuses_untagged():
    """DeepSpeed's Muon tags every matrix but the embedding and head for Newton-Schulz;
    the compressors' position biases (matrix-shaped, not linear maps) are marked
    ``muon_exempt`` by the layer and go to the auxiliary Adam; a parameter handed to the
    optimizer without a tag is refused in one line."""
    import deepspeed
    from ds_ext.muon import muon_split

    class _MuonConfig:
        optimizer_name, optimizer_params = "muon", {}

    model = SequentialReference(deepseek_v4.layer_specs(_config(), seed=0))
    deepspeed.set_optimizer_flags(_MuonConfig(), model)
    line = muon_split(model, list(model.parameters()))
    on_adam = {n for n, p in model.named_parameters() if not p.use_muon and p.dim() >= 2}
    assert {n.rsplit(".", 1)[-1] for n in on_adam} == {"position_bias", "weight"}
    assert all("position_bias" in n or "embed_tokens" in n or "lm_head" in n for n in on_adam), on_adam
    assert sum("position_bias" in n for n in on_adam) == 5       # tiny: 2 CSA (compressor, indexer), 1 HCA
    assert all(p.use_muon for n, p in model.named_parameters() if "attn_hc.fn" in n or "gate_up_proj" in n)
    assert "of them matrix-shaped" in line and "position_bias" in line
    stray = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ConfigError, match=r"optimizer.type Muon: 1 parameter\(s\) carry no use_muon tag "
                                          r"\(a \(3, 3\) tensor outside the model\); give the optimizer only"):
        muon_split(model, [{"params": list(model.parameters()) + [stray]}])


def _decoder(config, seed=1):
    from recipes.layers.v4_cache import V4Decoder
    model = _model(config, seed=seed).eval()
    return model, V4Decoder(model, config)


def test_cached_logits_equal_the_full_forward_and_the_cache_holds_what_the_arithmetic_prices():
    """Prefill 130 tokens (one HCA window and 32 CSA windows complete inside it), then one
    token at a time to 270 (the second HCA window completes at 256): every step's logits
    against the model's forward over the whole sequence; the cache's held values against
    ``cache_elements`` after each step."""
    from recipes.layers.v4_cache import V4Cache, cache_elements
    config = _config()
    _, decoder = _decoder(config)
    ids = _ids(config, seed=2, seq=270)
    expected = decoder.logits_without_cache(ids)
    cache = V4Cache(config, batch=2)
    got = [decoder.forward_cached(ids[:, :130], cache)]
    assert cache.elements() == cache_elements(config, 130)
    for t in range(130, 270):
        got.append(decoder.forward_cached(ids[:, t:t + 1], cache))
        assert cache.elements() == cache_elements(config, t + 1), t
    diff = (torch.cat(got, dim=1) - expected).abs().max().item()
    # the same fp32 operations on fewer rows (the projections' GEMMs blocked differently):
    # rounding only, as in the parity test against transformers (1e-5 on logits of order 1;
    # measured 7.5e-7 on Zen 4 with |logits| <= 1.13). Not derived term by term: it is the
    # parity test's bound, about 13x the measured figure
    assert diff <= 1e-5, diff


def test_greedy_tokens_equal_transformers_generate_with_its_cache(monkeypatch):
    """transformers' DeepseekV4ForCausalLM.generate (its own sliding-window, compressor,
    overlap and indexer cache) and the recipe's decoder, greedy, from a 250-token prompt
    through the HCA window boundary at 256 and 7 CSA windows; the indexer keeps 16 of
    the 62+ visible entries, so the selection decides."""
    config = _config()
    model, decoder = _decoder(config, seed=3)
    hf = _hf(config, model).eval()
    prompt = _ids(config, seed=4, seq=250)[:1]
    with _first_topk(monkeypatch):
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    ours = decoder.generate(prompt, max_new_tokens=30)
    assert torch.equal(ours, theirs), (ours[0, 250:], theirs[0, 250:])
    assert torch.equal(ours, decoder.generate(prompt, max_new_tokens=30, use_cache=False))
    assert len(set(ours[0, 250:].tolist())) > 1          # not one token repeated
