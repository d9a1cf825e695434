"""Layer rows: per layer spec of a recipe, what the planner costs it by, from one build
of each distinct layer on the meta device."""


def layer_rows(specs, config, recipe):
    """Per spec a row: the recipe's kind for it, whether DeepSpeed checkpoints it (its
    class is in the recipe's checkpointable_layers), parameters, routed-expert
    parameters (the spec's ``routed_experts``), activated parameters, and the (rows,
    cols) of each 2-D+ tensor, routed expert or not ({True: [...], False: [...]}), all
    of them (``matrices``) and those DeepSpeed's Muon orthogonalises (``muon``, named as
    the PipelineModule names them: a tied spec under ``tied_modules.<key>``)."""
    import torch
    from ds_ext.muon import muon_matrices
    cache, rows = {}, []
    kinds = recipe.layer_kinds(specs, config)
    for index, (spec, kind) in enumerate(zip(specs, kinds)):
        tied = getattr(spec, "key", None)
        key = (spec.typename.__name__, kind, getattr(spec, "forward_fn", None), tied)
        if key not in cache:
            with torch.device("meta"):
                module = spec.build()
            expert_ids = recipe.expert_parameter_ids(module)
            matrices = {True: [], False: []}
            for p in module.parameters():
                if p.dim() >= 2:
                    matrices[id(p) in expert_ids].append((p.shape[0], p.numel() // p.shape[0]))
            experts = sum(p.numel() for p in module.parameters() if id(p) in expert_ids)
            muon = muon_matrices(module, prefix=f"tied_modules.{tied}" if tied else str(index), expert_ids=expert_ids)
            cache[key] = (sum(p.numel() for p in module.parameters()), experts, recipe.activated_parameters([spec]),
                          matrices, muon)
        params, experts, active, matrices, muon = cache[key]
        rows.append({"kind": kind, "checkpointable": spec.typename.__name__ in recipe.checkpointable_layers,
                     "params": params, "experts": experts, "active": active, "matrices": matrices, "muon": muon})
    return rows
