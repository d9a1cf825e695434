"""Sample from a seekspeed checkpoint or a transformers directory with the recipe's
decoder (its spec's ``decoder``). DeepSeek-V3 and V3.2: MLA's latent KV cache, absorbed
weights; per token and layer only kv_lora_rank + qk_rope_head_dim values are cached
(V3.2: plus the indexer's key). DeepSeek-V4: the sliding window, the compressed entries,
the compressors' tails and overlap state, the indexer's keys (recipes/layers/v4_cache.py).
A transformers directory's recipe is found by its config.json model_type.

    python launch/generate.py --checkpoint runs/tiny/checkpoints --prompt "def main(" --max-new-tokens 80
    python launch/generate.py --hf exported/tiny --tokenizer byte --prompt "import " --temperature 0.8 --top-k 40
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="seekspeed checkpoint directory (holding 'latest')")
    src.add_argument("--hf", help="transformers-format directory (config.json + safetensors)")
    p.add_argument("--tag", help="checkpoint tag (default: latest)")
    p.add_argument("--tokenizer", help="'byte' or a local tokenizer directory (default: the checkpoint's)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (for comparison)")
    args = p.parse_args(argv)

    import torch
    from ds_ext.data import load_tokenizer
    from ds_ext.errors import SeekspeedError
    from ds_ext.errors import ConfigError
    from ds_ext.hf_io import load_checkpoint_model, load_hf_model
    from recipes import spec_for
    try:
        if args.checkpoint:
            config, model, meta = load_checkpoint_model(args.checkpoint, tag=args.tag)
            recipe = spec_for(config)
            tokenizer_spec = args.tokenizer or meta.get("tokenizer", "byte")
        else:
            recipe, config, model = load_hf_model(args.hf)
            tokenizer_spec = args.tokenizer or "byte"
        if recipe.decoder is None:
            raise ConfigError(f"recipe {recipe.name} has no generator (its spec's decoder is None)")
        tokenizer = load_tokenizer(tokenizer_spec, vocab_size=config.vocab_size)
    except SeekspeedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    decoder = recipe.decoder(model, config)
    ids = torch.tensor([tokenizer.encode_documents([args.prompt])[0][:-1]])
    t0 = time.perf_counter()
    out = decoder.generate(ids, max_new_tokens=args.max_new_tokens, use_cache=not args.no_cache,
                           temperature=args.temperature, top_k=args.top_k,
                           generator=torch.Generator().manual_seed(args.seed))
    elapsed = time.perf_counter() - t0
    print(tokenizer.decode(out[0].tolist()))
    print(f"[{args.max_new_tokens} tokens in {elapsed:.2f}s, {args.max_new_tokens / elapsed:.1f} tok/s, "
          f"{'no cache' if args.no_cache else decoder.cache_name}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
