"""Bounds for comparing two runs that do the same arithmetic up to the order of their
sums.

Two runs of the same model whose only difference is the order in which they add the
same terms (gradients of micro-batches, replicas, stage copies, tied layers; the
shards of an all-reduce) are not bitwise equal, but each differs from the exact sum
by at most ``gamma(k - 1) * sum(|terms|)`` elementwise, for any order of ``k`` terms
(Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4: recursive
summation; every summation tree of k terms has k - 1 roundings). Multiplying by a
power of two is exact. These bounds follow from fp32's unit roundoff and the number of
terms alone, so they hold on every CPU whatever its kernels; a test that uses them
says which terms it counts.
"""

import numpy as np

UNIT_ROUNDOFF = {np.dtype("float32"): 2.0**-24, np.dtype("float64"): 2.0**-53}
BF16 = "bfloat16"       # numpy has no bfloat16: 8 significant bits, unit roundoff 2^-8
UNIT_ROUNDOFF[BF16] = 2.0**-8


def gamma(n, dtype=np.float32):
    """gamma_n = n u / (1 - n u): the relative error bound of n roundings (``dtype`` a
    numpy float type or ``BF16``)."""
    u = UNIT_ROUNDOFF[dtype if dtype == BF16 else np.dtype(dtype)]
    assert n * u < 0.5, n
    return n * u / (1 - n * u)


def sum_error_bound(abs_sum, num_terms, dtype=np.float32):
    """Elementwise bound on |fl(sum) - sum| for ``num_terms`` terms whose absolute
    values sum to ``abs_sum``, added in any order in ``dtype``."""
    return gamma(max(num_terms - 1, 0), dtype) * np.asarray(abs_sum, dtype=np.float64)


def assert_within(got, want, bound, *, what):
    """|got - want| <= bound elementwise; the message names the worst element and how
    far over (or under) its bound it is."""
    got, want, bound = (np.asarray(x, dtype=np.float64) for x in (got, want, bound))
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = np.abs(got - want)
    over = err - bound
    i = int(np.argmax(over))
    assert over.flat[i] <= 0, (f"{what}: element {np.unravel_index(i, got.shape)} differs by {err.flat[i]:.3e}, "
                               f"its derived bound is {bound.flat[i]:.3e} (got {got.flat[i]!r}, want {want.flat[i]!r})")
    return float(np.max(err / np.maximum(bound, 1e-300))) if err.size else 0.0


def assert_sum_close(got, terms, *, divide_by=1, what="sum"):
    """``got`` is ``sum(terms) / divide_by`` (``divide_by`` a power of two, so exact) up
    to the order of the additions: within ``sum_error_bound`` of the exact sum, which is
    taken in float64 (its own error, k * 2^-53 of the absolute sum, is added)."""
    assert divide_by & (divide_by - 1) == 0, f"divide_by {divide_by} is not a power of two"
    stack = np.stack([np.asarray(t, dtype=np.float64) for t in terms])
    exact = stack.sum(axis=0) / divide_by
    abs_sum = np.abs(stack).sum(axis=0) / divide_by
    bound = sum_error_bound(abs_sum, len(terms)) + sum_error_bound(abs_sum, len(terms) + 1, np.float64)
    return assert_within(got, exact, bound, what=what)


def assert_same_checkpoint_weights(ckpt_a, ckpt_b, tag):
    """The model checkpoint ``tag`` of ``ckpt_a`` holds, bitwise, in ``ckpt_b``: read through
    the exporter's loader, so any two layouts (stages, replicas, experts) compare."""
    import torch
    from ds_ext.hf_io import load_checkpoint_model
    a = load_checkpoint_model(str(ckpt_a), tag=tag)[1].state_dict()
    b = load_checkpoint_model(str(ckpt_b), tag=tag)[1].state_dict()
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    differ = {k: int((a[k] != b[k]).sum()) for k in a if not torch.equal(a[k], b[k])}
    assert not differ, f"{tag}: {len(differ)} of {len(a)} tensors differ from {ckpt_a} (elements: " \
                       f"{dict(list(differ.items())[:3])})"


def saved_bytes_per_token(layer, x):
    """Bytes of the tensors autograd keeps for ``layer(x)`` (parameters not counted, each
    storage once), per token of ``x`` [batch, seq, ...]: what the planner's activation
    model is checked against."""
    import torch
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(kept.values()) / (x.shape[0] * x.shape[1])
