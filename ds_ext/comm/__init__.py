"""Compressed data-parallel gradient communication for DeepSpeed's pipeline engines
(``seekspeed.comm`` in the config): ``compressors`` (top-k, PowerSGD, int8, the
two-phase int4 and sign, casts), ``reducer`` (chunked, pipelined, hierarchical; the
momentum target; counters), ``install`` (the engine mixin, FrozenVarianceAdam),
``state`` (what a checkpoint holds of it) and ``traffic`` (bytes and memory, counted)."""

from .compressors import COMPRESSORS, make_compressor
from .reducer import GradientReducer, ReduceStats

__all__ = ["COMPRESSORS", "make_compressor", "GradientReducer", "ReduceStats"]
