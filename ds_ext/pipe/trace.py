"""Pipeline timelines: a recorded run's (or the simulator's) per-rank instruction
times written as a Chrome trace (chrome://tracing, Perfetto) and as a PNG with one
lane per rank, forward / backward / weight-gradient chunks coloured."""

import json

COLOURS = {"wait": "#ffffff", "F": "#4c9be8", "B": "#e8914c", "Bi": "#e8b84c", "W": "#5cb85c", "FB": "#9b6fd0", "comm": "#bbbbbb",
           "other": "#888888"}

# DeepSpeed instruction name -> timeline kind
_KIND = {"ForwardPass": "F", "BackwardPass": "B", "WeightPass": "W", "ForwardBackwardPass": "FB",
         "LoadMicroBatch": "other", "CommitP2P": "comm", "SendActivation": "comm", "RecvActivation": "comm",
         "SendGrad": "comm", "RecvGrad": "comm", "ReduceGrads": "other", "ReduceTiedGrads": "other",
         "OptimizerStep": "other", "WaitRecv": "wait"}


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
    """One process, one thread per rank; times in milliseconds."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    for rank, lane in enumerate(lanes):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for kind, label, start, end in lane:
            events.append({"name": label, "cat": kind, "ph": "X", "pid": 0, "tid": rank, "ts": start * 1e3,
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
    for rank, lane in enumerate(lanes):
        for kind, _, start, end in lane:
            if kind in show:
                ax.barh(rank, end - start, left=start, height=0.8, color=COLOURS[kind], edgecolor="black",
                        linewidth=0.3)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(lanes))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    fig.suptitle(title, fontsize=10)
    names = {"F": "forward", "B": "backward", "Bi": "backward (input grads)", "W": "weight grads", "FB": "F&B",
             "comm": "communication", "other": "other"}
    ax.legend(handles=[Patch(color=COLOURS[k], label=names[k]) for k in show], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), fontsize=7, ncol=5, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
