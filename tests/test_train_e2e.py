"""End to end: launch/train.py under the real deepspeed launcher (4 ranks, 2 stages
x 2 replicas), under torchrun (DualPipeV, 2 ranks) and under plain python (1 rank);
resume continues the same loss trajectory; a bad corpus, or an optimizer value only
DeepSpeed's optimizer would refuse, fails in one line without creating the checkpoint
or report directory. Spawns launchers; about 100 s on 2 cores."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.distributed import free_port, run_ranks
from tests.numerics import assert_same_checkpoint_weights, gamma
from tests.training import BIN, ROOT, TRAIN, launcher_env, trainer_rank, write_config


def _run(cmd, timeout=300):
    proc = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=timeout)
    return proc


@pytest.mark.e2e
def test_deepspeed_launcher_four_ranks(tmp_path):
    ckpt, summary = tmp_path / "ckpt", tmp_path / "summary.json"
    proc = _run([os.path.join(BIN, "deepspeed"), "--num_gpus", "4", "--master_port", str(free_port()), TRAIN,
                 "--deepspeed", "ds_configs/tiny_cpu.json", "--steps", "8", "--checkpoint-dir", str(ckpt),
                 "--summary-json", str(summary)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "4 ranks = 2 pipeline stages x 2 data-parallel" in out
    assert "step 8/8 | loss" in out and "tok/s" in out and "eta" in out and "done: 8 steps" in out
    s = json.loads(summary.read_text())
    assert s["steps"] == 8 and len(s["peak_rss_mib"]) == 4 and all(r > 0 for r in s["peak_rss_mib"])
    assert s["losses"][-1] < s["losses"][0] - 0.5, s["losses"]
    assert (ckpt / "latest").read_text().strip() == "global_step8"


# MoE with expert parallelism resumes bitwise in test_checkpoint_readers.py (from async-zstd,
# with the deepspeed engine) and, on another layout, in test_reshard.py
RESUME_CASES = {   # config, world size, expert-parallel degree, checkpoint engine, data pipeline
    "1f1b": ("tiny_cpu.json", 2, 1, "deepspeed", "memory"),
    "1f1b-async-zstd-tiered": ("tiny_cpu.json", 2, 1, "async-zstd", "tiered"),
}
# DualPipeV's resume (DeepSpeed's engine, the zero-bubble one) is tested bitwise in
# test_reshard.py (dualpipev-zb on more, then fewer replicas) and test_comm_state.py, so it
# has no case here.


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_resume_continues_the_same_trajectory(tmp_path, case):
    config, world, ep, engine, pipeline = RESUME_CASES[case]

    def mutate(c):
        c["seekspeed"]["checkpoint"]["interval_steps"] = 3
        c["seekspeed"]["checkpoint"]["engine"] = engine
        if pipeline == "tiered":   # packed shards, a hot tier of 8 of them: the run reads through the tiers
            c["seekspeed"]["data"].update(pipeline="tiered", cache_dir=str(tmp_path / "cold"),
                                          hot_dir=str(tmp_path / "hot"), hot_budget_mb=8, rows_per_shard=512)
        c["seekspeed"].setdefault("moe", {})["expert_parallel_size"] = ep
    cfg = write_config(tmp_path, config, mutate)
    full, sfull = tmp_path / "full", tmp_path / "full.json"
    res = run_ranks(trainer_rank, world_size=world, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "9", "--checkpoint-dir", str(full),
                           "--summary-json", str(sfull)],))
    assert [r[0] for r in res] == [0] * world, res
    # a run that stopped after step 6: its checkpoint directory as it was then
    part = tmp_path / "part"
    part.mkdir()
    shutil.copytree(full / "global_step6", part / "global_step6")
    (part / "latest").write_text("global_step6")
    spart = tmp_path / "part.json"
    res = run_ranks(trainer_rank, world_size=world, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "9", "--checkpoint-dir", str(part), "--resume",
                           "--summary-json", str(spart)],))
    assert [r[0] for r in res] == [0] * world, res
    assert "resumed from" in res[0][1]
    a, b = json.loads(sfull.read_text()), json.loads(spart.read_text())
    assert b["start_step"] == 6 and b["steps"] == 3
    # equal losses and weights after the restart need the weights, optimizer (and the CPU
    # FusedAdam's beta powers: from step 6 on a fresh process would round them otherwise),
    # scheduler and data position all restored
    assert b["losses"] == a["losses"][6:]          # the same arithmetic in the same order: bitwise
    assert_same_checkpoint_weights(full, part, "global_step9")
    assert (part / "latest").read_text().strip() == "global_step9"

    if pipeline == "tiered":
        # the start-up summary: where the source comes from and its tokens
        assert "data: source 1/1: json " in res[0][1] and " tokens in " in res[0][1], res[0][1]
        assert "data: hot tier " in res[0][1] and "budget 8.0 MB, shared by" in res[0][1], res[0][1]
        assert "hot tier (node) hit " in res[0][1], res[0][1]       # the progress line, so far
        return      # the tiered order continues at any batch layout (test_reshard.py)
    # resuming the memory pipeline with another batch layout would replay or skip data: refused
    changed = json.loads(open(cfg).read())
    changed["train_micro_batch_size_per_gpu"] = 2
    other = tmp_path / "other.json"
    other.write_text(json.dumps(changed))
    res = run_ranks(trainer_rank, world_size=world, init_dist=False, timeout=300,
                    args=(["--deepspeed", str(other), "--steps", "9", "--checkpoint-dir", str(full), "--resume"],))
    assert [r[0] for r in res] == [2] * world, res
    lines = res[0][2].strip().splitlines()
    assert len(lines) == 1 and "micro_batch 4 -> 2" in lines[0], res[0][2]


@pytest.mark.multirank
def test_data_failure_on_every_rank_is_reported_once(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet PAR1")
    cfg = write_config(tmp_path, "tiny_cpu.json", lambda c: c["seekspeed"]["data"].update(source=str(bad)))
    res = run_ranks(trainer_rank, world_size=2, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--checkpoint-dir", str(tmp_path / "ckpt")],))
    assert [r[0] for r in res] == [2, 2], res
    lines = res[0][2].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error (ranks 0, 1): cannot load seekspeed.data.source"), lines
    assert res[1][2] == ""
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.e2e
def test_torchrun_bidirectional_dualpipe_with_a_pipeline_trace(tmp_path):
    summary, trace = tmp_path / "s.json", tmp_path / "trace"
    cfg = write_config(tmp_path, "tiny_dualpipev_cpu.json", lambda c: c["seekspeed"].update(schedule="dualpipe"))
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                 str(free_port()), TRAIN, "--deepspeed", cfg, "--steps", "3", "--checkpoint-dir",
                 str(tmp_path / "ckpt"), "--summary-json", str(summary), "--pipe-trace", str(trace)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["layout"]["schedule"] == "dualpipe" and s["steps"] == 3 and s["losses"][-1] < s["losses"][0]
    events = json.loads((trace / "pipeline_trace.json").read_text())["traceEvents"]
    lanes = {e["tid"] for e in events if e.get("ph") == "X"}
    kinds = {e["cat"] for e in events if e.get("ph") == "X"}
    assert lanes == {0, 1} and {"F", "B", "W"} <= kinds | {"Bi"} and "Bi" in kinds
    png = (trace / "pipeline_timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@pytest.mark.e2e
def test_plain_python_one_rank(tmp_path):
    summary = tmp_path / "s.json"
    proc = _run([sys.executable, TRAIN, "--deepspeed", "ds_configs/tiny_1rank.json", "--steps", "3",
                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--summary-json", str(summary)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(summary.read_text())["layout"]["world_size"] == 1


@pytest.mark.e2e
def test_empty_corpus_fails_in_one_line_and_writes_nothing(tmp_path):
    corpus = tmp_path / "empty.jsonl"
    corpus.write_text('{"text": ""}\n')
    ckpt = tmp_path / "ckpt"
    cfg = write_config(tmp_path, "tiny_1rank.json", lambda c: c["seekspeed"]["data"].update(source=str(corpus)))
    proc = _run([sys.executable, TRAIN, "--deepspeed", cfg, "--checkpoint-dir", str(ckpt)])
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "no non-empty documents" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not ckpt.exists()


@pytest.mark.e2e
def test_a_bad_optimizer_value_fails_before_anything_is_written(tmp_path):
    """DeepSpeed would take "lr": "fast" and fail at the first step, after the report
    directory exists; the run stops in validation instead, in one line."""
    ckpt, report = tmp_path / "ckpt", tmp_path / "report"

    def mutate(c):
        c["optimizer"]["params"]["lr"] = "fast"
        c["seekspeed"]["report"] = {"dir": str(report)}
    cfg = write_config(tmp_path, "tiny_1rank.json", mutate)
    proc = _run([sys.executable, TRAIN, "--deepspeed", cfg, "--steps", "2", "--checkpoint-dir", str(ckpt)])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith('error: optimizer.params.lr "fast"'), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not ckpt.exists() and not report.exists()


@pytest.mark.multirank
def test_bf16_with_fp32_accumulation_tracks_fp32(tmp_path):
    """bf16 comes from the JSON: DeepSpeed's BF16 optimizer (ZeRO-1, fp32 gradient
    accumulation, as in the production configs) follows the fp32 run closely."""
    def bf16(c):
        c["bf16"] = {"enabled": True}
        c["data_types"] = {"grad_accum_dtype": "fp32"}
    losses = {}
    for name, mutate in (("fp32", None), ("bf16", bf16)):
        cfg = write_config(tmp_path, "tiny_cpu.json", mutate)
        summary = tmp_path / f"{name}.json"
        res = run_ranks(trainer_rank, world_size=2, init_dist=False, timeout=300,
                        args=(["--deepspeed", cfg, "--steps", "5", "--checkpoint-dir", str(tmp_path / name),
                               "--summary-json", str(summary)],))
        assert [r[0] for r in res] == [0, 0], res
        losses[name] = json.loads(summary.read_text())["losses"]
    # a behavioural check, not one of equal arithmetic: bf16 rounds every activation and
    # weight copy (2^-8 relative), which no bound carries through five steps of training;
    # the losses (about 5.5) must stay within 0.02 of fp32's, and differ (bf16 did run)
    diff = np.abs(np.array(losses["bf16"]) - np.array(losses["fp32"]))
    assert diff.max() < 0.02 and diff.max() > 0, losses


@pytest.mark.multirank
def test_mtp_loss_is_trained_and_reported_apart(tmp_path):
    def mtp(c):
        c["seekspeed"]["recipe"]["overrides"] = {"num_mtp_layers": 1}
        c["seekspeed"]["mtp"] = {"loss_weight": 0.3}
        c["seekspeed"]["train"]["log_interval"] = 1
    cfg = write_config(tmp_path, "tiny_dualpipev_cpu.json", mtp)
    summary = tmp_path / "s.json"
    res = run_ranks(trainer_rank, world_size=2, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ckpt"),
                           "--summary-json", str(summary)],))
    assert [r[0] for r in res] == [0, 0], res
    assert "| lm " in res[0][1] and "| mtp " in res[0][1]
    s = json.loads(summary.read_text())
    assert len(s["loss_parts"]) == 3
    gas = s["layout"]["grad_accum"]
    for total, parts in zip(s["losses"], s["loss_parts"]):
        assert parts["mtp"] > parts["lm"] > 0          # predicting two tokens ahead is harder
        # total = mean over micro-batches of lm + 0.3 mtp, the parts their own means, all in
        # fp32: 2 gas + 2 roundings at most between the two sides (tests/numerics.py)
        assert abs(total - (parts["lm"] + 0.3 * parts["mtp"])) <= gamma(2 * gas + 2) * (parts["lm"] + 0.3 * parts["mtp"])
