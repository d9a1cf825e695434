"""Build every compiled op a seekspeed run can load, once per environment, into the
environment's build directory (ds_ext/ops.py): DeepSpeed's (FusedAdam; on CPU its shared
memory all-reduce) and seekspeed's own kernels (ds_ext/comm/kernels.py). A kernel that
does not build is named; runs then use torch ops for it.

    python launch/build_ops.py          # launch/setup_env.sh runs it
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the ops of every shipped config on this accelerator
SETUP_OPS = ("FusedAdamBuilder",)


def main(argv=None):
    import argparse
    p = argparse.ArgumentParser(description="Build the compiled ops seekspeed runs load (DeepSpeed's and "
                                            "seekspeed's kernels), once per environment.")
    p.parse_args(argv)
    from ds_ext.ops import _stderr, load_deepspeed_ops, run_ops, use_environment_root
    root = use_environment_root()
    from ds_ext.comm import kernels
    load_deepspeed_ops(run_ops(SETUP_OPS), log=_stderr)
    for stem in kernels.build_all():
        _stderr(f"ops: seekspeed's {stem} kernel did not build ({kernels.build_error(stem)}); runs use torch ops "
                f"for it instead")
    _stderr(f"ops: built in {root or 'torch default (~/.cache/torch_extensions)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
