"""deepspeed.init_distributed, plus a clean-up DeepSpeed 0.19.8 leaves undone on CPU.

DeepSpeed's CPU accelerator builds a shared-memory all-reduce op that creates one
69 MB POSIX shared-memory object per rank (``/dev/shm/deepspeed_allreduce_buffer_
<uid>_<master addr>_<master port>_<rank>``) and never unlinks it, so every run leaves
its ranks' buffers in /dev/shm (which is RAM): a day of test runs filled 12 GB here.
Once every rank has mapped every buffer (DeepSpeed's initialisation maps all of
them before it returns), each rank unlinks its own name; the mappings stay valid
until the processes exit, and nothing is left behind.
"""

import os


def _own_shm_buffer(rank):
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def init_distributed(dist_backend=None):
    """deepspeed.init_distributed(dist_backend) (the accelerator's backend by default),
    then release this rank's shared-memory buffer name."""
    import deepspeed
    import torch.distributed as tdist
    from deepspeed.accelerator import get_accelerator
    deepspeed.init_distributed(dist_backend=dist_backend or get_accelerator().communication_backend_name())
    path = _own_shm_buffer(tdist.get_rank())
    if path and os.path.exists(path):
        tdist.barrier()          # every rank has mapped every buffer
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
