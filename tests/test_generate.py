"""Generation with the latent KV cache: cached (absorbed) logits equal the model's
own forward; greedy tokens equal decoding without a cache and transformers'
generate with the same weights; the cache holds kv_lora_rank + qk_rope_head_dim
values per token and layer; launch/generate.py runs from a transformers directory.
Single process; about 15 s."""

import os
import subprocess
import sys

import pytest
import torch

from recipes import deepseek_v3
from recipes.layers.latent_kv import LatentKVCache, MLADecoder, full_kv_bytes_per_token
from recipes.layers.reference import SequentialReference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
CASES = {
    "moe": ("tiny-moe", {}),
    "plain-q+rotate-half+tied": ("tiny", {"q_lora_rank": None, "rope_interleave": False,
                                          "tie_word_embeddings": True}),
    "yarn+mtp": ("tiny-moe", {"rope_parameters": YARN, "num_mtp_layers": 1}),
}


def _decoder(preset, overrides, dtype=torch.float32):
    config = deepseek_v3.make_config(preset, overrides)
    model = SequentialReference(deepseek_v3.layer_specs(config, seed=11)).to(dtype).eval()
    for name, buf in model.named_buffers():   # make the routing bias matter
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    return config, model, MLADecoder(model, config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_logits_equal_the_full_forward(case):
    config, _, decoder = _decoder(*CASES[case])
    ids = torch.randint(0, config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    expected = decoder.logits_without_cache(ids)
    cache = LatentKVCache(config, batch=2, max_tokens=30, dtype=torch.float32)
    got = torch.cat([decoder.forward_cached(ids[:, :17], cache)] +
                    [decoder.forward_cached(ids[:, t:t + 1], cache) for t in range(17, 30)], dim=1)
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_decoding_without_a_cache(case):
    _, _, decoder = _decoder(*CASES[case], dtype=torch.float64)
    prompt = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(3))
    cached = decoder.generate(prompt, max_new_tokens=24)
    assert torch.equal(cached, decoder.generate(prompt, max_new_tokens=24, use_cache=False))
    assert not torch.equal(cached[:, 9:], cached[:, 9:10].expand(-1, 24))     # not one token repeated


def test_greedy_tokens_equal_transformers_generate():
    from transformers import DeepseekV3ForCausalLM
    from recipes.layers.hf import copy_into_transformers
    config, model, decoder = _decoder("tiny-moe", {})   # fp32: transformers' grouped expert GEMM has no fp64
    hf = DeepseekV3ForCausalLM(config.to_hf_config()).eval()
    copy_into_transformers(hf, model.state_dict(), config)
    prompt = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(4))
    theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=20), theirs)


def test_cache_size_per_token():
    for preset in ("tiny", "deepseek-v2-lite", "deepseek-v3"):
        config = deepseek_v3.make_config(preset)
        with torch.device("meta"):
            cache = LatentKVCache(config, batch=1, max_tokens=1, dtype=torch.bfloat16)
        assert cache.bytes_per_token() == config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    v3 = deepseek_v3.make_config("deepseek-v3")   # DeepSeek-V2 paper: 576 vs 128 heads x (192 + 128) per layer
    assert full_kv_bytes_per_token(v3) / (61 * 576 * 2) == pytest.approx(128 * 320 / 576)


def test_generate_cli_from_a_transformers_directory(tmp_path):
    from transformers import DeepseekV3ForCausalLM
    from recipes.layers.hf import copy_into_transformers
    config, model, _ = _decoder("tiny", {})
    hf = DeepseekV3ForCausalLM(config.to_hf_config())
    copy_into_transformers(hf, model.state_dict(), config)
    hf.save_pretrained(str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "generate.py"), "--hf", str(tmp_path / "hf"),
                           "--prompt", "def f(", "--max-new-tokens", "12"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("def f(") and "latent KV cache" in proc.stderr
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "generate.py"), "--checkpoint",
                          str(tmp_path), "--prompt", "x"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: ")
