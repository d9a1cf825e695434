"""The per-run report a training run writes beside its checkpoints: ``metrics.csv``
(one row per optimizer step), ``expert_load.csv`` (tokens routed to each expert of
each MoE layer), scalars for DeepSpeed's monitor (``engine.monitor``: TensorBoard,
CSV, ...) and the end-of-run figures.

Both CSV files follow the checkpoints: a run resumed from step N keeps the rows up to
N and rewrites what a run that died after its last checkpoint wrote past it.

    metrics = MetricsLog(run_dir, start_step=start, columns=columns, rank_writes=rank == 0)
    metrics.write({"step": step, "loss": loss, ...})
    engine.monitor.write_events(monitor_events(row, step=step))
    plot_curves(metrics.path, os.path.join(run_dir, "curves.png"))
"""

import csv
import io
import math
import os
import struct

from ds_ext.fileio import atomic_open

METRICS_FILE = "metrics.csv"
EXPERT_LOAD_FILE = "expert_load.csv"
EXPERT_LOAD_COLUMNS = ("step", "layer", "expert", "tokens")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_END = b"IEND\xaeB`\x82"


def _scalar(value):
    """A tensor or numpy scalar as a Python number; anything else as it is."""
    if hasattr(value, "item"):
        return value.item()
    return value


def _aside_name(path):
    n = 1
    while os.path.exists(f"{path}.old-{n}"):
        n += 1
    return f"{path}.old-{n}"


def _keep_through(path, *, columns, start_step, log):
    """Make ``path`` hold ``columns`` as its header and only the rows of steps up to
    ``start_step``; a file with other columns is renamed aside, never deleted."""
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        header = next(csv.reader(f), None)
    if header is None:
        return
    if header != list(columns):
        aside = _aside_name(path)
        os.rename(path, aside)
        log(f"{path}: columns changed from {header} to {list(columns)}; kept the old file as {aside} "
            f"and started a new one")
        return
    step_at = header.index("step")
    dropped = malformed = 0
    with open(path, newline="") as f, atomic_open(path, "w", newline="", fsync=True) as out:
        reader, writer = csv.reader(f), csv.writer(out)
        writer.writerow(next(reader))
        for row in reader:
            try:
                step = int(row[step_at]) if len(row) == len(header) else None
            except ValueError:
                step = None
            if step is None:
                malformed += 1
            elif step <= start_step:
                writer.writerow(row)
            else:
                dropped += 1
    if dropped or malformed:
        log(f"{path}: resuming from step {start_step}, dropped {dropped} row(s) of later steps "
            f"(from a run that stopped after its last checkpoint) and {malformed} incomplete row(s)")


class _StepCsv:
    """A CSV file appended to one flushed write at a time, created with its header on
    the first write."""

    def __init__(self, path, *, columns, start_step, log):
        self.path = path
        self.columns = list(columns)
        self._file = self._writer = None
        _keep_through(path, columns=self.columns, start_step=start_step, log=log)

    def writerows(self, rows):
        if self._file is None:
            fresh = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
            self._file = open(self.path, "a", newline="")
            self._writer = csv.writer(self._file)
            if fresh:
                self._writer.writerow(self.columns)
        self._writer.writerows(rows)
        self._file.flush()

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None


