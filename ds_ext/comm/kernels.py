"""seekspeed's C++ kernels, built on first use with torch.utils.cpp_extension (as
DeepSpeed builds its own ops: about half a minute, cached where ds_ext/ops.py says:
TORCH_EXTENSIONS_DIR, or the virtual environment's torch_extensions, in a directory
named after the source's hash, so checkouts with different sources do not share a
build; under ds_ext.ops.build_guard, so a killed build's lock stalls no later one).

``topk_select()``: the fused accumulate-and-select pass of sampled top-k on CPU
(csrc/topk_select.cpp); ``sign_codec()``: sign's block encode (scales, packed bits, the
residual in place; with target momentum the momentum formed in the same pass, reading M
as fp32 or as the codes it was kept as) and decode-and-add (csrc/sign_codec.cpp). Built
without floating-point contraction (no fused multiply-adds the torch ops they mirror
would not make). Both multithreaded with OpenMP through at::parallel_for. None when they
cannot be built (no C++ compiler, no ninja): the caller then uses torch ops, which do
the same work in more passes over memory.
"""

import hashlib
import os

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_built = {}


def _source_name(path, stem):
    with open(path, "rb") as f:
        return f"{stem}_{hashlib.sha256(f.read()).hexdigest()[:12]}"


def _load(stem):
    if stem not in _built:
        source = os.path.join(_CSRC, f"{stem}.cpp")
        try:
            from torch.utils.cpp_extension import load
            from ds_ext.ops import build_guard
            name = _source_name(source, f"seekspeed_{stem}")
            with build_guard(name):      # no launch waits in silence on a killed build's lock
                _built[stem] = load(name=name, sources=[source], extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"],
                                    extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:        # no compiler, headers or ninja: torch ops do the same work
            _built[stem] = exc
    return _built[stem]


def _module(stem, what, *, required):
    """The built module of csrc/<stem>.cpp, or None when it cannot be built (``required``:
    raise instead, naming ``what``)."""
    _load(stem)
    error = build_error(stem)
    if error is not None:
        if required:
            raise RuntimeError(f"{what} (ds_ext/comm/csrc/{stem}.cpp) did not build: {error}; install a C++ "
                               f"compiler and ninja, or set seekspeed.comm.kernel to \"torch\"")
        return None
    return _built[stem]


def topk_select(*, required=False):
    """The top-k kernel module, or None when it cannot be built (``required``: raise instead)."""
    return _module("topk_select", "the fused top-k kernel", required=required)


def sign_codec(*, required=False):
    """sign's codec module, or None when it cannot be built (``required``: raise instead)."""
    return _module("sign_codec", "sign's kernel", required=required)


def build_all():
    """Build (or load) both kernels at once, one compiler per core (on a clean cache about
    54 s for the two, against 85 s one after the other). Returns the stems that did not
    build."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda build: build(), (topk_select, sign_codec)))
    return [stem for stem in ("topk_select", "sign_codec") if build_error(stem)]


def build_error(stem="topk_select"):
    """Why a kernel did not build (one line), or None."""
    module = _built.get(stem)
    if isinstance(module, Exception):
        text = str(module).strip()
        return text.splitlines()[0] if text else type(module).__name__
    return None
