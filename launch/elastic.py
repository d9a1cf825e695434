"""Restart a training job that died, from its newest complete checkpoint, without a person.

torchrun does this itself (``--max_restarts``); DeepSpeed 0.19's launcher does not (its
elastic mode is gone): when a rank dies it stops every rank and exits non-zero. This
wrapper runs the launcher command again, up to ``--max-restarts`` times, and the
command's ``--resume auto`` continues from the newest complete checkpoint:

    python launch/elastic.py --max-restarts 3 -- \\
        deepspeed --hostfile hosts launch/train.py --deepspeed ds_configs/128node.json --resume auto
    # torchrun restarts on its own:
    torchrun --nnodes 128 --nproc_per_node 8 --max_restarts 3 --rdzv_backend c10d --rdzv_endpoint HOST:29400 \\
        launch/train.py --deepspeed ds_configs/128node.json --resume auto

It restarts the whole job on the same hosts: a node that is gone for good has to be
taken out of the hostfile (DeepSpeed cannot shrink a running job). Exit code 2 is
seekspeed's "bad input" (a config or data error, printed in one line): restarting
cannot fix it, so the wrapper stops there.
"""

import argparse
import signal
import subprocess
import sys
import time

USER_ERROR = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                usage="python launch/elastic.py [--max-restarts N] [--delay S] -- COMMAND ...")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after the first attempt (default 3)")
    p.add_argument("--delay", type=float, default=10.0, help="seconds to wait before a restart (default 10)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the launcher command, after --")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("no command: put the launcher command after --")
    joined = " ".join(args.command)
    if "--resume auto" not in joined and "--resume=auto" not in joined:
        p.error("the command must continue from its checkpoints on a restart: add --resume auto to it")
    if args.max_restarts < 0:
        p.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    return args


def main(argv=None):
    args = parse_args(argv)
    child = None

    def forward(signum, _frame):
        if child is not None and child.poll() is None:
            child.send_signal(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, forward)
    attempt = 0
    try:
        while True:
            attempt += 1
            print(f"elastic: attempt {attempt} of {args.max_restarts + 1}: {' '.join(args.command)}", flush=True)
            child = subprocess.Popen(args.command)
            rc = child.wait()
            child = None
            if rc == 0:
                print(f"elastic: the job finished (attempt {attempt})", flush=True)
                return 0
            if rc == USER_ERROR:
                print("elastic: the job stopped on bad input (exit code 2); a restart would fail the same way",
                      flush=True)
                return rc
            if attempt > args.max_restarts:
                print(f"elastic: attempt {attempt} exited with code {rc}; no restarts left (--max-restarts "
                      f"{args.max_restarts})", flush=True)
                return rc
            print(f"elastic: attempt {attempt} exited with code {rc}; restarting in {args.delay:g} s from the newest "
                  f"complete checkpoint", flush=True)
            time.sleep(args.delay)
    except KeyboardInterrupt:
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGINT)
            child.wait()
        print("elastic: interrupted; not restarting", flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
