"""Layer rows: per layer spec of a recipe, what the planner costs it by, from one build
of each distinct layer on the meta device."""


def layer_rows(specs, config, recipe):
    """Per spec a row: the recipe's kind for it, whether DeepSpeed checkpoints it (its
    class is in the recipe's checkpointable_layers), parameters, routed-expert
    parameters (the spec's ``routed_experts``), activated parameters, and the (rows,
    cols) of each 2-D+ tensor, routed expert or not ({True: [...], False: [...]})."""
    import torch
    cache, rows = {}, []
    kinds = recipe.layer_kinds(specs, config)
    for spec, kind in zip(specs, kinds):
        key = (spec.typename.__name__, kind, getattr(spec, "forward_fn", None))
        if key not in cache:
            with torch.device("meta"):
                module = spec.build()
            expert_ids = recipe.expert_parameter_ids(module)
            matrices = {True: [], False: []}
            for p in module.parameters():
                if p.dim() >= 2:
                    matrices[id(p) in expert_ids].append((p.shape[0], p.numel() // p.shape[0]))
            experts = sum(p.numel() for p in module.parameters() if id(p) in expert_ids)
            cache[key] = (sum(p.numel() for p in module.parameters()), experts, recipe.activated_parameters([spec]),
                          matrices)
        params, experts, active, matrices = cache[key]
        rows.append({"kind": kind, "checkpointable": spec.typename.__name__ in recipe.checkpointable_layers,
                     "params": params, "experts": experts, "active": active, "matrices": matrices})
    return rows
