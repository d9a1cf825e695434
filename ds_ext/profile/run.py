"""What the training loop hands to the run report: one metrics row per step (CSV on
rank 0 and DeepSpeed's monitor), the optional torch.profiler window, DeepSpeed's
communication logger, and at the end the figures (curves, communication breakdown)
with a summary for the run's JSON."""

import json
import os
import time

from .report import MetricsLog, monitor_events, plot_comm_breakdown, plot_curves

BASE_COLUMNS = ["step", "loss", "tokens_per_s", "lr", "grad_norm", "step_s", "data_wait_s", "comm_bytes", "comm_s"]


class TimedBatches:
    """The data iterator DeepSpeed's engine pulls micro-batches from, timing each pull
    (the data wait of a step); everything else goes to the wrapped iterator."""

    def __init__(self, inner):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "wait_s", 0.0)

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.inner)
        finally:
            object.__setattr__(self, "wait_s", self.wait_s + time.perf_counter() - t0)

    def take_wait(self):
        wait = self.wait_s
        object.__setattr__(self, "wait_s", 0.0)
        return wait

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)


def report_dir(section, *, checkpoint_dir, override=None):
    """--report-dir, else seekspeed.report.dir, else <checkpoint.dir>/report, else None."""
    if override:
        return override
    if section.dir:
        return section.dir
    return os.path.join(checkpoint_dir, "report") if checkpoint_dir else None


class RunReport:
    """Per-step metrics and the end-of-run figures of one training run.

    Collective calls (``finish``) must be made on every rank; files are written by
    rank 0 only, but the profile traces (one per rank)."""

    def __init__(self, directory, *, rank, start_step, extra_columns=(), monitor=None, window=None,
                 plots=True, log=print):
        self.directory, self.rank, self.window, self.plots, self.log = directory, rank, window, plots, log
        self.columns = BASE_COLUMNS + list(extra_columns)
        self.metrics = None
        if directory is not None:
            self.metrics = MetricsLog(directory, start_step=start_step, columns=self.columns, rank_writes=rank == 0,
                                      log=log)
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self._comm_total = _comms_logger_totals()
        self.steps = 0

    def write(self, row, *, expert_load=None):
        self.steps += 1
        if self.metrics is not None:
            self.metrics.write(row)
            if expert_load:
                self.metrics.write_expert_load(row["step"], expert_load)
        if self.monitor is not None:
            self.monitor.write_events(monitor_events(row, step=row["step"]))

    def comms_logger_step(self):
        """(bytes, seconds) DeepSpeed's communication logger saw on this rank since the
        last call; (None, None) when it is off."""
        totals = _comms_logger_totals()
        if totals is None:
            return None, None
        before = self._comm_total or (0, 0.0)
        self._comm_total = totals
        return totals[0] - before[0], totals[1] - before[1]

    def finish(self, control, *, title=""):
        """Gather the profile window's and the comms logger's figures, write the
        figures on rank 0; returns the summary's "report" entry (rank 0) or None."""
        from . import comms
        profiles = control.gather(self.window.summary if self.window is not None and self.window.summary else None)
        logged = control.gather(comms.summarise() if comms.enabled() else None)
        if self.metrics is not None:
            self.metrics.close()
        if self.rank != 0 or self.directory is None:
            return None
        out = {"dir": self.directory, "metrics": self.metrics.path, "steps_written": self.steps}
        profiles = [p for p in profiles if p is not None]
        if profiles:
            out["profile"] = profiles
        if any(rows for rows in logged if rows):
            out["comms_logger"] = logged
            with open(os.path.join(self.directory, "comms_logger.txt"), "w") as f:
                for r, rows in enumerate(logged):
                    f.write(f"rank {r}\n{comms.format_table(rows or [])}\n\n")
            with open(os.path.join(self.directory, "comms_logger.json"), "w") as f:
                json.dump(logged, f, indent=2)
        if self.plots:
            out["plots"] = self._plots(profiles, logged, title=title)
        return out

    def _plots(self, profiles, logged, *, title):
        written = []
        curves = os.path.join(self.directory, "curves.png")
        plot_curves(self.metrics.path, curves, title=title)
        written.append(curves)
        entries, what = _breakdown(profiles, logged)
        if entries:
            path = os.path.join(self.directory, "comm_breakdown.png")
            plot_comm_breakdown(entries, path, title=f"{title} — {what}" if title else what)
            written.append(path)
        else:
            self.log("report: no communication breakdown plot (it needs --profile or DeepSpeed's comms_logger)")
        for p in written:
            self.log(f"report: {p}")
        return written


def _comms_logger_totals():
    from . import comms
    if not comms.enabled():
        return None
    rows = comms.summarise()
    return sum(r["bytes"] for r in rows), sum(r["total_ms"] for r in rows) / 1e3


def _breakdown(profiles, logged):
    """Entries for the communication breakdown: per rank, from the profile window
    (compute and other work vs each collective, per step) or else from DeepSpeed's
    communication logger (each collective's time per rank)."""
    if profiles:
        entries = []
        for p in sorted(profiles, key=lambda p: p["rank"]):
            # collectives overlap one another (batched sends and receives): each gets its
            # share of the time any communication was in flight
            parts = {name: c["ms_per_step"] for name, c in p["by_collective"].items()}
            scale = p["comm_ms_per_step"] / sum(parts.values()) if sum(parts.values()) > 0 else 0.0
            parts = {"compute and other": max(p["wall_ms_per_step"] - p["comm_ms_per_step"], 0.0),
                     **{name: ms * scale for name, ms in parts.items()}}
            entries.append({"label": f"rank {p['rank']}", "parts": parts})
        first, last = profiles[0]["steps"]
        return entries, f"profiled steps {first}-{last}, ms per step, communication in flight"
    if any(rows for rows in logged if rows):
        entries = [{"label": f"rank {r}", "parts": {row["op"]: row["total_ms"] for row in rows}}
                   for r, rows in enumerate(logged) if rows]
        return entries, "DeepSpeed comms logger, ms over the run"
    return [], ""
