"""Pipeline timelines: a recorded run's (or the simulator's) per-rank instruction
times written as a Chrome trace (chrome://tracing, Perfetto) and as a PNG with one
lane per rank, forward / backward / weight-gradient chunks coloured. The MoE
all-to-alls get a lane of their own under each rank: in flight (issued to waited) and
the part the rank was blocked on them, so what was hidden behind compute shows."""

import json

COLOURS = {"wait": "#ffffff", "F": "#4c9be8", "B": "#e8914c", "Bi": "#e8b84c", "W": "#5cb85c", "FB": "#9b6fd0", "comm": "#bbbbbb",
           "other": "#888888", "a2a": "#c9c9e8", "a2a-wait": "#d0342c"}
A2A_KINDS = ("a2a", "a2a-wait")
A2A_TID = 1000          # Chrome-trace thread id of rank r's all-to-all lane: A2A_TID + r

# DeepSpeed instruction name -> timeline kind
_KIND = {"ForwardPass": "F", "BackwardPass": "B", "WeightPass": "W", "ForwardBackwardPass": "FB",
         "LoadMicroBatch": "other", "CommitP2P": "comm", "SendActivation": "comm", "RecvActivation": "comm",
         "SendGrad": "comm", "RecvGrad": "comm", "ReduceGrads": "other", "ReduceTiedGrads": "other",
         "OptimizerStep": "other", "WaitRecv": "wait", "AllToAll": "a2a", "WaitAllToAll": "a2a-wait"}


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
        out.append((kind, label, (start - origin) * 1e3, (end - origin) * 1e3))
    return out


def from_simulation(result):
    """(kind, label, start, end) lanes from a simulate.Result (costs in its units)."""
    lanes = []
    for ops in result.timeline:
        lanes.append([(op.kind, f"{op.kind} s{op.stage} mb{op.mb}" if op.stage >= 0 else op.kind, op.start, op.end)
                      for op in ops])
    return lanes


def write_chrome_trace(lanes, path, *, name="pipeline"):
    """One process, one thread per rank (and one more per rank for its all-to-alls, in
    flight and waited on); times in milliseconds."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    for rank, lane in enumerate(lanes):
        lane_ids = [(rank, f"rank {rank}")]
        if any(kind in A2A_KINDS for kind, *_ in lane):
            lane_ids.append((A2A_TID + rank, f"rank {rank} all-to-all"))
        for order, (tid, title) in enumerate(lane_ids):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": title}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid,
                           "args": {"sort_index": 2 * rank + order}})
        for kind, label, start, end in lane:
            events.append({"name": label, "cat": kind, "ph": "X", "pid": 0,
                           "tid": A2A_TID + rank if kind in A2A_KINDS else rank, "ts": start * 1e3,
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
    has_a2a = False
    for rank, lane in enumerate(lanes):
        for kind, _, start, end in lane:
            if kind in show:
                ax.barh(rank - 0.1, end - start, left=start, height=0.6, color=COLOURS[kind], edgecolor="black",
                        linewidth=0.3)
            elif kind in A2A_KINDS:       # a thin lane under the rank's compute
                has_a2a = True
                ax.barh(rank + 0.3, end - start, left=start, height=0.16, color=COLOURS[kind], linewidth=0)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(lanes))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    fig.suptitle(title, fontsize=10)
    names = {"F": "forward", "B": "backward", "Bi": "backward (input grads)", "W": "weight grads", "FB": "F&B",
             "comm": "communication", "other": "other", "a2a": "all-to-all in flight", "a2a-wait": "all-to-all waited"}
    keys = list(show) + (list(A2A_KINDS) if has_a2a else [])
    ax.legend(handles=[Patch(color=COLOURS[k], label=names[k]) for k in keys], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), fontsize=7, ncol=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
