"""Weight names between a recipe's PipelineModule and its transformers model.

The mapping follows the recipe's layer list: every layer class names the transformers
prefix of its tensors (``hf_prefix(config, **module_kwargs)``: "model." for the
embedding and the final norm, "model.layers.<i>." for decoder layer i, "" for the
head), and a PipelineModule names a layer's tensors ``"{position}.{name}"``, or
``"tied_modules.{key}.{name}"`` for a TiedLayerSpec (the embedding when
tie_word_embeddings or the MTP module shares it). A tied layer's later uses
(``forward_fn``: the tied head, the MTP module's embedding) hold no tensors. DeepSeek's
MTP layer is written as transformers layer L (``model.layers.61.enorm.weight``, ...).

MoE layers differ in two ways: routed expert e is its own module here
(``mlp.deepspeed_moe.experts.deepspeed_experts.<e>.gate_up_proj`` [2I, H], the names
DeepSpeed's expert checkpointing expects) and row e of transformers' packed
``mlp.experts.gate_up_proj`` [E, 2I, H]; and the shared experts are ``mlp.shared_mlp``
here (DeepSpeed treats any tensor named "expert" as routed), ``mlp.shared_experts``
there. With expert parallelism a module holds experts [first, first + local), and
index e here is global expert first + e.

Functions taking ``config`` build the layout from the registered recipe of that
config (recipes.spec_for); pass an ``HFLayout`` instead to reuse one.
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


class HFLayout:
    """Pipeline key prefix <-> transformers key prefix for each layer of ``specs``.
    Layers outside "model.layers.<i>." (the embedding and the final norm both write
    under "model.", the head under "") are told apart by their tensor names, from one
    build of each on the meta device."""

    def __init__(self, specs, config):
        self.config = config
        self.to_hf = {}                 # pipeline prefix -> transformers prefix
        self.file_prefix = {}           # position -> pipeline prefix of the layer file DeepSpeed writes for it
        owners = {}                     # transformers prefix -> [(pipeline prefix, spec)]
        for position, spec in enumerate(specs):
            if getattr(spec, "forward_fn", None) is not None:
                continue                # a tied layer's later use: no tensors of its own
            key = getattr(spec, "key", None)
            prefix = f"tied_modules.{key}." if key is not None else f"{position}."
            if prefix in self.to_hf:
                continue
            hf_prefix = getattr(spec.typename, "hf_prefix", None)
            if hf_prefix is None:
                raise KeyError(f"layer class {spec.typename.__name__} has no hf_prefix(config, **module_kwargs): "
                               f"say which transformers prefix its tensors have")
            self.to_hf[prefix] = hf_prefix(config, **spec.module_kwargs)
            self.file_prefix[position] = prefix
            owners.setdefault(self.to_hf[prefix], []).append((prefix, spec))
        self._from_hf = {}              # transformers prefix -> pipeline prefix, or {tensor name: pipeline prefix}
        for hf_prefix, layers in owners.items():
            single = len(layers) == 1 and _LAYER.match(hf_prefix + "x")    # a decoder layer's own prefix
            self._from_hf[hf_prefix] = layers[0][0] if single else {
                name: prefix for prefix, spec in layers for name in _tensor_names(spec)}
        self._longest_first = sorted(self._from_hf, key=len, reverse=True)
        self.tied_head = bool(getattr(config, "tie_word_embeddings", False))

    @classmethod
    def of(cls, config):
        if isinstance(config, HFLayout):
            return config
        from recipes import spec_for
        return cls(spec_for(config).layer_specs(config, seed=0), config)

    def hf_tensor(self, key):
        """(transformers key, expert index or None) of a PipelineModule key."""
        return pipeline_to_hf_key(key, self)

    def state_dict_to_hf(self, state_dict):
        """A PipelineModule state dict (or a piece of one) in transformers' names."""
        return to_hf_state_dict(state_dict, self)

    def hf_key(self, key):
        for prefix, hf_prefix in self.to_hf.items():
            if key.startswith(prefix):
                return hf_prefix + key[len(prefix):]
        raise KeyError(f"{key}: not a tensor of this recipe's layers ({sorted(self.to_hf)})")

    def pipeline_key(self, hf_key):
        """The pipeline key of a transformers key, or None for the tied head."""
        if hf_key == "lm_head.weight" and self.tied_head:
            return None
        for hf_prefix in self._longest_first:
            if not hf_key.startswith(hf_prefix):
                continue
            name, target = hf_key[len(hf_prefix):], self._from_hf[hf_prefix]
            if _LAYER.match(hf_key) and not _LAYER.match(hf_prefix + "x"):
                break           # model.layers.<i>. of a layer this model does not have
            if isinstance(target, dict):
                if name.split(".")[0] not in {n.split(".")[0] for n in target}:
                    break
                target = next(p for n, p in target.items() if n.split(".")[0] == name.split(".")[0])
            return target + name
        layer = _LAYER.match(hf_key)
        if layer:
            raise KeyError(f"{hf_key}: layer {layer.group(1)} beyond this recipe's layers "
                           f"(num_hidden_layers={self.config.num_hidden_layers}"
                           f"{', +1 MTP layer' if getattr(self.config, 'num_mtp_layers', 0) else ''})")
        raise KeyError(f"{hf_key}: not a weight of this recipe's transformers model")


def _tensor_names(spec):
    import torch
    with torch.device("meta"):
        return list(spec.build().state_dict())


def embedding_is_tied(config):
    return config.tie_word_embeddings or config.num_mtp_layers > 0


def hf_to_pipeline_key(key, config):
    """The PipelineModule key of a transformers key, or None for tensors with no
    weight of their own here (a tied lm_head). For packed experts the key keeps the
    packed form (``<p>.mlp.experts.gate_up_proj``); ``expert_key`` names one expert."""
    target = HFLayout.of(config).pipeline_key(key)
    return None if target is None else _from_hf_name(target)


def pipeline_to_hf_key(key, config):
    """(transformers key, expert index or None) of a PipelineModule key: expert
    tensors map to a row of the packed transformers tensor."""
    name, index = _to_hf_name(key)
    return HFLayout.of(config).hf_key(name), index


def first_expert(module):
    """Global index of the first routed expert ``module`` holds (0 without expert parallelism)."""
    from .moe import DeepSeekMoE
    return next((m.first_expert() for m in module.modules() if isinstance(m, DeepSeekMoE)), 0)


def load_hf_state_dict(module, hf_state_dict, config):
    """Copy transformers weights into ``module`` (a PipelineModule holding any subset
    of the layers, or a SequentialReference). Every parameter and persistent buffer
    of ``module`` must be covered; returns the number of tensors loaded."""
    offset, layout = first_expert(module), HFLayout.of(config)
    mapped = {}
    for key in module.state_dict():
        hf_key, index = pipeline_to_hf_key(key, layout)
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
    out, experts, layout = {}, {}, HFLayout.of(config)
    for key, tensor in state_dict.items():
        hf_key, index = pipeline_to_hf_key(key, layout)
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
    """The other direction: copy a whole-model recipe state dict into the recipe's
    transformers model. Returns the number of tensors copied."""
    import torch
    layout = HFLayout.of(config)
    source = to_hf_state_dict(state_dict, layout)
    copied = 0
    with torch.no_grad():
        for key, tensor in hf_model.state_dict().items():
            if hf_to_pipeline_key(key, layout) is None:
                continue   # tied head
            if key not in source:
                raise KeyError(f"{key}: not in the recipe's state dict")
            tensor.copy_(source[key])
            copied += 1
    return copied
