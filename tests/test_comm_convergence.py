"""Compressed gradients still train: the tiny recipe on 2 data-parallel ranks through
the real deepspeed launcher, 300 steps at the size of benchmarks/compression_convergence.py
(the README's figures), SGD with momentum 0.9 (DGC's setting). Top-k 1 % with DGC's
momentum correction and error feedback and PowerSGD rank 4 (embedding and head dense,
its default) end within 5 % of the dense run; top-k without error feedback is
measurably worse. (int8, +0.1 to +0.3 %, PowerSGD without error feedback, +8.2 %, and
AdamW's figures are in the README, measured by the benchmark: one more run here costs
over a minute and a half of CI, and int8's arithmetic and error feedback are checked
exactly in test_comm.py and test_comm_engine.py; test_comm.py shows PowerSGD's error feedback delivering what compression held
back. Shorter or smaller runs were too noisy to tell these apart: at 64 tokens a
sequence the dense run ended behind int8's.) About 6 minutes.

A behavioural bound, not a derived one: 300 steps amplify every last-bit difference, so
the compressed-to-dense ratio moves with the seed and with the CPU's kernels. Measured
with this command: PowerSGD -1.2 % (default kernels), +0.5 % and -1.5 % (seeds 1, 2),
+3.0 % (ATEN_CPU_CAPABILITY=avx2, 2 threads); top-k DGC +0.7 % / -1.3 %, int8 +0.3 % /
+0.2 % (default / avx2). 5 % holds that spread with room and still fails a compressor
that has lost its error feedback (top-k without it: +14.3 % / +9.3 %)."""

import pytest

pytestmark = pytest.mark.e2e


def test_compressed_runs_end_near_the_dense_run():
    from benchmarks.compression_convergence import main
    from recipes import deepseek_v3
    from recipes.layers.pipe import count_parameters
    rows = main(["--optimizer", "sgd", "--lr", "0.3", "--runs", "none", "topk-1%-dgc", "topk-1%-no-ef",
                 "powersgd-r4-ef"])
    by = {r["name"]: r for r in rows}
    dense = by["none"]["final_loss"]
    assert dense < by["none"]["first_loss"] - 3.0          # it trained
    near = 1.05          # the measured spread over seeds and kernels, with room (docstring)
    assert by["topk-1%-dgc"]["final_loss"] < dense * near, rows
    assert by["topk-1%-no-ef"]["final_loss"] > by["topk-1%-dgc"]["final_loss"] * 1.05, rows
    assert by["powersgd-r4-ef"]["final_loss"] < dense * near, rows
    # the compressed runs sent what the compressors say: top-k 1 % (values and indices,
    # the small tensors dense) about 2 % of a dense fp32 ring all-reduce over 2 ranks
    config = deepseek_v3.make_config("tiny")
    dense_mb = 4 * sum(count_parameters(spec) for spec in deepseek_v3.layer_specs(config, seed=0)) / 1e6
    assert by["topk-1%-dgc"]["wire_mb_per_step"] < 0.05 * dense_mb, (by["topk-1%-dgc"]["wire_mb_per_step"], dense_mb)
