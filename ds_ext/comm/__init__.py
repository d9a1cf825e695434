"""Compressed data-parallel gradient communication for DeepSpeed's pipeline engines
(``seekspeed.comm`` in the config): ``compressors`` (top-k, PowerSGD, int8, casts),
``reducer`` (chunked, pipelined, hierarchical; counters) and ``install`` (the engine
mixin and the config changes it needs)."""

from .compressors import COMPRESSORS, make_compressor
from .reducer import GradientReducer, ReduceStats

__all__ = ["COMPRESSORS", "make_compressor", "GradientReducer", "ReduceStats"]
