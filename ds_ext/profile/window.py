"""A torch.profiler window over optimizer steps: ``--profile 10:12`` profiles steps
10 to 12 and writes, per rank, ``rank{r}.trace.json`` (the Chrome trace: Perfetto,
chrome://tracing) and ``rank{r}.ops.txt`` (the top operations by self time, and the
communication by collective: calls, ms, ms per step, share of the window's wall time).
Outside the window nothing is recorded.

    window = ProfileWindow(first, last, out_dir=run_dir, rank=rank)
    for step in ...:
        window.before_step(step)
        ...                                  # one optimizer step
        window.after_step(step)

Each collective call counts once. A collective shows at up to three levels of the
trace: the c10d front end (``c10d::allreduce_``, on the calling thread while the work
is queued), the backend's span (``gloo:all_reduce`` on a gloo worker thread, or on the
calling thread for send/recv, from the work's start to its end; ``nccl:all_reduce``
on the CPU side) and, on a GPU, the NCCL kernel
(``ncclDevKernel_AllReduce_Sum_f32_RING_LL``). When the trace has NCCL kernels they
alone are counted: the collectives' time on the GPU. Otherwise a call is a c10d front
end event, lasting from its start to the end of the backend spans that start after it
and before the next c10d call (its work); its name is the c10d one, as gloo runs
reduce_scatter as an all_reduce. Backend spans that start before the first c10d call
belong to work queued before the window and are left out.
``record_param_comms``, which NCCL nests in the c10d event and whose collective is
named only in its arguments, is not counted. Overlapping calls count once in the
totals, so the share of the wall time is at most 1; it is the time with communication
in flight, which for asynchronous calls (isend, irecv, batch_isend_irecv: DualPipe's
transfers) includes time the rank spent computing meanwhile.
"""

import bisect
import json
import os
import re
import time

from ds_ext.errors import ConfigError

TOP_OPS = 25
SUMMARY_TOP_OPS = 10

_KERNEL = re.compile(r"nccl(?:dev)?kernel_([a-z]+)")


def parse_window(text, *, flag="--profile"):
    """``"10:12"`` -> (10, 12), ``"7"`` -> (7, 7): the first and last optimizer steps
    (1-based, inclusive) to profile."""
    parts = str(text).strip().split(":")
    usage = "write FIRST:LAST such as 10:12 (optimizer steps, from 1), or one step such as 7"
    if len(parts) > 2 or not all(p.strip().isdecimal() for p in parts):
        raise ConfigError(f"{flag} {text!r} is not a step range; {usage}")
    first, last = int(parts[0]), int(parts[-1])
    if first < 1:
        raise ConfigError(f"{flag} {text!r}: steps count from 1; {usage}")
    if first > last:
        raise ConfigError(f"{flag} {text!r}: the first step must not exceed the last; {usage}")
    return first, last


def classify(name):
    """The collective a profiler event stands for ("all_reduce", "all_gather",
    "reduce_scatter", "all_to_all", "broadcast", "send", "recv", "barrier", and
    "reduce", "gather", "scatter"; "send_recv" for NCCL's SendRecv kernel, which runs
    sends, receives and all-to-alls alike), or None. Understood: c10d front ends
    (``c10d::allreduce_``, ``c10d::_reduce_scatter_base_``), backend spans
    (``gloo:all_reduce``, ``nccl:send 0->1``, ``nccl:all_reduce_barrier``) and NCCL
    kernels (``ncclDevKernel_AllGather_RING_LL``, ``ncclKernel_AllReduce_RING_LL_Sum_float``)."""
    lower = name.lower()
    kernel = _KERNEL.match(lower)
    if kernel:
        op = kernel.group(1)
    elif lower.startswith("c10d::"):
        op = lower[len("c10d::"):]
    elif lower.startswith(("gloo:", "nccl:")):
        op = lower[len("gloo:"):].split(" ")[0]
    else:
        return None
    op = re.sub(r"[^a-z]", "", op)
    if "barrier" in op:
        return "barrier"
    for part, collective in (("allreduce", "all_reduce"), ("reducescatter", "reduce_scatter"),
                             ("allgather", "all_gather"), ("alltoall", "all_to_all")):
        if part in op:
            return collective
    if op == "sendrecv":
        return "send_recv"
    for start in ("broadcast", "send", "recv", "reduce", "gather", "scatter"):
        if op.startswith(start):
            return start
    return None


