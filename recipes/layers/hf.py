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

MoE layers differ in two ways: routed expert e is its own module here
(``mlp.deepspeed_moe.experts.deepspeed_experts.<e>.gate_up_proj`` [2I, H], the names
DeepSpeed's expert checkpointing expects) and row e of transformers' packed
``mlp.experts.gate_up_proj`` [E, 2I, H]; and the shared experts are ``mlp.shared_mlp``
here (DeepSpeed treats any tensor named "expert" as routed), ``mlp.shared_experts``
there. With expert parallelism a module holds experts [first, first + local), and
index e here is global expert first + e.
"""

import re

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.*\.mlp)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(gate_up_proj|down_proj)$")
_PACKED = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")


def _to_hf_name(name):
    match = _EXPERT.match(name)
    if match:
        return f"{match.group(1)}.experts.{match.group(3)}", int(match.group(2))
    return name.replace(".mlp.shared_mlp.", ".mlp.shared_experts."), None


def _from_hf_name(name):
    return name.replace(".mlp.shared_experts.", ".mlp.shared_mlp.")


def expert_key(packed_key, index):
    """The key of expert ``index`` for a packed-expert key of either side."""
    match = _PACKED.match(packed_key)
    return f"{match.group(1)}.deepspeed_moe.experts.deepspeed_experts.{index}.{match.group(2)}"


def is_packed_experts(hf_key):
    return _PACKED.match(hf_key) is not None


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
    weight of their own here (a tied lm_head). For packed experts the key keeps the
    packed form (``<p>.mlp.experts.gate_up_proj``); ``expert_key`` names one expert."""
    target = _hf_to_pipeline_key(key, config)
    return None if target is None else _from_hf_name(target)


def _hf_to_pipeline_key(key, config):
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
    """(transformers key, expert index or None) of a PipelineModule key: expert
    tensors map to a row of the packed transformers tensor."""
    name, index = _to_hf_name(key)
    return _pipeline_to_hf_key(name, config), index


def _pipeline_to_hf_key(key, config):
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


def first_expert(module):
    """Global index of the first routed expert ``module`` holds (0 without expert parallelism)."""
    from .moe import DeepSeekMoE
    return next((m.first_expert() for m in module.modules() if isinstance(m, DeepSeekMoE)), 0)


def load_hf_state_dict(module, hf_state_dict, config):
    """Copy transformers weights into ``module`` (a PipelineModule holding any subset
    of the layers, or a SequentialReference). Every parameter and persistent buffer
    of ``module`` must be covered; returns the number of tensors loaded."""
    offset = first_expert(module)
    mapped = {}
    for key in module.state_dict():
        hf_key, index = pipeline_to_hf_key(key, config)
        if hf_key not in hf_state_dict:
            raise KeyError(f"no transformers weight {hf_key} for {key}")
        value = hf_state_dict[hf_key]
        mapped[key] = value if index is None else value[offset + index]
    module.load_state_dict(mapped, strict=True)
    return len(mapped)


def to_hf_state_dict(state_dict, config):
    """A whole-model recipe state dict (every expert, global indices) in transformers'
    names and layout (experts stacked)."""
    import torch
    out, experts = {}, {}
    for key, tensor in state_dict.items():
        hf_key, index = pipeline_to_hf_key(key, config)
        if index is None:
            out[hf_key] = tensor
        else:
            experts.setdefault(hf_key, {})[index] = tensor
    for hf_key, rows in experts.items():
        if sorted(rows) != list(range(len(rows))):
            raise KeyError(f"{hf_key}: experts {sorted(rows)} are not 0..{len(rows) - 1}")
        out[hf_key] = torch.stack([rows[i] for i in range(len(rows))])
    return out


def moe_layer_to_hf(state_dict):
    """One DeepSeekMoE layer's state dict (all experts, no expert parallelism) in the
    names and layout of transformers' DeepseekV3MoE (``experts.gate_up_proj`` [E, 2I, H],
    ``shared_experts.*``), to load into it on its own."""
    import torch
    out, experts = {}, {}
    for key, tensor in state_dict.items():
        name, index = _to_hf_name(f"layer.mlp.{key}")
        name = name[len("layer.mlp."):]
        if index is None:
            out[name] = tensor
        else:
            experts.setdefault(name, {})[index] = tensor
    for name, rows in experts.items():
        out[name] = torch.stack([rows[i] for i in range(len(rows))])
    return out


def copy_into_transformers(hf_model, state_dict, config):
    """The other direction: copy a whole-model recipe state dict into a transformers
    DeepseekV3ForCausalLM. Returns the number of tensors copied."""
    import torch
    source = to_hf_state_dict(state_dict, config)
    copied = 0
    with torch.no_grad():
        for key, tensor in hf_model.state_dict().items():
            if hf_to_pipeline_key(key, config) is None:
                continue   # tied head
            if key not in source:
                raise KeyError(f"{key}: not in the recipe's state dict")
            tensor.copy_(source[key])
            copied += 1
    return copied
