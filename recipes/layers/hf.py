"""Weight names between transformers' DeepseekV3ForCausalLM and the pipeline layers.

Pipeline layer ``p`` of a recipe is: 0 embedding, 1..L decoder layers, L+1 final
norm, L+2 head. A PipelineModule names a layer's parameters ``"{p}.{name}"``, or
``"tied_modules.embed.{name}"`` when embedding and head are tied.
"""

import re

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def hf_to_pipeline_key(key, *, num_hidden_layers, tie_word_embeddings):
    """The PipelineModule key of a transformers key, or None for keys with no weight
    here (the tied lm_head)."""
    if key == "model.embed_tokens.weight":
        return "tied_modules.embed.embed_tokens.weight" if tie_word_embeddings else "0.embed_tokens.weight"
    match = _LAYER.match(key)
    if match:
        layer = int(match.group(1))
        if layer >= num_hidden_layers:
            raise KeyError(f"{key}: layer {layer} beyond num_hidden_layers={num_hidden_layers}")
        return f"{1 + layer}.{match.group(2)}"
    if key == "model.norm.weight":
        return f"{num_hidden_layers + 1}.norm.weight"
    if key == "lm_head.weight":
        return None if tie_word_embeddings else f"{num_hidden_layers + 2}.lm_head.weight"
    raise KeyError(f"{key}: not a DeepseekV3ForCausalLM weight this recipe knows")


def pipeline_to_hf_key(key, *, num_hidden_layers, tie_word_embeddings):
    """The transformers key of a PipelineModule key (the inverse of hf_to_pipeline_key)."""
    if key.startswith("tied_modules.embed."):
        return "model." + key[len("tied_modules.embed."):]
    position, _, name = key.partition(".")
    position = int(position)
    if position == 0:
        return f"model.{name}"
    if position <= num_hidden_layers:
        return f"model.layers.{position - 1}.{name}"
    if position == num_hidden_layers + 1:
        return f"model.{name}"
    if position == num_hidden_layers + 2 and not tie_word_embeddings:
        return name
    raise KeyError(f"{key}: not a layer of a {num_hidden_layers}-layer recipe")


def load_hf_state_dict(module, hf_state_dict, config):
    """Copy transformers weights into ``module`` (a PipelineModule holding any subset
    of the layers, or a SequentialReference). Every parameter and persistent buffer
    of ``module`` must be covered; returns the number of tensors loaded."""
    own = module.state_dict()
    mapped = {}
    for key, value in hf_state_dict.items():
        target = hf_to_pipeline_key(key, num_hidden_layers=config.num_hidden_layers,
                                    tie_word_embeddings=config.tie_word_embeddings)
        if target is not None and target in own:
            mapped[target] = value
    missing = sorted(set(own) - set(mapped))
    if missing:
        raise KeyError(f"no transformers weight for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    module.load_state_dict(mapped, strict=True)
    return len(mapped)


def copy_into_transformers(hf_model, state_dict, config):
    """The other direction: copy a recipe state dict (PipelineModule keys) into a
    transformers DeepseekV3ForCausalLM. Returns the number of tensors copied."""
    import torch
    own = hf_model.state_dict()
    copied = 0
    with torch.no_grad():
        for key, tensor in own.items():
            source = hf_to_pipeline_key(key, num_hidden_layers=config.num_hidden_layers,
                                        tie_word_embeddings=config.tie_word_embeddings)
            if source is None:
                continue
            if source not in state_dict:
                raise KeyError(f"{key}: no {source} in the recipe's state dict")
            tensor.copy_(state_dict[source])
            copied += 1
    return copied