def collective_intervals(events):
    """{collective: [(start_us, end_us), ...]}, one interval per call, from a Chrome
    trace's ``traceEvents`` (the counting rule is in the module docstring)."""
    kernels, fronts, backends = [], [], []
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        name, cat = event.get("name", ""), event.get("cat")
        collective = classify(name)
        if collective is None:
            continue
        span = [float(event["ts"]), float(event["ts"]) + float(event["dur"]), collective]
        if cat == "kernel":
            kernels.append(span)
        elif cat == "cpu_op" and name.startswith("c10d::"):
            fronts.append(span)
        elif cat in ("cpu_op", "user_annotation") and not name.startswith("c10d::"):
            backends.append(span)
    if kernels:
        calls = kernels
    elif fronts:
        fronts.sort()
        starts = [f[0] for f in fronts]
        for start, end, _ in backends:
            i = bisect.bisect_right(starts, start) - 1
            if i >= 0:                   # else its work began before the window
                fronts[i][1] = max(fronts[i][1], end)
        calls = fronts
    else:
        calls = backends
    out = {}
    for start, end, collective in sorted(calls):
        out.setdefault(collective, []).append((start, end))
    return out


def union_us(intervals):
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class ProfileWindow:
    """Profiles optimizer steps ``first`` to ``last`` (inclusive) of this rank."""

    def __init__(self, first, last, *, out_dir, rank, log=print):
        if not 1 <= first <= last:
            raise ValueError(f"profile window {first}:{last}: need 1 <= first <= last; use parse_window()")
        self.first, self.last = first, last
        self.out_dir, self.rank, self.log = out_dir, rank, log
        self.trace_path = os.path.join(out_dir, f"rank{rank}.trace.json")
        self.ops_path = os.path.join(out_dir, f"rank{rank}.ops.txt")
        self.summary = None
        self._started = first
        self._prof = None
        self._t0 = None

    @property
    def active(self):
        return self._prof is not None

    def before_step(self, step):
        if self.active or self.summary is not None or not self.first <= step <= self.last:
            return
        if step > self.first:
            self.log(f"profile: window {self.first}:{self.last} starts at step {step} (the run resumed inside it)")
        self._started = step
        import torch
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.start()
        self._t0 = time.perf_counter()

    def after_step(self, step):
        if step != self.last or not self.active:
            return
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - self._t0) * 1e3
        prof, self._prof = self._prof, None
        prof.stop()
        self._write(prof, wall_ms=wall_ms)

    def close(self):
        """Stop a window that training left before its last step; nothing is written."""
        if self.active:
            prof, self._prof = self._prof, None
            prof.stop()

    def _write(self, prof, *, wall_ms):
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            if os.path.exists(self.trace_path):
                os.remove(self.trace_path)
        except OSError as exc:
            raise OSError(f"profile: cannot write to out_dir {self.out_dir!r} ({exc.strerror or exc}); "
                          f"choose a writable directory") from exc
        # Kineto reports a failed write on stderr only: look for the file
        prof.export_chrome_trace(self.trace_path)
        try:
            with open(self.trace_path) as f:
                events = json.load(f).get("traceEvents", [])
        except OSError as exc:
            raise OSError(f"profile: the trace was not written to out_dir {self.out_dir!r} "
                          f"({exc.strerror or exc}); choose a writable directory") from exc
        steps = self.last - self._started + 1
        calls = collective_intervals(events)
        comm_ms = union_us([span for spans in calls.values() for span in spans]) / 1e3
        ops = _top_ops(prof)
        self.summary = {
            "rank": self.rank, "steps": [self._started, self.last],
            "wall_ms_per_step": wall_ms / steps,
            "comm_ms_per_step": comm_ms / steps,
            # the trace's clock and perf_counter may disagree by microseconds
            "comm_share": min(comm_ms / wall_ms, 1.0) if wall_ms > 0 else 0.0,
            "by_collective": {name: {"calls": len(spans), "ms_per_step": union_us(spans) / 1e3 / steps}
                              for name, spans in sorted(calls.items())},
            "top_ops": [{"name": o["name"], "self_ms": o["self_cpu_ms"] + o["self_device_ms"], "calls": o["calls"]}
                        for o in ops[:SUMMARY_TOP_OPS]],
        }
        text = _ops_text(self.summary, ops[:TOP_OPS], wall_ms=wall_ms,
                         device=any(o["self_device_ms"] for o in ops))
        try:
            with open(self.ops_path, "w") as f:
                f.write(text)
        except OSError as exc:
            raise OSError(f"profile: cannot write {self.ops_path!r} in out_dir {self.out_dir!r} "
                          f"({exc.strerror or exc}); choose a writable directory") from exc
        self.log(f"profile: steps {self._started}-{self.last} -> {self.trace_path}")


