"""DeepSeek-V4 at long context, from the recipes' own planner arithmetic (no run):

- decode cache bytes per token at 4K, 64K and 1M tokens of context, bf16 entries, against
  DeepSeek-V3's latent cache (kv_lora_rank + qk_rope_head_dim per token and layer) and
  DeepSeek-V3.2's (the same plus the indexer's key). V4 per layer, following
  transformers' DeepseekV4 cache layers: the sliding window (min(T, sliding_window)
  entries of head_dim, one tensor since K = V); HCA: one entry of head_dim per 128
  tokens, and the not-yet-compressed tail (T mod 128 tokens of kv and gate logits);
  CSA: one entry per 4 tokens, the indexer's key per entry, the tails of both
  compressors (2 x head_dim features a token: the overlapping series) and their
  overlap state (the last window's first series, kv and gate); the count is
  recipes/layers/v4_cache.py's ``cache_elements``, which the decoder's cache is tested
  to hold;
- forward FLOPs of one decoded token at position 1M: attention (each recipe's
  ``attention_flops``, the planner's figure, made marginal: d/dT of T x its average over
  positions 0..T, inference, no indexer-training target) and weight matmuls
  (2 x the activated parameters, which leave out the embedding lookup), V4-Flash and V4-Pro against
  DeepSeek-V3.2 (published: V4-Flash about 10 %, V4-Pro about 27 % of V3.2's
  single-token FLOPs at 1M).

    python benchmarks/deepseek_v4_long_context.py --json benchmarks/results/deepseek_v4_long_context.json
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import write_figures
from recipes import get_recipe
from recipes.layers import v4_cache

CONTEXTS = (4096, 65536, 1048576)
MODELS = (("deepseek_v3", "deepseek-v3"), ("deepseek_v32", "deepseek-v3.2"),
          ("deepseek_v4", "deepseek-v4-flash"), ("deepseek_v4", "deepseek-v4-pro"))
BYTES = 2                          # bf16 cache entries


def cache_elements(recipe, config, context):
    """Cache elements (all layers) after ``context`` tokens."""
    c, t = config, context
    if recipe == "deepseek_v3":
        return c.num_hidden_layers * t * (c.kv_lora_rank + c.qk_rope_head_dim)
    if recipe == "deepseek_v32":
        return c.num_hidden_layers * t * (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim)
    return v4_cache.cache_elements(c, t)


def attention_flops_at(spec, config, specs, position):
    """Attention FLOPs of the token at ``position`` (d/dT of T x the average)."""
    def summed(t):
        return sum(spec.planner.attention_flops(config, spec.planner.layer_kind(s, config), seq_len=t, dsa_stage=None)
                   for s in specs)
    step = 1024
    return ((position + step) * summed(position + step) - position * summed(position)) / step


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    rows = []
    for recipe, preset in MODELS:
        spec = get_recipe(recipe)
        config = spec.make_config(preset)
        specs = spec.layer_specs(config, seed=0)
        row = {"model": preset}
        for t in CONTEXTS:
            row[f"cache_bytes_per_token_{t}"] = cache_elements(recipe, config, t) * BYTES / t
        activated = spec.activated_parameters(specs)
        row["activated_params"] = activated
        row["matmul_flops_per_token"] = 2 * activated
        row["attention_flops_per_token_1m"] = attention_flops_at(spec, config, specs, CONTEXTS[-1])
        row["flops_per_token_1m"] = row["matmul_flops_per_token"] + row["attention_flops_per_token_1m"]
        rows.append(row)
        print(f"{preset}: done", flush=True)
    by = {r["model"]: r for r in rows}
    for r in rows:
        for t in CONTEXTS:
            r[f"cache_vs_v3_{t}"] = r[f"cache_bytes_per_token_{t}"] / by["deepseek-v3"][f"cache_bytes_per_token_{t}"]
        r["attention_flops_vs_v32_1m"] = r["attention_flops_per_token_1m"] / by["deepseek-v3.2"]["attention_flops_per_token_1m"]
        r["flops_vs_v32_1m"] = r["flops_per_token_1m"] / by["deepseek-v3.2"]["flops_per_token_1m"]
    print("cache bytes per token of context (bf16), and against DeepSeek-V3's latent cache")
    print(f"{'model':<20}" + "".join(f"{f'{t // 1024}K':>22}" for t in CONTEXTS))
    for r in rows:
        print(f"{r['model']:<20}" + "".join(f"{r[f'cache_bytes_per_token_{t}']:>13,.0f} ({r[f'cache_vs_v3_{t}']:.3f}x)"
                                           for t in CONTEXTS))
    print("\nforward FLOPs of one token decoded at position 1M, against DeepSeek-V3.2")
    print(f"{'model':<20} {'attention':>12} {'vs V3.2':>8} {'matmuls':>12} {'total':>12} {'vs V3.2':>8}")
    for r in rows[1:]:
        print(f"{r['model']:<20} {r['attention_flops_per_token_1m'] / 1e9:>10.2f} G {r['attention_flops_vs_v32_1m']:>8.3f} "
              f"{r['matmul_flops_per_token'] / 1e9:>10.2f} G {r['flops_per_token_1m'] / 1e9:>10.2f} G "
              f"{r['flops_vs_v32_1m']:>8.3f}")
    write_figures(args.json, {"contexts": list(CONTEXTS), "cache_bytes_per_entry": BYTES,
                              "published_flops_vs_v32_1m": {"deepseek-v4-flash": 0.10, "deepseek-v4-pro": 0.27},
                              "rows": rows})


if __name__ == "__main__":
    main()
