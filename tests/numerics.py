"""Comparing trained weights between two runs of the same model."""

import numpy as np


def assert_weights_close(got, ref, *, rel_l2=1e-6, max_abs=1e-5):
    """Per tensor: relative L2 difference <= ``rel_l2`` and no entry off by more than
    ``max_abs``. (Adam divides by sqrt(v), so fp32 roundoff in a near-zero gradient
    entry can move that one weight by a small fraction of lr; the L2 bound shows the
    tensor as a whole is the same.)"""
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    rel = {k: float(np.linalg.norm(np.asarray(got[k]) - np.asarray(v)) / max(float(np.linalg.norm(v)), 1e-30))
           for k, v in ref.items()}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= rel_l2, f"{worst}: relative L2 weight difference {rel[worst]:.3e}"
    diff = max(float(np.max(np.abs(np.asarray(got[k]) - np.asarray(v)))) for k, v in ref.items())
    assert diff <= max_abs, f"largest weight difference {diff:.3e}"
