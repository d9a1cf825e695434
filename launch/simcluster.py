"""A simulated multi-node cluster on one machine: one network namespace per node,
joined through a switch namespace by veth links shaped with tc (token bucket),
loopback inside each node. The same command runs on every node through DeepSpeed's
launcher (one launcher per node, --no_ssh), logs are collected, and everything is
torn down on exit, failure or Ctrl-C. Only addresses inside the namespaces it makes
are used. Needs root (ip netns, tc).

    python launch/simcluster.py --nodes 2 --ranks-per-node 2 --rate 1gbit -- \\
        launch/train.py --deepspeed ds_configs/tiny_cpu.json --steps 20

Each rank gets GLOO_SOCKET_IFNAME set to its node's link (gloo would otherwise bind
to the hostname's 127.0.0.1). tc here has tbf but no netem: bandwidth is shaped,
delay is not added.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ip(*args, ns=None, check=True):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class SimCluster:
    """Namespaces ``<prefix>-n<k>`` (nodes) and ``<prefix>-sw`` (switch with bridge)."""

    def __init__(self, nodes, *, rate="1gbit", prefix=None):
        if nodes < 2:
            raise ValueError("a simulated cluster needs at least 2 nodes")
        pid = os.getpid()
        self.nodes, self.rate = nodes, rate
        self.prefix = prefix or f"ss{pid % 100000}"
        self.subnet = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
        self.namespaces = []

    def node_ns(self, k):
        return f"{self.prefix}-n{k}"

    def address(self, k):
        return f"{self.subnet}.{k + 1}"

    def up(self):
        sw = f"{self.prefix}-sw"
        self._add_ns(sw)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=sw)
        _ip("ip", "link", "set", "br0", "up", ns=sw)
        for k in range(self.nodes):
            ns = self.node_ns(k)
            self._add_ns(ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            host, peer = f"{self.prefix}h{k}", f"{self.prefix}s{k}"
            _ip("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
            _ip("ip", "link", "set", host, "netns", ns, "name", "eth0")
            _ip("ip", "link", "set", peer, "netns", sw)
            _ip("ip", "link", "set", peer, "master", "br0", ns=sw)
            _ip("ip", "link", "set", peer, "up", ns=sw)
            _ip("ip", "addr", "add", f"{self.address(k)}/24", "dev", "eth0", ns=ns)
            _ip("ip", "link", "set", "eth0", "up", ns=ns)
            for dev, where in (("eth0", ns), (peer, sw)):   # both directions of the node's link
                _ip("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "256kb",
                    "latency", "100ms", ns=where)
        return self

    def _add_ns(self, name):
        _ip("ip", "netns", "add", name)
        self.namespaces.append(name)

    def down(self):
        for name in reversed(self.namespaces):
            _ip("ip", "netns", "pids", name, check=False)
            for pid in (_ip("ip", "netns", "pids", name, check=False).stdout or "").split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("ip", "netns", "del", name, check=False)
        self.namespaces = []

    def __enter__(self):
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc):
        self.down()


def run(args):
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    logdir = args.log_dir or tempfile.mkdtemp(prefix="simcluster-logs-")
    os.makedirs(logdir, exist_ok=True)
    hostfile = os.path.join(logdir, "hostfile")
    with open(hostfile, "w") as f:
        f.writelines(f"node{k} slots={args.ranks_per_node}\n" for k in range(args.nodes))
    cluster = SimCluster(args.nodes, rate=args.rate)
    procs, logs = [], []

    def stop(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        cluster.up()
        print(f"simcluster: {args.nodes} nodes x {args.ranks_per_node} ranks, {args.rate} per node link, "
              f"namespaces {cluster.prefix}-*, node 0 at {cluster.address(0)}; logs in {logdir}", flush=True)
        for k in range(args.nodes):
            env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
                       PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
            cmd = ["ip", "netns", "exec", cluster.node_ns(k), deepspeed, "--hostfile", hostfile, "--no_ssh",
                   "--node_rank", str(k), "--num_nodes", str(args.nodes), "--num_gpus", str(args.ranks_per_node),
                   "--master_addr", cluster.address(0), "--master_port", str(args.master_port), *args.command]
            log = open(os.path.join(logdir, f"node{k}.log"), "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break                      # one node failed or time is up: stop the others
            time.sleep(0.5)
        timed_out = time.monotonic() > deadline
        codes = []
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
            codes.append(p.returncode)
        for log in logs:
            log.close()
        for k, code in enumerate(codes):
            path = os.path.join(logdir, f"node{k}.log")
            print(f"--- node {k} (exit {code}) {path}", flush=True)
            with open(path, errors="replace") as f:
                tail = f.readlines()[-args.tail:]
            sys.stdout.write("".join(tail))
        if timed_out:
            print(f"simcluster: timed out after {args.timeout}s", file=sys.stderr)
            return 124
        return 0 if all(c == 0 for c in codes) else next(c for c in codes if c != 0) or 1
    except KeyboardInterrupt:
        print("simcluster: interrupted, tearing down", file=sys.stderr)
        return 130
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        cluster.down()
        signal.signal(signal.SIGTERM, previous)
        if not args.log_dir:
            shutil.rmtree(logdir, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="tc rate of each node's link, each direction (e.g. 1gbit, 200mbit)")
    p.add_argument("--master-port", type=int, default=29611)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--log-dir", help="keep the nodes' logs here (default: a temporary directory, removed)")
    p.add_argument("--tail", type=int, default=15, help="lines of each node's log to print at the end")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- script and its arguments, run on every node")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("give the command after --, e.g. -- launch/train.py --deepspeed ds_configs/tiny_cpu.json")
    if os.geteuid() != 0:
        p.error("simcluster needs root for ip netns and tc")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
