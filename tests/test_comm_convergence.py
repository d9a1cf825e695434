"""Compressed communication still trains, in the setting users train in: the tiny
recipe on 2 data-parallel ranks through the real deepspeed launcher, 60 steps of the
config's AdamW (lr schedule as ds_configs/tiny_cpu.json), at the size of
benchmarks/compression_convergence.py (the README's figures are its 300-step runs).
Adam's momentum sent as signs (1 bit per entry, target momentum after a 20-step dense
warm-up) ends near the dense run. About 100 s: two runs (150 steps took 175 s, the suite's
longest test, when the suite was over its budget).

The gradient compressors' settings (int4 with error feedback under AdamW, top-k with DGC
under SGD, PowerSGD, int8, and the seeds 0, 1, 2 of these) are measured by the benchmark,
not here: each run costs about a minute and a half of CI, and their arithmetic and error
feedback are checked exactly in test_comm.py, test_comm_engine.py and
test_comm_momentum.py. (int4's run left this test when the suite reached its 25-minute
budget; benchmarks/results/compression_adamw.json has it within 0.5 % of dense on every
seed.)

A behavioural bound, not a derived one: training amplifies every last-bit difference, so
the compressed-to-dense ratio moves with the seed and with the CPU's kernels. Measured
over seeds 0, 1, 2 at these 60 steps (-0.24 % to +6.53 % against dense,
`python benchmarks/compression_convergence.py --runs none momentum-sign --steps 60
--momentum-warmup 20 --seeds 0 1 2`, benchmarks/results/compression_adamw_60steps.json;
at 150 steps the same seeds ended -0.8 % to -3.4 %, compression_adamw_150steps.json):
BOUND_PCT holds that spread with room and still fails a momentum mode whose frozen
variance throws the weights (+95 % before the step floor in FrozenVarianceAdam, measured
at 150 steps; not remeasured at 60). It is
wider than the 3 % the 150-step run allowed, so a quiet few-percent regression is left to
the benchmark's 300-step runs."""

import pytest

pytestmark = pytest.mark.e2e

BOUND_PCT = 10.0


def test_adamw_runs_with_compressed_momentum_end_near_dense():
    from benchmarks.compression_convergence import main
    rows = main(["--runs", "none", "momentum-sign", "--steps", "60", "--momentum-warmup", "20"])
    by = {r["run"]: r for r in rows}
    dense = by["none"]["final_loss"]
    assert dense < by["none"]["first_loss"] - 3.0          # it trained
    assert by["momentum-sign"]["final_loss"] < dense * (1 + BOUND_PCT / 100), rows
    # what it sent: sign's 1 bit plus a scale per 256 entries is about 1/28 of the dense
    # fp32 ring's bytes (the small tensors dense)
    assert by["momentum-sign"]["bytes_per_step"] < by["none"]["dense_bytes_per_step"] / 16, rows
