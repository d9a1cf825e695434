"""One rank of a job that saves a checkpoint after every simulated training step with
seekspeed's asynchronous engine, driven the way DeepSpeed drives it (begin, makedirs,
save, seal; a poll after each step). Used by tests/test_checkpoint.py, which kills
these ranks with SIGKILL at random moments.

    python -m tests.checkpoint_worker SAVE_DIR STEPS MB_PER_RANK    (RANK, WORLD_SIZE, MASTER_* set)

Each rank's file at step s holds tensors whose every element is s (fp32 and bf16) and
the step itself, so a loaded checkpoint says which step it came from. With a complete
checkpoint present it resumes after it, as ``--resume auto`` does.
"""

import os
import sys
import time


def state_at(step, *, rank, numel):
    import torch
    return {"weights": torch.full((numel, ), float(step)), "half": torch.full((numel // 4, ), float(step),
                                                                              dtype=torch.bfloat16),
            "meta": {"step": step, "rank": rank}}


def save(ckpt, save_dir, step, state, rank):
    tag = f"global_step{step}"
    if not ckpt.begin(save_dir=save_dir, tag=tag, step=step):
        return
    final = os.path.join(save_dir, tag)
    ckpt.makedirs(final, exist_ok=True)
    ckpt.save(state, os.path.join(final, f"rank{rank}.pt"))
    ckpt.seal()


def main(save_dir, steps, mb):
    import torch
    from ds_ext.checkpoint.engine import AsyncCheckpointEngine
    from ds_ext.config import CheckpointSection
    import torch.distributed as tdist
    torch.set_num_threads(1)
    tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    ckpt = AsyncCheckpointEngine(CheckpointSection(dir=save_dir, engine="async-zstd", keep_last=3),
                                 log=lambda msg: print(msg, flush=True))
    tag = ckpt.resolve(save_dir)
    start = int(tag.removeprefix("global_step")) if tag else 0
    if tag:
        loaded = ckpt.load(os.path.join(save_dir, tag, f"rank{rank}.pt"))
        assert loaded["meta"]["step"] == start and float(loaded["weights"][0]) == start
        print(f"resumed from {tag}", flush=True)
    numel = mb * (1 << 20) // 4
    print("saving from now on", flush=True)
    for step in range(start + 1, steps + 1):
        time.sleep(0.02)                      # the step's compute
        ckpt.poll()
        save(ckpt, save_dir, step, state_at(step, rank=rank, numel=numel), rank)
    ckpt.wait()
    tdist.barrier()
    tdist.destroy_process_group()
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
