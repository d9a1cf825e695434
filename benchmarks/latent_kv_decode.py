"""Decoding with MLA's latent KV cache (absorbed weights) against transformers'
DeepseekV3ForCausalLM with its own cache, same weights, on CPU, batch 1, fp32.

Reports per model shape: cache bytes per token (ours: latent + rope key; an expanded
per-head K/V cache; what transformers' cache actually held after the run), and
decode tokens/s (prefill excluded; median of interleaved repeats).

    python benchmarks/latent_kv_decode.py --prompt 128 --new 32 --repeats 3 --json bench_out/latent_kv.json
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import machine_line, write_figures
from recipes import deepseek_v3
from recipes.layers.hf import copy_into_transformers
from recipes.layers.latent_kv import LatentKVCache, MLADecoder, full_kv_bytes_per_token
from recipes.layers.reference import SequentialReference

SHAPES = {
    "tiny-moe": ("tiny-moe", {}),
    # DeepSeek-V2-Lite's layer shapes (MLA with kv_lora_rank 512, 64 experts); two layers
    # (one dense, one MoE) so it fits a CPU laptop
    "v2-lite-layers": ("deepseek-v2-lite", {"num_hidden_layers": 2, "max_position_embeddings": 4096,
                                             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def _tensor_bytes(obj, seen):
    if torch.is_tensor(obj):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o, seen) for o in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(o, seen) for o in vars(obj).values())
    return 0


def _ours(decoder, config, prompt, new):
    cache = LatentKVCache(config, batch=1, max_tokens=prompt.shape[1] + new, dtype=torch.float32)
    logits = decoder.forward_cached(prompt, cache)
    t0 = time.perf_counter()
    for _ in range(new):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        logits = decoder.forward_cached(nxt, cache)
    return new / (time.perf_counter() - t0), cache.bytes_per_token() // 1


@torch.no_grad()
def _theirs(hf, prompt, new):
    out = hf(input_ids=prompt, use_cache=True)
    cache, logits = out.cache, out.logits
    t0 = time.perf_counter()
    for _ in range(new):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out = hf(input_ids=nxt, cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits
    rate = new / (time.perf_counter() - t0)
    return rate, _tensor_bytes(cache, set()) / (prompt.shape[1] + new)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new", type=int, default=32, help="decoded tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--json")
    args = p.parse_args()
    from transformers import DeepseekV3ForCausalLM
    torch.manual_seed(0)
    rows = {}
    for name in args.shapes:
        preset, overrides = SHAPES[name]
        config = deepseek_v3.make_config(preset, overrides)
        print(f"{name}: building ...", file=sys.stderr, flush=True)
        model = SequentialReference(deepseek_v3.layer_specs(config, seed=1)).eval()
        decoder = MLADecoder(model, config)
        hf = DeepseekV3ForCausalLM(config.to_hf_config()).eval()
        copy_into_transformers(hf, model.state_dict(), config)
        prompt = torch.randint(0, config.vocab_size, (1, args.prompt))
        ours, theirs = [], []
        for _ in range(args.repeats):
            rate, ours_bytes = _ours(decoder, config, prompt, args.new)
            ours.append(rate)
            rate, hf_bytes = _theirs(hf, prompt, args.new)
            theirs.append(rate)
        fp32 = 4
        rows[name] = {
            "cache_bytes_per_token_latent": ours_bytes,
            "cache_bytes_per_token_expanded_kv": full_kv_bytes_per_token(config, torch.float32),
            "cache_bytes_per_token_transformers": hf_bytes,
            "decode_tok_s_latent": statistics.median(ours),
            "decode_tok_s_transformers": statistics.median(theirs),
            "runs_latent": ours, "runs_transformers": theirs,
            "layers": config.num_hidden_layers, "dtype_bytes": fp32,
        }
    print(machine_line())
    print(f"\nbatch 1, fp32 CPU, prompt {args.prompt}, {args.new} decoded tokens, median of {args.repeats}")
    print(f"{'shape':<16} {'cache B/token: latent':>22} {'expanded K/V':>13} {'transformers':>13} "
          f"{'decode tok/s: latent':>21} {'transformers':>13} {'ratio':>6}")
    for name, r in rows.items():
        print(f"{name:<16} {r['cache_bytes_per_token_latent']:>22,} {r['cache_bytes_per_token_expanded_kv']:>13,} "
              f"{r['cache_bytes_per_token_transformers']:>13,.0f} {r['decode_tok_s_latent']:>21.1f} "
              f"{r['decode_tok_s_transformers']:>13.1f} {r['decode_tok_s_latent'] / r['decode_tok_s_transformers']:>5.2f}x")
    write_figures(args.json, {"prompt": args.prompt, "new": args.new, "repeats": args.repeats, "shapes": rows})


if __name__ == "__main__":
    main()
