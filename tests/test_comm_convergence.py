"""Compressed gradients still train: short runs of the tiny recipe on 2 data-parallel
ranks through the real deepspeed launcher (benchmarks/compression_convergence.py at
a small size), SGD with momentum 0.9 (DGC's setting). Top-k 1 % with DGC's momentum
correction and error feedback ends near the dense run; without error feedback it is
measurably worse; int8 and PowerSGD rank 4 stay close. 200 steps of 1,024 tokens per
rank; the 300-step figures, with AdamW too, are in the README. About 3.5 minutes."""

import pytest

pytestmark = pytest.mark.e2e


def test_compressed_runs_end_near_the_dense_run():
    from benchmarks.compression_convergence import main
    rows = main(["--optimizer", "sgd", "--lr", "0.3", "--steps", "200", "--micro-batch", "4", "--grad-accum", "4",
                 "--seq-len", "64", "--warmup", "5", "--runs", "none", "topk-1%-dgc", "topk-1%-no-ef", "int8-ef",
                 "powersgd-r4-ef"])
    by = {r["name"]: r for r in rows}
    dense = by["none"]["final_loss"]
    assert dense < by["none"]["first_loss"] - 1.0          # it trained
    # measured at this size: top-k DGC +3.5 %, top-k without error feedback +12.6 % (300 steps at the
    # benchmark's size: +0.75 % and +14 %, README)
    assert by["topk-1%-dgc"]["final_loss"] < dense * 1.05, rows
    assert by["topk-1%-no-ef"]["final_loss"] > by["topk-1%-dgc"]["final_loss"] * 1.05, rows
    assert by["int8-ef"]["final_loss"] < dense * 1.03, rows
    assert by["powersgd-r4-ef"]["final_loss"] < dense * 1.12, rows
    # the compressed runs sent what the compressors say: top-k about 1 % of the dense bytes
    assert by["topk-1%-dgc"]["wire_mb_per_step"] < 0.1 * by["int8-ef"]["wire_mb_per_step"]
