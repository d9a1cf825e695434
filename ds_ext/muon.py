"""DeepSpeed's Muon on a seekspeed model: which parameters Newton-Schulz orthogonalises
and which go to the auxiliary Adam.

``deepspeed.set_optimizer_flags`` tags every parameter of two or more dimensions
``use_muon`` except the embedding and the head. A layer marks a matrix-shaped parameter
that is not a linear map (a position bias, a table) with ``muon_exempt(param)``, and
``muon_split`` sends it to the auxiliary Adam as well (the recipe contract,
recipes/spec.py).
"""

import functools

from ds_ext.errors import ConfigError

MUON_EXEMPT = "muon_exempt"
EAGER_MARK = "_seekspeed_eager"


# DeepSpeed's muon_update (deepspeed/runtime/zero/muon/original_muon.py): 5 Newton-Schulz
# steps, the "gram" form (iterating on the n x n Gram matrix, restarted at the third step)
NS_STEPS = 5


def newton_schulz_flops(rows, cols):
    """Matmul FLOPs of one ``muon_update`` of a (rows, cols) matrix, DeepSpeed's gram
    form: with n = min, m = max, R = X X^T (2 n^2 m), per step Z = bR + cR^2 and the
    updates of Q and R (2 n^3 each; the first step copies Q, the second and the last
    skip R's update), the restart X = QX and R = X X^T (4 n^2 m) and the final QX
    (2 n^2 m): 8 n^2 m + 28 n^3. A square matrix takes the standard iteration, 6 n^3 a
    step."""
    n, m = min(rows, cols), max(rows, cols)
    if m == n:
        return 6 * NS_STEPS * n ** 3
    return 8 * n * n * m + 28 * n ** 3


def muon_state_bytes(*, zero, grad_bytes, mixed):
    """Bytes per Muon-updated element the optimizer keeps: under ZeRO 1/2 the momentum
    and the copy each step stages it in (``_muon_staging_momentum``), both in the
    gradient's dtype, plus the fp32 master in mixed precision; at stage 0 the fp32
    momentum in the optimizer's state, plus the BF16 optimizer's fp32 master in mixed
    precision."""
    master = 4 if mixed else 0
    if zero == 0:
        return 4 + master
    return 2 * grad_bytes + master


def muon_matrices(module, *, prefix, expert_ids):
    """{True: routed-expert, False: other} (rows, cols) of the parameters of ``module``
    (named ``prefix`` + its own names, as the pipeline names them) that DeepSpeed's
    ``set_optimizer_flags`` and ``muon_exempt`` put on Newton-Schulz."""
    import torch
    from types import SimpleNamespace
    from deepspeed import set_optimizer_flags
    holder, node = torch.nn.Module(), None
    parent = holder
    *path, leaf = prefix.rstrip(".").split(".")
    for name in path:
        node = torch.nn.Module()
        parent.add_module(name, node)
        parent = node
    parent.add_module(leaf, module)
    set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params={}), holder)
    out = {True: [], False: []}
    for p in module.parameters():
        if p.use_muon and not getattr(p, MUON_EXEMPT, False):
            out[id(p) in expert_ids].append((p.shape[0], p.numel() // p.shape[0]))
    for p in module.parameters():
        for attr in ("use_muon", "muon_num_heads", "muon_head_dim"):
            if hasattr(p, attr):
                delattr(p, attr)
    return out


def uses_muon(ds):
    """Whether the DeepSpeed config ``ds`` (a dict) trains with DeepSpeed's Muon."""
    return str(ds.get("optimizer", {}).get("type", "")).lower() == "muon"


def muon_exempt(param):
    """``param`` (two or more dimensions, but not a linear map) takes Muon's auxiliary
    Adam instead of Newton-Schulz; returns it."""
    setattr(param, MUON_EXEMPT, True)
    return param


def check_muon_update(ds, section):
    """Refuse, in one line, ``seekspeed.muon_update`` set to "compiled" or "eager" when
    the optimizer is not DeepSpeed's Muon (the key would do nothing)."""
    if section.muon_update != "auto" and not uses_muon(ds):
        raise ConfigError(f"seekspeed.muon_update {section.muon_update!r} chooses how DeepSpeed's Muon runs its "
                          f"update, and optimizer.type is {ds.get('optimizer', {}).get('type')!r}: remove the key "
                          f"or set optimizer.type Muon")


def set_update(mode):
    """How DeepSpeed's ``muon_update`` (torch.compile'd) runs in this process:
    "compiled" as DeepSpeed ships it, "eager", or "auto": eager on the CPU accelerator,
    compiled elsewhere. On the CPU a compiled update breaks its graph at the
    accelerator's fp16 probe and recompiles per matrix shape and aspect (14 frames for
    DeepSeek-V4 tiny's matrices): its first step takes half a minute with an empty
    Inductor cache, which a CPU run of a few hundred steps does not earn back
    (benchmarks/muon_compile_cpu.py). Eager replaces the module's ``muon_update`` with a
    wrapper running it under ``set_stance("force_eager")``; ZeRO 0-3 and the BF16
    optimizer all look it up in its module at call time. Returns a line for the log."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.muon import original_muon
    current = original_muon.muon_update
    compiled = current.__wrapped__ if getattr(current, EAGER_MARK, False) else current
    if mode == "auto":
        mode = "eager" if get_accelerator().device_name() == "cpu" else "compiled"
    if mode == "compiled":
        original_muon.muon_update = compiled
        return "Muon: DeepSpeed's update compiled (torch.compile)"

    @functools.wraps(compiled)
    def muon_update(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return compiled(*args, **kwargs)
    setattr(muon_update, EAGER_MARK, True)
    original_muon.muon_update = muon_update
    return "Muon: DeepSpeed's update runs eagerly (seekspeed.muon_update)"


def muon_split(model, model_parameters):
    """Under DeepSpeed's Muon: after ``deepspeed.set_optimizer_flags`` has tagged the
    model's parameters, parameters a layer marked ``muon_exempt`` go to the
    auxiliary Adam; every parameter the optimizer is given must carry a tag. Returns
    the split as one line for the log (this rank's stage)."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
        if getattr(p, MUON_EXEMPT, False):
            p.use_muon = False
    params = [p for item in model_parameters for p in (item["params"] if isinstance(item, dict) else [item])]
    untagged = [names.get(id(p), f"a {tuple(p.shape)} tensor outside the model") for p in params
                if not hasattr(p, "use_muon")]
    if untagged:
        raise ConfigError(f"optimizer.type Muon: {len(untagged)} parameter(s) carry no use_muon tag ({untagged[0]}); "
                          "give the optimizer only the model's own parameters, or set param.use_muon = True/False "
                          "on the others")
    on = [p for p in params if p.use_muon]
    off = [names.get(id(p), "?") for p in params if not p.use_muon and p.dim() >= 2]
    return (f"Muon: {len(on)} matrices ({sum(p.numel() for p in on):,} elements) on Newton-Schulz, "
            f"{len(params) - len(on)} tensors ({sum(p.numel() for p in params if not p.use_muon):,} elements) "
            f"on the auxiliary Adam, of them matrix-shaped: "
            f"{sorted({'.'.join(n.split('.')[-2:]) for n in off}) or 'none'} (rank 0's stage)")
