"""One script per measured claim; each prints a table and writes its figures with --json."""

import json
import os
import subprocess
import sys

from ds_ext.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine():
    """The CPU a figure was measured on: model, widest vector ISA it has, the kernels torch
    dispatches to (ATEN_CPU_CAPABILITY can lower them), cores this process may use."""
    info, flags = {}, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "cpu MHz") and key not in info:
                    info[key] = " ".join(value.split())
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    model = info.get("model name", "unknown")
    if "cpu family" in info:        # virtual machines often report only the brand ("AMD EPYC")
        model += f" (family {info['cpu family']} model {info.get('model', '?')}"
        model += f", {float(info['cpu MHz']) / 1000:.1f} GHz)" if "cpu MHz" in info else ")"
    isa = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("sse4_2", "SSE4.2"))
                if flag in flags), "unknown")
    import torch
    return {"cpu": model, "isa": isa, "torch_kernels": torch.backends.cpu.get_cpu_capability(),
            "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__.split("+")[0]}


def machine_line():
    m = machine()
    return f"machine: {m['cpu']}, {m['isa']} (torch kernels {m['torch_kernels']}), {m['cores']} cores"


def write_figures(path, figures):
    """Write ``figures`` (plus the command that made them and the machine) as JSON to
    ``path``; None: nothing."""
    if not path:
        return
    figures = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), "machine": machine(),
               **figures}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(figures, f, indent=2)
    print(f"figures: {path}")


def launch(script_args, *, world, summary_json, what):
    """``deepspeed --num_gpus WORLD SCRIPT_ARGS --summary-json SUMMARY_JSON`` from the
    repository root, one CPU thread per rank; the summary it wrote, or exit with the
    run's output tail naming ``what`` failed."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(world), "--master_port",
           str(free_port()), *script_args, "--summary-json", summary_json]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(summary_json) as f:
        return json.load(f)


def simcluster_cmd(script, *, nodes, ranks_per_node, rate):
    """launch/simcluster.py running ``script`` (argv) on ``nodes`` x ``ranks_per_node``."""
    return [sys.executable, os.path.join(ROOT, "launch", "simcluster.py"), "--nodes", str(nodes), "--ranks-per-node",
            str(ranks_per_node), "--rate", rate, "--tail", "0", "--", *script]


def ranks_in_namespaces(script, *, node_of, rate, master_port, timeout, rows_json, name):
    """``script`` (argv) as one process per rank in a fresh simulated cluster
    (launch/simcluster.py, ``rate`` per node link): rank r on node ``node_of[r]`` with
    RANK, WORLD_SIZE, LOCAL_RANK (its place among its node's ranks), LOCAL_WORLD_SIZE,
    node 0's address as MASTER_ADDR, one thread, the CPU accelerator. Every rank is
    ended and the namespaces torn down whatever happens. Returns the JSON rank 0 wrote
    to ``rows_json``; exits with each rank's log tail when one failed or ``timeout``
    seconds passed."""
    import tempfile
    import time

    from launch.simcluster import SimCluster
    world = len(node_of)
    procs, logs = [], []
    with SimCluster(max(node_of) + 1, rate=rate) as cluster, tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        try:
            for rank, node in enumerate(node_of):
                peers = [r for r in range(world) if node_of[r] == node]
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(peers.index(rank)),
                           LOCAL_WORLD_SIZE=str(len(peers)), MASTER_ADDR=cluster.address(0),
                           MASTER_PORT=str(master_port), GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
                           DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
                log = open(os.path.join(tmp, f"rank{rank}.log"), "w")
                logs.append(log)
                procs.append(subprocess.Popen(["ip", "netns", "exec", cluster.node_ns(node), *script], cwd=ROOT,
                                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.5)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            for log in logs:
                log.close()
        if any(p.returncode != 0 for p in procs) or not os.path.exists(rows_json):
            tails = []
            for rank in range(world):
                with open(os.path.join(tmp, f"rank{rank}.log"), errors="replace") as f:
                    tails.append(f"--- rank {rank} (exit {procs[rank].returncode})\n" + "".join(f.readlines()[-25:]))
            sys.exit(f"{name}: a rank failed or timed out\n" + "\n".join(tails))
    with open(rows_json) as f:
        return json.load(f)


def run_for_rows(cmd, rows_json, *, name):
    """Run ``cmd`` (one thread per rank, CPU accelerator) and return the JSON its rank 0
    wrote to ``rows_json``; exit with the output's tail when it failed."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(rows_json):
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(rows_json) as f:
        return json.load(f)


def oneway_bytes_per_s(dist, peer, nbytes):
    """Payload bytes/s from rank 0 to ``peer``, one way (the receiver's ack closes the
    timing), on every rank (broadcast from 0); ``dist``: torch.distributed."""
    import time

    import torch
    buf = torch.ones(nbytes // 4)
    dist.barrier()
    t0 = time.perf_counter()
    if dist.get_rank() == 0:
        dist.send(buf, peer)
        dist.recv(buf[:1], peer)
    elif dist.get_rank() == peer:
        dist.recv(buf, 0)
        dist.send(buf[:1], 0)
    out = torch.tensor([nbytes / (time.perf_counter() - t0)], dtype=torch.float64)
    dist.broadcast(out, 0)
    return float(out)


def add_output_args(parser):
    """--json (the figures), and what a rank launched by the script itself is given:
    --rows-json (where rank 0 writes its rows) and the launcher's --local_rank."""
    import argparse
    parser.add_argument("--json")
    parser.add_argument("--rows-json", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
