"""Compressed gradients still train: the tiny recipe on 2 data-parallel ranks through
the real deepspeed launcher, 300 steps at the size of benchmarks/compression_convergence.py
(the README's figures), SGD with momentum 0.9 (DGC's setting). Top-k 1 % with DGC's
momentum correction and error feedback ends within 3 % of the dense run; without
error feedback it is measurably worse; PowerSGD rank 4 (embedding and head dense, its
default) within 3 %; int8 within 3 %. (PowerSGD without error feedback, +8.2 %, and
AdamW's figures are in the README, measured by the benchmark: one more run here costs
over a minute and a half of CI; test_comm.py shows PowerSGD's error feedback delivering
what compression held back. Shorter or smaller runs were too noisy to tell these
apart: at 64 tokens a sequence the dense run ended behind int8's.) About 8 minutes."""

import pytest

pytestmark = pytest.mark.e2e


def test_compressed_runs_end_near_the_dense_run():
    from benchmarks.compression_convergence import main
    rows = main(["--optimizer", "sgd", "--lr", "0.3", "--runs", "none", "topk-1%-dgc", "topk-1%-no-ef", "int8-ef",
                 "powersgd-r4-ef"])
    by = {r["name"]: r for r in rows}
    dense = by["none"]["final_loss"]
    assert dense < by["none"]["first_loss"] - 3.0          # it trained
    # measured (README, the same command): top-k DGC +0.7 %, top-k without error feedback +14.3 %, int8 +0.3 %
    assert by["topk-1%-dgc"]["final_loss"] < dense * 1.03, rows
    assert by["topk-1%-no-ef"]["final_loss"] > by["topk-1%-dgc"]["final_loss"] * 1.05, rows
    assert by["int8-ef"]["final_loss"] < dense * 1.03, rows
    # measured: PowerSGD rank 4 -1.2 % (other seeds +0.5 %, -1.5 %)
    assert by["powersgd-r4-ef"]["final_loss"] < dense * 1.03, rows
    # the compressed runs sent what the compressors say: top-k about 1 % of the dense bytes
    assert by["topk-1%-dgc"]["wire_mb_per_step"] < 0.1 * by["int8-ef"]["wire_mb_per_step"]
