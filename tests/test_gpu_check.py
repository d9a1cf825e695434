"""benchmarks/gpu_check.py without a GPU: it refuses in one line with exit code 2;
its training configs pass the trainer's validation and the planner (the v2-lite
run: 2 layers, one of them MoE, one rank); the table shows figures, failures and
the pinned-buffer note. Single process plus one short subprocess; about 10 s."""

import os
import subprocess
import sys

from benchmarks import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_refuses_without_cuda_in_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [("gpu_check: no CUDA device (torch.cuda.is_available() is False): "
                                                 "run it on a machine with an NVIDIA GPU")]
    assert proc.stdout == ""


def test_run_configs_pass_validation_and_the_planner(tmp_path):
    from ds_ext.planner import make_plan
    from ds_ext.trainer import parse_args, validate
    for name in gpu_check.RUNS:
        path = gpu_check.write_run_config(name, workdir=str(tmp_path))
        run_plan = validate(parse_args(["--deepspeed", path]), world_size=1)
        cfg, model_config = run_plan.cfg, run_plan.model_config
        assert cfg.ds["bf16"]["enabled"] and cfg.layout.world_size == 1 and cfg.layout.pipe_stages == 1
        assert not cfg.section.checkpoint.save_final and cfg.section.checkpoint.interval_steps == 0
        assert cfg.section.checkpoint.dir.startswith(str(tmp_path))
    assert (model_config.num_hidden_layers, model_config.num_moe_layers(), model_config.hidden_size) == (2, 1, 2048)
    assert cfg.section.data.seq_len == 512
    plan = make_plan(path, nodes=1, ranks_per_node=1)
    (stage,) = plan.stages
    figures = gpu_check.planner_figures(path, measured=2 * stage.total)
    assert figures["planned"]["total"] == stage.total and figures["measured_over_planned"] == 2.0
    assert f"planned {stage.total / 1e9:.2f} GB" in gpu_check.describe("planner", figures)
    assert "2.000x" in gpu_check.describe("planner", figures)


def test_table_shows_figures_failures_and_the_pinned_note():
    checkpoint = {"async_first_blocking_s": 0.5, "async_reused_blocking_s": 0.1, "async_reused_snapshot_s": 0.08,
                  "deepspeed_blocking_s": 1.0, "deepspeed_over_async": 10.0, "snapshot_buffer_bytes": 0,
                  "pinned_fraction": 0.0, "state_bytes": 1.07e9}
    results = {"tiny": {"status": "failed", "error": "exit 1: torch.OutOfMemoryError: CUDA out of memory"},
               "v2-lite": {"status": "timeout", "error": f"stopped after its {gpu_check.LIMITS['v2-lite']} s limit"},
               "checkpoint": {"status": "ok", "figures": checkpoint}}
    text = gpu_check.table("gpu_check: a GPU", results)
    rows = {line.split("  ")[0]: line for line in text.splitlines()[3:]}
    assert "failed" in rows["1 tiny, bf16, 1 rank"] and "CUDA out of memory" in rows["1 tiny, bf16, 1 rank"]
    assert "timeout" in rows["2 v2-lite 2 layers, bf16"]
    assert "no snapshot buffers (no pinned-buffer path taken)" in rows["4 async checkpoint"]
    assert "DeepSpeed torch.save 1.000 s (10.0x)" in rows["4 async checkpoint"]
    assert "not run" in rows["5 latent-KV decode"] and "not run" in rows["3 planner vs measured"]
    checkpoint |= {"snapshot_buffer_bytes": 2e9, "pinned_fraction": 1.0}
    assert "100% of the 2.00 GB snapshot buffers pinned" in gpu_check.describe("checkpoint", checkpoint)
