"""The per-run report (ds_ext/profile/report.py): metrics.csv and expert_load.csv
resumed from a checkpoint's step (later rows dropped, a changed header renamed aside,
unknown columns refused), monitor_events through DeepSpeed's MonitorMaster on 2 gloo
ranks (TensorBoard event file read back with EventAccumulator, csv_monitor files), the
curves and communication-breakdown figures, and check_png on good and broken files.
About 10 s, most of it the two spawned ranks importing DeepSpeed (2-20 s on a busy
2-core machine)."""

import csv
import os

import pytest
import torch

from ds_ext.profile.report import (MetricsLog, check_png, monitor_events, plot_comm_breakdown, plot_curves)
from tests.distributed import run_ranks

COLUMNS = ["step", "loss", "tokens_per_s", "lr", "grad_norm", "step_s", "data_wait_s", "comm_bytes", "comm_s"]


def _row(step, *, loss=None):
    return {"step": step, "loss": 10.0 - step if loss is None else loss, "tokens_per_s": 1000.0 + step,
            "lr": 1e-4 * step, "grad_norm": 1.5, "step_s": 0.25, "data_wait_s": 0.01 * step,
            "comm_bytes": 4096, "comm_s": 0.05}


def _read(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


# -- metrics.csv and expert_load.csv ---------------------------------------------------

def test_resume_keeps_checkpointed_steps_and_appends(tmp_path):
    log = MetricsLog(tmp_path, start_step=0, columns=COLUMNS)
    for step in range(1, 4):
        log.write(_row(step))
    assert [r[0] for r in _read(log.path)] == ["step", "1", "2", "3"], "each row is flushed as written"
    for step in range(4, 7):
        log.write(_row(step))
    log.close()
    with open(log.path, "a") as f:
        f.write("7,2.5")                      # the row a crash interrupted

    messages = []
    log = MetricsLog(tmp_path, start_step=4, columns=COLUMNS, log=messages.append)
    assert [r[0] for r in _read(log.path)] == ["step", "1", "2", "3", "4"]
    assert len(messages) == 1 and "dropped 2 row(s)" in messages[0] and "1 incomplete" in messages[0]
    for step in range(5, 9):
        log.write(_row(step, loss=0.5))
    log.close()

    rows = _read(log.path)
    assert rows[0] == COLUMNS
    assert all(len(r) == len(COLUMNS) for r in rows)
    assert [int(r[0]) for r in rows[1:]] == list(range(1, 9))
    assert [float(r[1]) for r in rows[1:]] == [9.0, 8.0, 7.0, 6.0, 0.5, 0.5, 0.5, 0.5]
    assert not os.path.exists(log.path + ".tmp")


def test_missing_values_are_empty_cells_and_tensors_numbers(tmp_path):
    with MetricsLog(tmp_path, start_step=0, columns=COLUMNS) as log:
        log.write({"step": 1, "loss": torch.tensor(2.5), "grad_norm": None})
    assert _read(log.path)[1] == ["1", "2.5", "", "", "", "", "", "", ""]


def test_changed_header_is_renamed_aside(tmp_path):
    with MetricsLog(tmp_path, start_step=0, columns=COLUMNS) as log:
        log.write(_row(1))
    messages = []
    wider = COLUMNS + ["loss_lm", "loss_mtp"]
    with MetricsLog(tmp_path, start_step=1, columns=wider, log=messages.append) as log:
        log.write({"step": 2, "loss_mtp": 0.3})
    assert _read(tmp_path / "metrics.csv.old-1") == [COLUMNS, [str(v) for v in _row(1).values()]]
    assert _read(log.path) == [wider, ["2"] + [""] * 9 + ["0.3"]]
    assert "metrics.csv.old-1" in messages[0] and "columns changed" in messages[0]

    MetricsLog(tmp_path, start_step=2, columns=COLUMNS, log=messages.append).close()
    assert _read(tmp_path / "metrics.csv.old-2")[0] == wider, "an earlier .old file is never overwritten"
    assert os.path.exists(tmp_path / "metrics.csv.old-1")


def test_row_and_column_errors(tmp_path):
    log = MetricsLog(tmp_path, start_step=0, columns=COLUMNS)
    with pytest.raises(ValueError, match=r"\['loss_aux'\].*add them to MetricsLog\(columns=...\)"):
        log.write({"step": 1, "loss_aux": 0.1})
    with pytest.raises(ValueError, match="has no 'step'"):
        log.write({"loss": 1.0})
    log.close()
    with pytest.raises(ValueError, match="lack 'step'"):
        MetricsLog(tmp_path, start_step=0, columns=["loss"])
    with pytest.raises(ValueError, match=r"repeat \['loss'\]"):
        MetricsLog(tmp_path, start_step=0, columns=["step", "loss", "loss"])


def test_other_ranks_check_rows_and_write_nothing(tmp_path):
    log = MetricsLog(tmp_path / "run", start_step=0, columns=COLUMNS, rank_writes=False)
    log.write(_row(1))
    log.write_expert_load(1, {"layer.1": [1, 2]})
    with pytest.raises(ValueError, match="loss_aux"):
        log.write({"step": 1, "loss_aux": 0.1})
    log.close()
    assert not os.path.exists(tmp_path / "run")


def test_expert_load_resumes_like_metrics(tmp_path):
    log = MetricsLog(tmp_path, start_step=0, columns=COLUMNS)
    assert not os.path.exists(log.expert_load_path), "created on the first write only (dense models)"
    for step in (1, 2, 3):
        log.write_expert_load(step, {"layers.1.moe": [step, 0, 5, 1], "layers.2.moe": torch.tensor([4, 4, 1, 1])})
    log.close()
    log = MetricsLog(tmp_path, start_step=2, columns=COLUMNS, log=lambda m: None)
    log.write_expert_load(3, {"layers.1.moe": [7, 7, 7, 7]})
    log.close()
    rows = _read(log.expert_load_path)
    assert rows[0] == ["step", "layer", "expert", "tokens"]
    assert [r[0] for r in rows[1:]] == ["1"] * 8 + ["2"] * 8 + ["3"] * 4
    assert rows[9:13] == [["2", "layers.1.moe", str(e), t] for e, t in enumerate(["2", "0", "5", "1"])]
    assert rows[-1] == ["3", "layers.1.moe", "3", "7"]


# -- DeepSpeed monitor --------------------------------------------------------------------

def test_monitor_events_skip_empty_values():
    events = monitor_events({"step": 3, "loss": torch.tensor(1.25), "lr": 2e-4, "grad_norm": None,
                             "comm_s": ""}, step=3)
    assert events == [("seekspeed/loss", 1.25, 3), ("seekspeed/lr", 2e-4, 3)]
    assert monitor_events({"loss": 1}, step=1, prefix="Train/") == [("Train/loss", 1.0, 1)]
    with pytest.raises(ValueError, match="'note' is 'warm', not a number"):
        monitor_events({"note": "warm"}, step=1)


def _monitor_rank(root, rows):
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster
    # the sections of a DeepSpeed JSON config, as DeepSpeedConfig hands them to the engine
    config = get_monitor_config({"tensorboard": {"enabled": True, "output_path": os.path.join(root, "tb"),
                                                 "job_name": "run"},
                                 "csv_monitor": {"enabled": True, "output_path": os.path.join(root, "csv"),
                                                 "job_name": "run"}})
    monitor = MonitorMaster(config)
    for row in rows:
        monitor.write_events(monitor_events(row, step=row["step"]))
    return monitor.enabled, monitor.tb_monitor is not None


def test_monitor_events_reach_tensorboard_and_csv_monitor(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    rows = [_row(1), {**_row(2), "grad_norm": None}, _row(3)]
    results = run_ranks(_monitor_rank, world_size=2, args=(str(tmp_path), rows), timeout=120)
    assert results == [(True, True), (True, False)], "only rank 0 has writers"

    tb_dir = tmp_path / "tb" / "run"
    event_files = [n for n in os.listdir(tb_dir) if n.startswith("events.out.tfevents.")]
    assert len(event_files) == 1, event_files
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(f"seekspeed/{c}" for c in COLUMNS[1:])
    assert [(e.step, e.value) for e in acc.Scalars("seekspeed/loss")] == [(1, 9.0), (2, 8.0), (3, 7.0)]
    assert [e.step for e in acc.Scalars("seekspeed/grad_norm")] == [1, 3]

    assert _read(tmp_path / "csv" / "run" / "seekspeed_loss.csv") == [["step", "loss"], ["1", "9.0"], ["2", "8.0"],
                                                                      ["3", "7.0"]]


# -- figures -----------------------------------------------------------------------------

def test_plot_curves(tmp_path):
    with MetricsLog(tmp_path, start_step=0, columns=COLUMNS + ["loss_lm", "loss_mtp"]) as log:
        for step in range(1, 41):
            row = {**_row(step), "loss_lm": 8.0 - step / 10, "loss_mtp": 2.0 - step / 40}
            if step % 5:
                row["grad_norm"] = None
            log.write(row)
    plot_curves(log.path, tmp_path / "curves.png", title="tiny")
    w, h = check_png(tmp_path / "curves.png")
    assert w > 600 and h > 400

    single = tmp_path / "single"
    with MetricsLog(single, start_step=0, columns=COLUMNS) as log:
        log.write({"step": 1, "loss": 3.0})
    plot_curves(log.path, single / "curves.png")
    check_png(single / "curves.png")

    empty = tmp_path / "empty"
    MetricsLog(empty, start_step=0, columns=COLUMNS).close()
    plot_curves(empty / "metrics.csv", empty / "curves.png")
    check_png(empty / "curves.png")


def test_plot_comm_breakdown(tmp_path):
    entries = [{"label": f"rank {r}", "parts": {"compute": 120.0 + r, "all_reduce": 30.5, "send/recv": 4.0 * r}}
               for r in range(4)]
    entries.append({"label": "rank 4", "parts": {"compute": 100.0, "all_to_all": 12.0}})
    plot_comm_breakdown(entries, tmp_path / "comm.png", title="profiled step")
    w, h = check_png(tmp_path / "comm.png")
    assert w > 600 and h > 200
    with pytest.raises(ValueError, match="got no entries"):
        plot_comm_breakdown([], tmp_path / "none.png")
    with pytest.raises(ValueError, match=r"'rank 0': part 'compute' is -1.0 ms"):
        plot_comm_breakdown([{"label": "rank 0", "parts": {"compute": -1.0}}], tmp_path / "bad.png")
    assert not os.path.exists(tmp_path / "none.png") and not os.path.exists(tmp_path / "bad.png")


def test_check_png_rejects_broken_files(tmp_path):
    good = tmp_path / "good.png"
    plot_comm_breakdown([{"label": "all_reduce", "parts": {"wire": 1.0}}], good)
    data = good.read_bytes()
    assert check_png(good)[0] > 0

    cut = tmp_path / "cut.png"
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="truncated PNG"):
        check_png(cut)
    spliced = tmp_path / "spliced.png"
    spliced.write_bytes(data[:len(data) // 2] + data[-12:])     # ends like a PNG, pixels missing
    with pytest.raises(ValueError, match="decoding failed"):
        check_png(spliced)
    text = tmp_path / "metrics.png"
    text.write_text("step,loss\n1,2.0\n")
    with pytest.raises(ValueError, match="not a PNG"):
        check_png(text)
    tiny = tmp_path / "tiny.png"
    tiny.write_bytes(data[:10])
    with pytest.raises(ValueError, match="no IHDR"):
        check_png(tiny)
