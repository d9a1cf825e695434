"""DeepSpeed's communication logger, summarised per collective.

The logger is turned on by the DeepSpeed config section

    "comms_logger": {"enabled": true, "prof_all": true}

which deepspeed.initialize applies (the engine calls ``deepspeed.comm.configure`` with
its config; ``prof_all`` is true by default, ``"prof_ops": ["all_reduce"]`` logs only
the ops listed), or in code by ``deepspeed.comm.configure(enabled=True, prof_all=True)``.

It sees only calls made through ``deepspeed.comm``, each under DeepSpeed's name for the
op: on CPU (gloo), DeepSpeed's 1F1B pipeline engine logs ``send`` and ``recv`` of
activations and gradients, the gradients' ``all_reduce``, small ``all_reduce`` calls
and the loss ``broadcast``; seekspeed's DualPipe engines post their transfers as
``batch_isend_irecv``. Calls made with torch.distributed directly are not seen. Each
logged op is followed by a device synchronize, so the logger slows training down, and
asynchronous ops (isend, irecv, batch_isend_irecv, async_op=True) are timed until they
are posted, not until they complete.

Units: DeepSpeed records each call's message size in bytes and its latency in ms (and
bandwidths in Gbit/s, which are not used here). DeepSpeed 0.19.8 records as the
latency the running total of the op's timer rather than the call's own time
(``timed_op`` reads ``elapsed(reset=False)``); ``summarise`` takes each call's own time
from that timer, which ``reset`` clears along with the records.
"""

import math


def _logger():
    from deepspeed.comm.comm import comms_logger
    return comms_logger


def enabled():
    """Whether DeepSpeed's comms logger is on and logs every op (``prof_all``) or some
    (``prof_ops``)."""
    logger = _logger()
    return bool(logger.enabled and (logger.prof_all or logger.prof_ops))


def reset():
    """Forget what the logger recorded so far, to measure a window of steps."""
    from deepspeed.comm import comm
    _logger().reset_data()
    comm.timers.get_timers().clear()


def _own_times_ms(name):
    """Each call's time (ms, oldest first) as deepspeed.comm's timer for ``name`` holds it."""
    from deepspeed.comm import comm
    timer = comm.timers.get_timers().get(name)
    records = getattr(timer, "elapsed_records", None)
    return list(records) if records else None


def _calls(name, by_size, *, live):
    """[(message bytes, ms)] of every logged call of ``name``, oldest first."""
    logged = sorted((latency, size) for size, record in by_size.items() for latency in record[1])
    if not logged:
        return []
    own = _own_times_ms(name) if live else None
    if own and len(own) >= len(logged) and math.isclose(sum(own), logged[-1][0], rel_tol=1e-9, abs_tol=1e-9):
        # the logged latencies are running totals, so their order is the calls' order
        return [(size, ms) for (_, size), ms in zip(logged, own[-len(logged):])]
    return [(size, latency) for latency, size in logged]


def _kind(name):
    return name.split(" | ")[0]         # "debug" logging appends " | [Caller Func: ...]"


def _data_bytes(kind, size, world_size):
    """nccl-tests' data size: the whole gathered buffer for an all-gather, whose logged
    message is one rank's part."""
    return size * world_size if kind in ("all_gather", "all_gather_into_tensor") else size


def _bus_factor(kind, world_size):
    n = world_size
    if kind in ("all_reduce", "all_reduce_coalesced", "inference_all_reduce"):
        return 2 * (n - 1) / n
    if kind in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                "all_to_all_single"):
        return (n - 1) / n
    return 1.0


def _figures(kind, calls, world_size):
    total_ms = sum(ms for _, ms in calls)
    data = sum(_data_bytes(kind, size, world_size) for size, _ in calls)
    algbw = data / total_ms / 1e6 if total_ms > 0 else 0.0
    return {"count": len(calls), "bytes": sum(size for size, _ in calls), "total_ms": total_ms,
            "mean_ms": total_ms / len(calls) if calls else 0.0, "algbw_GBps": algbw,
            "busbw_GBps": algbw * _bus_factor(kind, world_size)}


def summarise(comms_dict=None, *, world_size=None, per_size=False):
    """One row per logged op (summed over message sizes), most time first:
    {"op", "count", "bytes", "total_ms", "mean_ms", "algbw_GBps", "busbw_GBps"}.

    ``comms_dict`` is DeepSpeed's ``{op name: {message bytes: [count, latencies ms,
    algbws, busbws]}}``, the live logger's by default; a dict from elsewhere is read as
    holding each call's own latency. ``bytes``: message size x count, the message being
    the tensor DeepSpeed logs (an all-gather's input, a reduce-scatter's whole input, a
    batch_isend_irecv's tensors together). Bandwidths in GB/s (1e9 bytes per second),
    over the op's total time, as nccl-tests defines them: algbw = data size / time
    (the whole gathered buffer for an all-gather), busbw = algbw x 2(n-1)/n for an
    all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 otherwise,
    n being ``world_size`` (the whole job's by default; DeepSpeed does not record the
    group). ``per_size`` adds "per_size": the same figures for each message size, with
    "msg_bytes"."""
    live = comms_dict is None
    if live:
        comms_dict = _logger().comms_dict
    if world_size is None:
        import deepspeed.comm as dist
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    rows = []
    for name, by_size in list(comms_dict.items()):
        kind = _kind(name)
        calls = _calls(name, by_size, live=live)
        row = {"op": name, **_figures(kind, calls, world_size)}
        if per_size:
            row["per_size"] = [{"msg_bytes": size, **_figures(kind, [c for c in calls if c[0] == size], world_size)}
                               for size in sorted(by_size)]
        rows.append(row)
    rows.sort(key=lambda r: r["total_ms"], reverse=True)
    return rows


def _size(num_bytes):
    for unit in ("B", "kB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000


def format_table(rows):
    """``summarise``'s rows as a printable table."""
    if not rows:
        return ("deepspeed.comm logged no op: turn the logger on with \"comms_logger\": {\"enabled\": true} in "
                "the DeepSpeed config\n")
    width = max(len("op"), *(len(r["op"]) for r in rows))
    header = (f"{'op':<{width}}  {'calls':>7}  {'bytes':>9}  {'total ms':>10}  {'mean ms':>9}  "
              f"{'algbw GB/s':>10}  {'busbw GB/s':>10}")
    lines = ["deepspeed.comm ops (ms; GB/s = 1e9 bytes per second, nccl-tests' algbw and busbw; busbw takes n as "
             "the job's world size, DeepSpeed does not log the group)", header,
             "-" * len(header)]
    for r in rows:
        lines.append(f"{r['op']:<{width}}  {r['count']:>7}  {_size(r['bytes']):>9}  {r['total_ms']:>10.3f}  "
                     f"{r['mean_ms']:>9.3f}  {r['algbw_GBps']:>10.4g}  {r['busbw_GBps']:>10.4g}")
    return "\n".join(lines) + "\n"
