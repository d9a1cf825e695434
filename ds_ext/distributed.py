"""deepspeed.init_distributed, plus a clean-up DeepSpeed 0.19.8 leaves undone on CPU;
and ``free_port`` for the master port of a run on one machine.

DeepSpeed's CPU accelerator builds a shared-memory all-reduce op that creates one
69 MB POSIX shared-memory object per rank (``/dev/shm/deepspeed_allreduce_buffer_
<uid>_<master addr>_<master port>_<rank>``) and never unlinks it, so every run leaves
its ranks' buffers in /dev/shm (which is RAM): a day of test runs filled 12 GB here.
Once every rank has mapped every buffer (DeepSpeed's initialisation maps all of
them before it returns), each rank unlinks its own name; the mappings stay valid
until the processes exit, and nothing is left behind.
"""

import os
import socket


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel picks it), for a
    MASTER_PORT or a launcher's --master_port. Another process may still take it
    before the caller binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    backend = dist_backend or get_accelerator().communication_backend_name()
    if not tdist.is_initialized() and _restarted_on_shared_agent_store():
        _init_on_a_fresh_prefix(backend)
    deepspeed.init_distributed(dist_backend=backend)
    path = _own_shm_buffer(tdist.get_rank())
    if path and os.path.exists(path):
        tdist.barrier()          # every rank has mapped every buffer
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _restarted_on_shared_agent_store():
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def _init_on_a_fresh_prefix(backend):
    """torchrun restarted the workers. Its agent's TCPStore outlives the workers and
    every round's workers use it without a per-round prefix, so the next round's
    process groups (named by a counter, the same names again) can read the dead
    round's gloo addresses and fail with "Connection refused" (seen here on the
    first new_group after a SIGKILL restart). Join the same store under a prefix
    of the restart count instead; process groups made later inherit it."""
    from datetime import timedelta
    import torch.distributed as tdist
    from deepspeed.constants import default_pg_timeout
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                           timeout=timedelta(seconds=300))
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    tdist.init_process_group(backend, store=tdist.PrefixStore(f"seekspeed/restart{attempt}", store), rank=rank,
                             world_size=world, timeout=default_pg_timeout)