class MetricsLog:
    """``directory/metrics.csv``: one row per optimizer step with ``columns`` as its
    header (``step`` among them), flushed row by row so that a crash loses at most the
    row being written; and ``directory/expert_load.csv`` (step, layer, expert, tokens),
    created on the first ``write_expert_load``.

    Opening resumes: rows of steps after ``start_step`` (the checkpoint being resumed)
    are dropped, the file rewritten atomically. A ``metrics.csv`` with other columns is
    renamed ``metrics.csv.old-<n>`` and a new one started; ``log`` says so. On ranks
    with ``rank_writes=False`` rows are checked and nothing is written."""

    def __init__(self, directory, *, start_step, columns, rank_writes=True, log=print):
        columns = list(columns)
        if "step" not in columns:
            raise ValueError(f"MetricsLog columns {columns} lack 'step': every row is keyed by its optimizer "
                             f"step, add 'step' to columns")
        repeated = sorted({c for c in columns if columns.count(c) > 1})
        if repeated:
            raise ValueError(f"MetricsLog columns repeat {repeated}: name each column once")
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"MetricsLog start_step must be the resumed checkpoint's step (0 for a new run), "
                             f"got {start_step!r}")
        self.columns = tuple(columns)
        self.start_step = start_step
        self.rank_writes = rank_writes
        self.path = os.path.join(directory, METRICS_FILE)
        self.expert_load_path = os.path.join(directory, EXPERT_LOAD_FILE)
        self._metrics = self._experts = None
        if rank_writes:
            os.makedirs(directory, exist_ok=True)
            self._metrics = _StepCsv(self.path, columns=columns, start_step=start_step, log=log)
            self._metrics.writerows([])
            self._experts = _StepCsv(self.expert_load_path, columns=EXPERT_LOAD_COLUMNS, start_step=start_step,
                                     log=log)

    def write(self, row):
        """Append one step's row: a dict of column -> value; a missing column or a
        None value leaves the cell empty."""
        unknown = [key for key in row if key not in self.columns]
        if unknown:
            raise ValueError(f"metrics row has column(s) {unknown} that this MetricsLog was not given: "
                             f"add them to MetricsLog(columns=...) (known: {list(self.columns)})")
        if row.get("step") is None:
            raise ValueError(f"metrics row {row} has no 'step': pass the optimizer step the row belongs to")
        if self._metrics is None:
            return
        cells = [_scalar(row.get(name)) for name in self.columns]
        self._metrics.writerows([["" if cell is None else cell for cell in cells]])

    def write_expert_load(self, step, loads):
        """Append the tokens routed to each expert at ``step``: ``loads`` maps a MoE
        layer's name to its per-expert token counts (a list or a 1-D tensor)."""
        if not hasattr(loads, "items"):
            raise ValueError(f"write_expert_load expects {{layer name: [tokens per expert]}}, "
                             f"got {type(loads).__name__}")
        rows = []
        for layer, counts in loads.items():
            counts = counts.tolist() if hasattr(counts, "tolist") else list(counts)
            if any(isinstance(c, (list, tuple)) for c in counts):
                raise ValueError(f"expert load of layer {layer!r} is nested ({counts[:4]}...): pass one token "
                                 f"count per expert, summed over the step")
            rows += [[step, layer, expert, _scalar(tokens)] for expert, tokens in enumerate(counts)]
        if self._experts is not None:
            self._experts.writerows(rows)

    def close(self):
        for f in (self._metrics, self._experts):
            if f is not None:
                f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def monitor_events(row, *, step, prefix="seekspeed/"):
    """A metrics row as DeepSpeed monitor events, ``[(prefix + name, value, step)]``
    for ``engine.monitor.write_events``; the step column and empty values are left out."""
    events = []
    for name, value in row.items():
        value = _scalar(value)
        if name == "step" or value is None or (isinstance(value, str) and value == ""):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {name!r} is {value!r}, not a number: DeepSpeed's monitors record "
                             f"scalars, leave it out of the row") from None
        events.append((prefix + name, number, step))
    return events


def _number(text):
    if text is None or text == "":
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _read_series(metrics_csv):
    """{column: (steps, values)} with the rows where that column has a value."""
    with open(metrics_csv, newline="") as f:
        reader = csv.DictReader(f)
        names = reader.fieldnames or []
        if "step" not in names:
            raise ValueError(f"{metrics_csv} has no 'step' column (header {names}): pass a metrics.csv "
                             f"written by MetricsLog")
        series = {name: ([], []) for name in names if name != "step"}
        for row in reader:
            step = _number(row.get("step"))
            if step is None:
                continue
            for name, (steps, values) in series.items():
                value = _number(row.get(name))
                if value is not None:
                    steps.append(step)
                    values.append(value)
    return series


def _figure(*, width, height):
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), layout="constrained")


def _save(fig, out_png):
    out_png = os.fspath(out_png)
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    with atomic_open(out_png, "wb") as f:
        fig.savefig(f, format="png", dpi=100)


def _lines(ax, series, names, *, colors=None):
    handles = []
    for i, name in enumerate(names):
        steps, values = series.get(name, ([], []))
        if not steps:
            continue
        marker = "o" if len(steps) <= 30 else None
        color = colors[i] if colors else None
        handles += ax.plot(steps, values, label=name, marker=marker, markersize=3, linewidth=1.2, color=color)
    return handles


def _no_data(ax, names):
    ax.set_yticks([])
    ax.text(0.5, 0.5, f"no {', '.join(names)} recorded", transform=ax.transAxes, ha="center", va="center",
            color="0.5")


def plot_curves(metrics_csv, out_png, *, title=""):
    """Training curves from a metrics.csv, 2x2: loss (and its parts, columns named
    ``loss_*``), tokens/s, learning rate, gradient norm with data wait on a second axis."""
    series = _read_series(metrics_csv)
    fig = _figure(width=11, height=7.5)
    (ax_loss, ax_speed), (ax_lr, ax_grad) = fig.subplots(2, 2, sharex=True)
    panels = [(ax_loss, "loss", ["loss"] + sorted(n for n in series if n.startswith("loss_"))),
              (ax_speed, "tokens/s", ["tokens_per_s"]),
              (ax_lr, "learning rate", ["lr"])]
    for ax, name, names in panels:
        ax.set_title(name)
        handles = _lines(ax, series, names)
        if handles:
            if len(handles) > 1:
                ax.legend(fontsize=8)
        else:
            _no_data(ax, names)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))

    ax_grad.set_title("gradient norm and data wait")
    ax_wait = ax_grad.twinx()
    handles = _lines(ax_grad, series, ["grad_norm"], colors=["C0"])
    handles += _lines(ax_wait, series, ["data_wait_s"], colors=["C1"])
    ax_grad.set_ylabel("gradient norm", color="C0")
    ax_wait.set_ylabel("data wait (s)", color="C1")
    if handles:
        ax_wait.legend(handles=handles, labels=[h.get_label() for h in handles], loc="upper right", fontsize=8)
    else:
        _no_data(ax_grad, ["grad_norm", "data_wait_s"])
        ax_wait.set_yticks([])

    from matplotlib.ticker import MaxNLocator
    for ax in (ax_loss, ax_speed, ax_lr, ax_grad):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    steps = {step for xs, _ in series.values() for step in xs}
    if len(steps) == 1:
        ax_loss.set_xlim(min(steps) - 1, min(steps) + 1)
    for ax in (ax_lr, ax_grad):
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title)
    _save(fig, out_png)


