"""Convert an async-zstd checkpoint to DeepSpeed's own torch.save layout (same file
names and contents, 'latest' written) in a new directory, for DeepSpeed's tools.

    python launch/convert_checkpoint.py --checkpoint runs/tiny --out runs/tiny-deepspeed
    python launch/convert_checkpoint.py --checkpoint DIR --tag global_step200 --out NEW_DIR
    python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state \\
        --input_folder runs/tiny-deepspeed/global_step300 --output_folder runs/tiny-universal

Every file is verified against the checkpoint's manifest (size, sha256) and read with
the restricted loader before anything is written; the result appears at --out only
when complete. What DeepSpeed's zero_to_fp32 and ds_to_universal do with it: docs/checkpoints.md.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_ext.checkpoint.convert import to_deepspeed
from ds_ext.errors import SeekspeedError


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (the one holding 'latest')")
    p.add_argument("--tag", default="latest", help="checkpoint tag, or 'latest' (default) for the one 'latest' names")
    p.add_argument("--out", required=True, help="new (or empty) directory for the converted checkpoint")
    args = p.parse_args(argv)
    try:
        result = to_deepspeed(args.checkpoint, args.out, tag=args.tag, log=lambda line: print(line, flush=True))
    except SeekspeedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"converted {os.path.join(args.checkpoint, result['tag'])} -> {os.path.join(result['out'], result['tag'])}: "
          f"{result['files']} files, {result['source_bytes'] / 2**20:,.1f} MiB -> {result['bytes'] / 2**20:,.1f} MiB; "
          f"'latest' names {result['tag']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
