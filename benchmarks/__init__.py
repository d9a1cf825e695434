"""One script per measured claim; each prints a table and writes its figures with --json."""

import json
import os
import socket
import subprocess
import sys

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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
