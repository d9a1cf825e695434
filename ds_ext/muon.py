"""DeepSpeed's Muon on a seekspeed model: which parameters Newton-Schulz orthogonalises
and which go to the auxiliary Adam.

``deepspeed.set_optimizer_flags`` tags every parameter of two or more dimensions
``use_muon`` except the embedding and the head. A layer marks a matrix-shaped parameter
that is not a linear map (a position bias, a table) with ``muon_exempt(param)``, and
``muon_split`` sends it to the auxiliary Adam as well (the recipe contract,
recipes/spec.py).
"""

from ds_ext.errors import ConfigError

MUON_EXEMPT = "muon_exempt"


def uses_muon(ds):
    """Whether the DeepSpeed config ``ds`` (a dict) trains with DeepSpeed's Muon."""
    return str(ds.get("optimizer", {}).get("type", "")).lower() == "muon"


def muon_exempt(param):
    """``param`` (two or more dimensions, but not a linear map) takes Muon's auxiliary
    Adam instead of Newton-Schulz; returns it."""
    setattr(param, MUON_EXEMPT, True)
    return param


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
