"""seekspeed's C++ kernels, built on first use with torch.utils.cpp_extension (as
DeepSpeed builds its own ops: about half a minute, cached under TORCH_EXTENSIONS_DIR,
by default ~/.cache/torch_extensions).

``topk_select()``: the fused accumulate-and-select pass of sampled top-k on CPU
(csrc/topk_select.cpp). None when it cannot be built (no compiler): the caller then
uses torch ops, which give the same result in more passes over memory.
"""

import os

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_built = {}


def topk_select(*, required=False):
    """The kernel module, or None when it cannot be built (``required``: raise instead)."""
    if "topk_select" not in _built:
        try:
            from torch.utils.cpp_extension import load
            _built["topk_select"] = load(name="seekspeed_topk_select",
                                         sources=[os.path.join(_CSRC, "topk_select.cpp")],
                                         extra_cflags=["-O3"], verbose=False)
        except Exception as exc:        # a missing compiler or headers: torch ops do the same work
            _built["topk_select"] = exc
    module = _built["topk_select"]
    if isinstance(module, Exception):
        if required:
            first = str(module).strip().splitlines()[0] if str(module).strip() else type(module).__name__
            raise RuntimeError(f"the fused top-k kernel (ds_ext/comm/csrc/topk_select.cpp) did not build: {first}; "
                               f"install a C++ compiler, or set seekspeed.comm.kernel to \"torch\"")
        return None
    return module
