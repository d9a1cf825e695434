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

By default it restarts the whole job on the same hosts. With ``--live-hosts`` it asks
every host of the command's ``--hostfile`` whether it is alive before each attempt
(``--probe``, by default the ssh that DeepSpeed's launcher uses itself) and launches on
the hosts that answer, through a new hostfile beside the original: a job that lost a
node continues on the others, and one whose node came back grows again. The trainer
then resumes the checkpoint on the new layout (fewer or more data-parallel replicas,
ds_ext/checkpoint/reshard.py); the config must fit the new world size (pipeline.stages
dividing it, batch keys that resolve), or the attempt stops on bad input:

    python launch/elastic.py --live-hosts --min-hosts 96 --max-restarts 10 -- \\
        deepspeed --hostfile hosts launch/train.py --deepspeed ds_configs/128node.json --resume auto

Exit code 2 is seekspeed's "bad input" (a config or data error, printed in one line):
restarting cannot fix it, so the wrapper stops there.
"""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_ext.fileio import atomic_write

USER_ERROR = 2
DEFAULT_PROBE = "ssh -o BatchMode=yes -o ConnectTimeout=5 {host} true"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                usage="python launch/elastic.py [--max-restarts N] [--delay S] -- COMMAND ...")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after the first attempt (default 3)")
    p.add_argument("--delay", type=float, default=10.0, help="seconds to wait before a restart (default 10)")
    p.add_argument("--live-hosts", action="store_true",
                   help="before each attempt, launch on the hosts of the command's --hostfile that answer --probe")
    p.add_argument("--probe", default=DEFAULT_PROBE,
                   help=f"the command that succeeds when {{host}} is alive (default: {DEFAULT_PROBE!r})")
    p.add_argument("--probe-timeout", type=float, default=15.0, help="seconds a probe may take (default 15)")
    p.add_argument("--min-hosts", type=int, default=1, help="stop when fewer hosts answer (default 1)")
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
    if args.live_hosts:
        where = hostfile_argument(args.command)
        if where is None:
            p.error("--live-hosts launches on the live hosts of the command's hostfile: give the launcher "
                    "--hostfile FILE")
        path = _hostfile_path(args.command[where])
        if not os.path.isfile(path):
            p.error(f"--hostfile {path} does not exist")
        if "{host}" not in args.probe:
            p.error(f"--probe {args.probe!r} has no {{host}} to fill in")
        if args.min_hosts < 1:
            p.error(f"--min-hosts must be >= 1, got {args.min_hosts}")
    return args


def hostfile_argument(command):
    """Index in ``command`` of the --hostfile value (DeepSpeed's -H too), or None."""
    for i, arg in enumerate(command):
        if arg in ("--hostfile", "-H") and i + 1 < len(command):
            return i + 1
        if arg.startswith("--hostfile="):
            return i
    return None


def _hostfile_path(arg):
    return arg.split("=", 1)[1] if arg.startswith("--hostfile=") else arg


def read_hostfile(path):
    """[(host, the whole line)] of a DeepSpeed hostfile ("host slots=N"; # comments)."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                out.append((line.split()[0], line))
    return out


def live_hostfile(path, *, probe, timeout, log=print):
    """Probe every host of hostfile ``path``; write the ones that answer to a hostfile
    beside it (replaced atomically) and return (its path, live hosts, lost hosts)."""
    live, lost, lines = [], [], []
    for host, line in read_hostfile(path):
        cmd = shlex.split(probe.replace("{host}", host))
        try:
            ok = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                timeout=timeout).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        (live if ok else lost).append(host)
        if ok:
            lines.append(line)
    directory = os.path.dirname(os.path.abspath(path))
    out = os.path.join(directory, f".{os.path.basename(path)}.live")
    atomic_write(out, "".join(line + "\n" for line in lines))
    log(f"elastic: {len(live)} of {len(live) + len(lost)} hosts answer"
        + (f" (lost: {', '.join(lost)})" if lost else "") + f"; hostfile {out}")
    return out, live, lost


def _command_for_attempt(args, log=print):
    """The command to run now, on the live hosts with --live-hosts; None when too few answer."""
    if not args.live_hosts:
        return args.command
    where = hostfile_argument(args.command)
    path, live, _ = live_hostfile(_hostfile_path(args.command[where]), probe=args.probe, timeout=args.probe_timeout,
                                  log=log)
    if len(live) < args.min_hosts:
        log(f"elastic: {len(live)} hosts answer, fewer than --min-hosts {args.min_hosts}; not launching")
        return None
    command = list(args.command)
    command[where] = f"--hostfile={path}" if command[where].startswith("--hostfile=") else path
    return command


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
            command = _command_for_attempt(args, log=lambda m: print(m, flush=True))
            if command is None:
                rc = 1
            else:
                print(f"elastic: attempt {attempt} of {args.max_restarts + 1}: {' '.join(command)}", flush=True)
                child = subprocess.Popen(command)
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
