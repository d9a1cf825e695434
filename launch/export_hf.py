"""Export a seekspeed (DeepSpeed pipeline) checkpoint of either checkpoint engine (deepspeed,
async-zstd) to the transformers format.

    python launch/export_hf.py --checkpoint runs/tiny/checkpoints --out exported/tiny
    python launch/export_hf.py --checkpoint DIR --tag global_step200 --out HF_DIR --dtype bf16

The result loads offline with AutoModelForCausalLM.from_pretrained(HF_DIR).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_ext.errors import SeekspeedError
from ds_ext.hf_io import export_hf


def _size(text):
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (the one holding 'latest')")
    p.add_argument("--tag", help="checkpoint tag, default: the one 'latest' names")
    p.add_argument("--out", required=True, help="new directory for config.json and safetensors shards")
    p.add_argument("--max-shard-size", default="2GB", help="largest shard, e.g. 500MB, 5GB (default 2GB)")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="cast weights (default: as saved)")
    args = p.parse_args(argv)
    try:
        result = export_hf(args.checkpoint, args.out, tag=args.tag, max_shard_bytes=_size(args.max_shard_size),
                           dtype=args.dtype)
    except SeekspeedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {result['tag_dir']} -> {result['out']}: {len(result['files'])} file(s), "
          f"{result['bytes'] / 2**20:,.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