def _top_ops(prof):
    """Every operation of the window, most self time (CPU plus device) first; times in ms
    over the whole window."""
    rows = []
    for avg in prof.key_averages():
        rows.append({"name": avg.key, "calls": avg.count, "self_cpu_ms": avg.self_cpu_time_total / 1e3,
                     "cpu_total_ms": avg.cpu_time_total / 1e3,
                     "self_device_ms": getattr(avg, "self_device_time_total", 0.0) / 1e3})
    rows.sort(key=lambda r: r["self_cpu_ms"] + r["self_device_ms"], reverse=True)
    return rows


def _ops_text(summary, ops, *, wall_ms, device):
    first, last = summary["steps"]
    steps = last - first + 1
    lines = [f"rank {summary['rank']}, optimizer steps {first}-{last} ({steps} steps): "
             f"wall {wall_ms:.2f} ms, {summary['wall_ms_per_step']:.2f} ms per step", "",
             f"Top {len(ops)} operations by self time (ms over the window)"]
    width = max([len(o["name"]) for o in ops] + [len("operation")])
    width = min(width, 60)
    header = f"{'operation':<{width}}  {'calls':>7}  {'self CPU':>10}  {'CPU total':>10}"
    if device:
        header += f"  {'self device':>11}"
    lines += [header, "-" * len(header)]
    for o in ops:
        name = o["name"] if len(o["name"]) <= width else o["name"][:width - 3] + "..."
        line = f"{name:<{width}}  {o['calls']:>7}  {o['self_cpu_ms']:>10.3f}  {o['cpu_total_ms']:>10.3f}"
        if device:
            line += f"  {o['self_device_ms']:>11.3f}"
        lines.append(line)
    lines += ["", "Communication by collective (each call from its start to its completion; "
              "overlapping calls counted once)"]
    header = f"{'collective':<16}  {'calls':>7}  {'total ms':>10}  {'ms/step':>10}  {'share':>7}"
    lines += [header, "-" * len(header)]
    rows = [(name, c["calls"], c["ms_per_step"]) for name, c in summary["by_collective"].items()]
    rows.append(("all", sum(r[1] for r in rows), summary["comm_ms_per_step"]))
    for name, calls, per_step in rows:
        share = per_step * steps / wall_ms if wall_ms > 0 else 0.0
        lines.append(f"{name:<16}  {calls:>7}  {per_step * steps:>10.3f}  {per_step:>10.3f}  {share:>7.1%}")
    if not summary["by_collective"]:
        lines.append("(no collective ran in the window)")
    return "\n".join(lines) + "\n"
