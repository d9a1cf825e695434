"""Weight names between transformers' DeepseekV3ForCausalLM and the pipeline layers.

Pipeline layer positions of a recipe with L decoder layers:
    0        embedding
    1..L     decoder layers
    L+1      final norm                  (with MTP: L+1 MTP embedding, L+2 MTP layer,
    L+2      head                          L+3 final norm, L+4 head)
A PipelineModule names a layer's tensors ``"{position}.{name}"``; a tied embedding
(tie_word_embeddings, or shared with the MTP module) is ``"tied_modules.embed.{name}"``.
The MTP layer is written as transformers layer L, as in DeepSeek's released
checkpoints (``model.layers.61.enorm.weight``, ...).
"""

import re

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def positions(config):
    """Named pipeline positions of ``config``'s layer list."""
    layers = config.num_hidden_layers
    if config.num_mtp_layers:
        return {"mtp_embed": layers + 1, "mtp": layers + 2, "norm": layers + 3, "head": layers + 4}
    return {"norm": layers + 1, "head": layers + 2}


def embedding_is_tied(config):
    return config.tie_word_embeddings or config.num_mtp_layers > 0


def hf_to_pipeline_key(key, config):
    """The PipelineModule key of a transformers key, or None for tensors with no
    weight of their own here (a tied lm_head)."""
    pos = positions(config)
    layers = config.num_hidden_layers
    if key == "model.embed_tokens.weight":
        return "tied_modules.embed.embed_tokens.weight" if embedding_is_tied(config) else "0.embed_tokens.weight"
    match = _LAYER.match(key)
    if match:
        layer, name = int(match.group(1)), match.group(2)
        if layer < layers:
            return f"{1 + layer}.{name}"
        if layer == layers and "mtp" in pos:
            return f"{pos['mtp']}.{name}"
        raise KeyError(f"{key}: layer {layer} beyond num_hidden_layers={layers}"
                       f"{' (+1 MTP layer)' if 'mtp' in pos else ''}")
    if key == "model.norm.weight":
        return f"{pos['norm']}.norm.weight"
    if key == "lm_head.weight":
        return None if config.tie_word_embeddings else f"{pos['head']}.lm_head.weight"
    raise KeyError(f"{key}: not a DeepseekV3ForCausalLM weight this recipe knows")


def pipeline_to_hf_key(key, config):
    """The transformers key of a PipelineModule key (the inverse of hf_to_pipeline_key)."""
    if key.startswith("tied_modules.embed."):
        return "model." + key[len("tied_modules.embed."):]
    pos = positions(config)
    position, _, name = key.partition(".")
    position = int(position)
    if position == 0:
        return f"model.{name}"
    if position <= config.num_hidden_layers:
        return f"model.layers.{position - 1}.{name}"
    if position == pos.get("mtp"):
        return f"model.layers.{config.num_hidden_layers}.{name}"
    if position == pos["norm"]:
        return f"model.{name}"
    if position == pos["head"] and not config.tie_word_embeddings:
        return name
    raise KeyError(f"{key}: not a layer of this recipe's layout {pos}")


def load_hf_state_dict(module, hf_state_dict, config):
    """Copy transformers weights into ``module`` (a PipelineModule holding any subset
    of the layers, or a SequentialReference). Every parameter and persistent buffer
    of ``module`` must be covered; returns the number of tensors loaded."""
    own = module.state_dict()
    mapped = {}
    for key, value in hf_state_dict.items():
        target = hf_to_pipeline_key(key, config)
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
            source = hf_to_pipeline_key(key, config)
            if source is None:
                continue
            if source not in state_dict:
                raise KeyError(f"{key}: no {source} in the recipe's state dict")
            tensor.copy_(state_dict[source])
            copied += 1
    return copied
