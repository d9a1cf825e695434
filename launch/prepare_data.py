"""Build the tiered data pipeline's packed cache before a job, with progress output.

    python launch/prepare_data.py --deepspeed ds_configs/128node.json

Tokenises and packs every source of ``seekspeed.data`` (``pipeline: "tiered"``) into
``data.cache_dir`` exactly as rank 0 of a training job would, so the job finds it
ready instead of building it at start-up while the other ranks wait. A cache that
is already there and matches the settings is left as it is.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed", "--deepspeed_config", dest="config", required=True, metavar="JSON")
    args = p.parse_args(argv)
    from ds_ext.config import SECTION, SeekspeedSection, read_json
    from ds_ext.errors import SeekspeedError
    from ds_ext.schema import from_dict
    try:
        raw = read_json(args.config)
        section = from_dict(SeekspeedSection, (raw or {}).get(SECTION, {}), where=SECTION)
        data = section.data
        if data.pipeline != "tiered":
            raise SeekspeedError(f"{args.config}: seekspeed.data.pipeline is {data.pipeline!r}; only the \"tiered\" "
                                 f"pipeline has a packed cache to prepare")
        from recipes import get_recipe
        from ds_ext.data import load_tokenizer
        from ds_ext.data.sources import cache_dir, resolve_source
        from ds_ext.data.store import build_all
        recipe = get_recipe(section.recipe.name)
        model_config = recipe.make_config(section.recipe.preset, section.recipe.overrides)
        tokenizer = load_tokenizer(data.tokenizer, vocab_size=model_config.vocab_size)
        for source, _ in data.sources():
            resolve_source(source)
        root = data.cache_dir or str(cache_dir() / "packed")
        start = time.perf_counter()
        shards = build_all(data, tokenizer, root=root, rows_per_shard=data.rows_per_shard,
                           log=lambda m: print(m, flush=True))
    except SeekspeedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from ds_ext.data.textfiles import describe_undecodable
    for store in shards.stores:
        undecodable = describe_undecodable(store.index.get("replaced_documents", 0),
                                           store.index.get("skipped_documents", 0))
        print(f"ready: {store.root}: {store.num_rows:,} rows of {store.row_len} tokens in {len(store.shards)} shards "
              f"({store.index['documents']:,} documents{'; ' + undecodable if undecodable else ''})")
    print(f"done in {time.perf_counter() - start:.1f} s; training with this config finds the cache under {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
