"""The run report of a real training run (2 gloo ranks, DualPipeV, launch/train.py's
main): metrics.csv has one row per step with the printed losses, DeepSpeed's
TensorBoard monitor gets the same scalars, DeepSpeed's communication logger is
summarised per collective, the --profile window writes per-rank Chrome traces with
communication events and an operations table, the plots are valid PNGs, and a
resumed run continues metrics.csv without duplicates. About 40 s."""

import csv
import json
import shutil

import numpy as np
import pytest

from ds_ext.profile.report import check_png
from ds_ext.profile.window import classify
from tests.distributed import run_ranks
from tests.training import trainer_rank, write_config


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.multirank
def test_report_profile_monitor_and_resume(tmp_path):
    def mutate(c):
        c["tensorboard"] = {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "tiny"}
        c["comms_logger"] = {"enabled": True, "prof_all": True}
        c["seekspeed"]["train"]["log_interval"] = 1
        c["seekspeed"]["checkpoint"]["interval_steps"] = 4
    cfg = write_config(tmp_path, "tiny_dualpipev_cpu.json", mutate)
    ckpt, summary = tmp_path / "ckpt", tmp_path / "summary.json"
    res = run_ranks(trainer_rank, world_size=2, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "6", "--checkpoint-dir", str(ckpt), "--profile", "2:3",
                           "--summary-json", str(summary)],))
    assert [r[0] for r in res] == [0, 0], res
    report = ckpt / "report"
    s = json.loads(summary.read_text())
    assert s["report"]["dir"] == str(report)

    rows = _rows(report / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [float(r["loss"]) for r in rows] == s["losses"]          # csv writes repr: exact
    for r in rows:
        assert float(r["grad_norm"]) > 0 and float(r["tokens_per_s"]) > 0 and float(r["data_wait_s"]) >= 0
        assert float(r["comm_bytes"]) > 0 and float(r["comm_s"]) > 0      # from DeepSpeed's comms logger

    # DeepSpeed's monitor (TensorBoard) got the same scalars on rank 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert len(events) == 1, events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    loss = acc.Scalars("seekspeed/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in loss] == [float(np.float32(x)) for x in s["losses"]]     # TensorBoard keeps fp32

    # the profile window: per-rank traces with communication, tables, pipeline timeline
    for rank in (0, 1):
        trace = json.loads((report / "profile" / f"rank{rank}.trace.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {classify(n) for n in names} & {"send", "recv"}, sorted(names)[:50]
        table = (report / "profile" / f"rank{rank}.ops.txt").read_text()
        assert "Communication by collective" in table and "recv" in table
    prof = {p["rank"]: p for p in s["report"]["profile"]}
    assert set(prof) == {0, 1} and all(0 < p["comm_share"] < 1 for p in prof.values())
    assert all(p["steps"] == [2, 3] for p in prof.values())

    # DeepSpeed's communication logger, per collective, per rank
    logged = json.loads((report / "comms_logger.json").read_text())
    assert len(logged) == 2 and all(any(r["count"] > 0 and r["bytes"] > 0 for r in rows) for rows in logged)
    assert "all_reduce" in (report / "comms_logger.txt").read_text()

    for png in ("curves.png", "comm_breakdown.png", "profile/pipeline_timeline.png"):
        width, height = check_png(report / png)
        assert width > 200 and height > 100

    # a run that died during step 6, after checkpoint 4: its directory and CSV as they were
    shutil.rmtree(ckpt / "global_step6")
    (ckpt / "latest").write_text("global_step4")
    with open(report / "metrics.csv") as f:
        lines = f.readlines()
    (report / "metrics.csv").write_text("".join(lines[:6]) + lines[6][:10])     # steps 1-5 and a torn row
    res = run_ranks(trainer_rank, world_size=2, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume",
                           "--summary-json", str(summary)],))
    assert [r[0] for r in res] == [0, 0], res
    resumed = json.loads(summary.read_text())
    rows = _rows(report / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [float(r["loss"]) for r in rows[4:]] == resumed["losses"]
    assert resumed["losses"] == s["losses"][4:]          # the same arithmetic in the same order: bitwise


def test_profile_window_is_checked_before_training(tmp_path):
    from ds_ext import trainer
    from ds_ext.errors import ConfigError
    cfg = write_config(tmp_path, "tiny_cpu.json")

    def error(*argv):
        with pytest.raises(ConfigError) as err:
            trainer.validate(trainer.parse_args(["--deepspeed", cfg, *argv]), world_size=2)
        return str(err.value)

    assert "ends after the last step (5)" in error("--steps", "5", "--profile", "4:9", "--checkpoint-dir",
                                                   str(tmp_path / "c"))
    message = error("--profile", "3:2", "--checkpoint-dir", str(tmp_path / "c"))
    assert "--profile" in message and "3:2" in message
    cfg = write_config(tmp_path, "tiny_cpu.json", lambda c: c["seekspeed"]["checkpoint"].update(dir=None))
    assert "needs a report directory" in error("--profile", "2:3")