def _ms(value):
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _check_entries(entries):
    if not entries:
        raise ValueError("plot_comm_breakdown got no entries: pass a list of "
                         "{'label': 'rank 0', 'parts': {'compute': ms, 'all_reduce': ms}}")
    names = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "label" not in entry or not hasattr(entry.get("parts"), "items"):
            raise ValueError(f"entry {i} ({entry!r}) is not {{'label': str, 'parts': {{name: milliseconds}}}}")
        for name, ms in entry["parts"].items():
            ms = _scalar(ms)
            if not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
                raise ValueError(f"entry {entry['label']!r}: part {name!r} is {ms!r} ms; times must be finite "
                                 f"numbers >= 0")
            if name not in names:
                names.append(name)
    return names


def plot_comm_breakdown(entries, out_png, *, title=""):
    """One horizontal stacked bar per entry (``{"label": str, "parts": {name: ms}}``),
    e.g. a rank's compute and each collective's time in a profiled step. Segments show
    milliseconds and their share of the bar; the legend gives each part's total over
    all bars and its share of the grand total."""
    entries = list(entries)
    names = _check_entries(entries)
    labels = [str(e["label"]) for e in entries]
    widths = {name: [float(_scalar(e["parts"].get(name, 0.0))) for e in entries] for name in names}
    bar_totals = [sum(widths[name][i] for name in names) for i in range(len(entries))]
    part_totals = {name: sum(widths[name]) for name in names}
    grand = sum(part_totals.values())
    widest = max(bar_totals) or 1.0
    cmap = "tab10" if len(names) <= 10 else "tab20"

    from matplotlib import colormaps
    colors = colormaps[cmap].colors
    fig = _figure(width=11, height=1.6 + 0.5 * len(entries))
    ax = fig.subplots()
    ys = list(range(len(entries)))
    left = [0.0] * len(entries)
    for k, name in enumerate(names):
        share = part_totals[name] / grand if grand else 0.0
        ax.barh(ys, widths[name], left=left, height=0.7, color=colors[k % len(colors)],
                label=f"{name}: {_ms(part_totals[name])} ms ({share:.0%})")
        for y, x0, w, total in zip(ys, left, widths[name], bar_totals):
            if w >= 0.07 * widest:
                ax.text(x0 + w / 2, y, f"{_ms(w)}\n{w / total:.0%}", ha="center", va="center", fontsize=7)
        left = [x + w for x, w in zip(left, widths[name])]
    for y, total in zip(ys, bar_totals):
        ax.text(total, y, f" {_ms(total)} ms", ha="left", va="center", fontsize=8)
    ax.set_yticks(ys, labels)
    ax.invert_yaxis()
    ax.set_xlim(0, widest * 1.15)
    ax.set_xlabel("milliseconds")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="total (share)", title_fontsize=8)
    if title:
        ax.set_title(title)
    _save(fig, out_png)


def _decoded_size(data):
    try:
        from PIL import Image
    except ImportError:
        import matplotlib.image
        pixels = matplotlib.image.imread(io.BytesIO(data), format="png")
        return pixels.shape[1], pixels.shape[0]
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return image.size


def check_png(path):
    """(width, height) of the PNG at ``path``; ValueError if it is not a complete,
    decodable PNG."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError(f"{path} is not a PNG: it starts with {data[:8]!r}, not the PNG signature")
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a valid PNG: no IHDR chunk after the signature ({len(data)} bytes)")
    width, height = struct.unpack(">II", data[16:24])
    if not data.endswith(PNG_END):
        raise ValueError(f"{path} is a truncated PNG: it does not end with the IEND chunk ({len(data)} bytes); "
                         f"the writer stopped mid-file, write it again")
    try:
        size = _decoded_size(data)
    except Exception as error:
        raise ValueError(f"{path} is not a valid PNG: decoding failed ({error})") from error
    if size != (width, height) or not width or not height:
        raise ValueError(f"{path} is not a valid PNG: header says {width}x{height}, image decodes to "
                         f"{size[0]}x{size[1]}")
    return width, height
