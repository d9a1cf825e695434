"""Imported once by the forkserver the test ranks fork from (tests/distributed.py PRELOAD):
loads DeepSpeed's CPU FusedAdam op, which every engine the tests build constructs, and its
shared-memory all-reduce, which every DeepSpeed process group on the CPU starts. Loading
a JIT op that is already built still costs about 2.5 s per process (the build-environment
checks and the import), which each forked rank would otherwise pay again; a forked rank
finds the module in DeepSpeed's loaded-op table. The first suite run on a clean cache
builds the ops here, once (under ds_ext.ops.build_guard, in the environment's build
directory). A failure is left for the ranks to raise with their own traceback: an
exception here would take the forkserver down with nothing said."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

try:
    from ds_ext.ops import load_deepspeed_ops, use_environment_root
    use_environment_root()
    load_deepspeed_ops(["ShareMemCommBuilder", "FusedAdamBuilder"])
except Exception:   # the ranks load it again and report what fails
    pass
