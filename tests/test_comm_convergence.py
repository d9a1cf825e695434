"""Compressed communication still trains, in the setting users train in: the tiny
recipe on 2 data-parallel ranks through the real deepspeed launcher, 60 steps of the
config's AdamW (lr schedule as ds_configs/tiny_cpu.json), at the size of
benchmarks/compression_convergence.py. Adam's momentum sent as signs (1 bit per entry
plus a scale per 256, error feedback) against the same momentum mode sent uncompressed
(`momentum-fp32`): both freeze Adam's variance after the same 20-step dense warm-up, so
the two runs differ only by the compression. About 100 s: two runs.

The bound, derived from the dense run's own seed-to-seed spread: the dense AdamW run's
final loss (mean of the last 20 steps) over seeds 0-5 and 1234 at these 60 steps ranges
2.4933 to 2.5938, so two seeds of the same dense run end up to 4.03 % apart
(2.5938 / 2.4933 - 1; the standard deviation is 1.56 %). A compressed run that ends
within that of its uncompressed twin is as close as a reseeding moves the loss; more is
a compression defect. Measured (AMD EPYC Zen 4, AVX-512), before the momentum was made
of clipped gradients (commit daabc3b; this test passes after it): momentum-sign against
momentum-fp32 on the same seed -3.59 % to +0.65 % over those 7 seeds (seed 1234, this
test's: -0.05 %):
`python benchmarks/compression_convergence.py --runs none momentum-sign --steps 60
--momentum-warmup 20 --seeds 0 1 2 3 4 5 1234` (benchmarks/results/
compression_adamw_60steps_spread.json) and `--runs momentum-fp32 ...`
(compression_adamw_60steps_momentum_fp32.json).

Against dense itself the momentum mode is not within that spread at this length: freezing
the variance after 20 steps costs up to +17.2 % (momentum-fp32, seed 4) and momentum-sign
ends -0.21 % to +16.2 % from dense (150 steps: -1.45 % to +21.5 %,
compression_adamw_150steps_spread.json; both before daabc3b); at 300 steps with a 60-step
warm-up see benchmarks/results/compression_adamw.json. How long the
variance must warm up is the schedule's question (0/1 Adam's adaptive freezing), not the
compressor's, so it is the benchmark's to measure, not this test's.

The gradient compressors' settings (int4 with error feedback under AdamW, top-k with DGC
under SGD, PowerSGD, int8, and their seeds) are measured by the benchmark, not here:
each run costs about a minute and a half of CI, and their arithmetic and error feedback
are checked exactly in test_comm.py, test_comm_engine.py and test_comm_momentum.py."""

import pytest

pytestmark = pytest.mark.e2e

# the dense run's seed-to-seed spread at 60 steps (docstring): 2.5938 / 2.4933 - 1
SPREAD_PCT = 4.03


def test_momentum_sent_as_signs_ends_within_the_dense_seed_spread_of_the_uncompressed_momentum():
    from benchmarks.compression_convergence import main
    rows = main(["--runs", "momentum-fp32", "momentum-sign", "--steps", "60", "--momentum-warmup", "20"])
    by = {r["run"]: r for r in rows}
    plain, signs = by["momentum-fp32"], by["momentum-sign"]
    assert plain["final_loss"] < plain["first_loss"] - 3.0          # it trained
    assert signs["final_loss"] < plain["final_loss"] * (1 + SPREAD_PCT / 100), rows
    # what it sent: sign's 1 bit plus a scale per 256 entries is about 1/28 of the dense
    # fp32 ring's bytes (the small tensors dense)
    assert signs["bytes_per_step"] < plain["dense_bytes_per_step"] / 16, rows
