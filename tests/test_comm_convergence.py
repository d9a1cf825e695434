"""Compressed gradients still train: the tiny recipe on 2 data-parallel ranks through
the real deepspeed launcher, 300 steps at the size of benchmarks/compression_convergence.py
(the README's figures), SGD with momentum 0.9 (DGC's setting). Top-k 1 % with DGC's
momentum correction and error feedback, PowerSGD rank 4 (embedding and head dense, its
default) and int8 end within 5 % of the dense run; top-k without error feedback is
measurably worse. (PowerSGD without error feedback, +8.2 %, and AdamW's figures are in
the README, measured by the benchmark: one more run here costs over a minute and a half
of CI; test_comm.py shows PowerSGD's error feedback delivering what compression held
back. Shorter or smaller runs were too noisy to tell these apart: at 64 tokens a
sequence the dense run ended behind int8's.) About 8 minutes.

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
    rows = main(["--optimizer", "sgd", "--lr", "0.3", "--runs", "none", "topk-1%-dgc", "topk-1%-no-ef", "int8-ef",
                 "powersgd-r4-ef"])
    by = {r["name"]: r for r in rows}
    dense = by["none"]["final_loss"]
    assert dense < by["none"]["first_loss"] - 3.0          # it trained
    near = 1.05          # the measured spread over seeds and kernels, with room (docstring)
    assert by["topk-1%-dgc"]["final_loss"] < dense * near, rows
    assert by["topk-1%-no-ef"]["final_loss"] > by["topk-1%-dgc"]["final_loss"] * 1.05, rows
    assert by["int8-ef"]["final_loss"] < dense * near, rows
    assert by["powersgd-r4-ef"]["final_loss"] < dense * near, rows
    # the compressed runs sent what the compressors say: top-k about 1 % of the dense bytes
    assert by["topk-1%-dgc"]["wire_mb_per_step"] < 0.1 * by["int8-ef"]["wire_mb_per_step"]
