"""Pipeline timelines: a recorded run's per-rank instruction times written as a
Chrome trace (chrome://tracing, Perfetto) and as a PNG with one lane per rank,
forward / backward / weight-gradient chunks coloured. The MoE all-to-alls get a lane
of their own under each rank: in flight (issued to waited) and the part the rank was
blocked on them, so what was hidden behind compute shows; so do the data-parallel
gradient reductions of ``seekspeed.overlap_grad_reduce`` (issued to done per chunk,
and the wait at ReduceGrads)."""

import json

COLOURS = {"wait": "#ffffff", "F": "#4c9be8", "B": "#e8914c", "Bi": "#e8b84c", "W": "#5cb85c", "FB": "#9b6fd0", "comm": "#bbbbbb",
           "other": "#888888", "a2a": "#c9c9e8", "a2a-wait": "#d0342c", "dp": "#c9e8c9", "dp-wait": "#8b1a1a"}
A2A_KINDS = ("a2a", "a2a-wait")
A2A_TID = 1000          # Chrome-trace thread id of rank r's all-to-all lane: A2A_TID + r
DP_KINDS = ("dp", "dp-wait")
DP_TID = 2000           # ... and of its data-parallel reduction lane: DP_TID + r

# DeepSpeed instruction name -> timeline kind
_KIND = {"ForwardPass": "F", "BackwardPass": "B", "WeightPass": "W", "ForwardBackwardPass": "FB",
         "LoadMicroBatch": "other", "CommitP2P": "comm", "SendActivation": "comm", "RecvActivation": "comm",
         "SendGrad": "comm", "RecvGrad": "comm", "ReduceGrads": "other", "ReduceTiedGrads": "other",
         "OptimizerStep": "other", "WaitRecv": "wait", "AllToAll": "a2a", "WaitAllToAll": "a2a-wait",
         "GradReduce": "dp", "WaitGradReduce": "dp-wait"}


def from_engine_events(events, *, origin=None):
    """(kind, label, start_ms, end_ms) from an engine's InstructionTimeline events."""
    if not events:
        return []
    origin = events[0][2] if origin is None else origin
    out = []
    for name, kwargs, start, end in events:
        kind = _KIND.get(name, "other")
        if name == "BackwardPass" and kwargs.get("zb"):
            kind = "Bi"
        label = name
        if "buffer_id" in kwargs:
            label += f" b{kwargs['buffer_id']}"
        if "phase" in kwargs:
            label += f" p{kwargs['phase']}"
        if kind in A2A_KINDS:
            label = f"{'waited' if kind == 'a2a-wait' else 'in flight'}: {kwargs.get('what', '')}"
        if kind in DP_KINDS:
            label = ("data-parallel reduction waited" if kind == "dp-wait" else
                     f"data-parallel reduction in flight: chunk {kwargs.get('chunk', '')}")
        out.append((kind, label, (start - origin) * 1e3, (end - origin) * 1e3))
    return out


def write_chrome_trace(lanes, path, *, name="pipeline"):
    """One process, one thread per rank (and one more per rank for its all-to-alls, in
    flight and waited on); times in milliseconds."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    for rank, lane in enumerate(lanes):
        lane_ids = [(rank, f"rank {rank}")]
        if any(kind in A2A_KINDS for kind, *_ in lane):
            lane_ids.append((A2A_TID + rank, f"rank {rank} all-to-all"))
        if any(kind in DP_KINDS for kind, *_ in lane):
            lane_ids.append((DP_TID + rank, f"rank {rank} data-parallel reduction"))
        for order, (tid, title) in enumerate(lane_ids):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": title}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid,
                           "args": {"sort_index": 3 * rank + order}})
        for kind, label, start, end in lane:
            tid = A2A_TID + rank if kind in A2A_KINDS else DP_TID + rank if kind in DP_KINDS else rank
            events.append({"name": label, "cat": kind, "ph": "X", "pid": 0, "tid": tid, "ts": start * 1e3,
                           "dur": max(end - start, 0.0) * 1e3})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def plot_timeline(lanes, path, *, title="", unit="ms", show=("F", "B", "Bi", "W", "FB")):
    """PNG: one lane per rank; compute chunks coloured, communication and the rest omitted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(lanes) + 1.2), dpi=110)
    has_a2a = has_dp = False
    for rank, lane in enumerate(lanes):
        for kind, _, start, end in lane:
            if kind in show:
                ax.barh(rank - 0.1, end - start, left=start, height=0.6, color=COLOURS[kind], edgecolor="black",
                        linewidth=0.3)
            elif kind in A2A_KINDS:       # a thin lane under the rank's compute
                has_a2a = True
                ax.barh(rank + 0.3, end - start, left=start, height=0.16, color=COLOURS[kind], linewidth=0)
            elif kind in DP_KINDS:        # and one above it
                has_dp = True
                ax.barh(rank - 0.5, end - start, left=start, height=0.16, color=COLOURS[kind], linewidth=0)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(lanes))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    fig.suptitle(title, fontsize=10)
    names = {"F": "forward", "B": "backward", "Bi": "backward (input grads)", "W": "weight grads", "FB": "F&B",
             "comm": "communication", "other": "other", "a2a": "all-to-all in flight", "a2a-wait": "all-to-all waited",
             "dp": "dp reduction in flight", "dp-wait": "dp reduction waited"}
    keys = list(show) + (list(A2A_KINDS) if has_a2a else []) + (list(DP_KINDS) if has_dp else [])
    ax.legend(handles=[Patch(color=COLOURS[k], label=names[k]) for k in keys], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), fontsize=7, ncol=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
