"""transformers-format import and export.

Export reads a pipeline checkpoint of either engine (checkpoint.load) one layer file at a time and writes
config.json plus safetensors shards that ``AutoModelForCausalLM.from_pretrained``
loads. Import (``seekspeed.init_from``) fills a freshly built PipelineModule from
such a directory, each rank reading only the tensors of the layers it holds.
"""

import json
import os
import shutil
import tempfile

import torch

from .checkpoint.load import kind_of, open_tag
from .errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


# ---- what a checkpoint says about itself -------------------------------------------

def checkpoint_model_config(tag):
    """(recipe name, recipe config dict, the seekspeed meta) that seekspeed's trainer
    recorded in checkpoint ``tag`` (a checkpoint.load.Tag)."""
    models = tag.files("model")
    if not models:
        raise ConfigError(f"{tag.path} holds no mp_rank_*_model_states.pt: not a DeepSpeed checkpoint")
    state = tag.load(models[0])
    meta = (state.get("seekspeed") if isinstance(state, dict) else None) or {}
    if "model_config" not in meta:
        raise ConfigError(f"{tag.path} was not written by seekspeed's trainer (no model config in it)")
    return meta["recipe"], meta["model_config"], meta


def weight_files(tag):
    """The files read_weight_pieces reads from ``tag``."""
    if tag.files("layer"):
        return tag.files("layer")
    return tag.files("model") + tag.files("expert")


# ---- reading a checkpoint's weights, a piece at a time -------------------------------

def read_weight_pieces(tag, config):
    """Yield the model's weights in pieces, each a dict of PipelineModule keys (routed
    experts by global index). DeepSpeed writes two layouts: one file per pipeline
    layer (dense models), or, for models with MoE layers, each stage's dense weights
    in mp_rank_<stage>_model_states.pt plus one file per (stage, MoE layer, expert).
    A piece is one layer file, one stage's dense weights, or one MoE layer's experts.
    Every file is read through checkpoint.load (either engine's format, verified,
    restricted unpickling)."""
    from recipes import spec_for
    layers = {kind_of(name)[1]["layer"]: name for name in tag.files("layer")}
    if layers:
        prefixes = spec_for(config).hf_layout(config).file_prefix
        for position in sorted(layers):
            if position in prefixes:
                yield {prefixes[position] + k: v for k, v in tag.load(layers[position]).items()}
        return
    experts = {}
    for name in tag.files("expert"):
        index = kind_of(name)[1]
        experts.setdefault((index["mp"], index["moe_layer"]), []).append(name)
    for name in tag.files("model"):
        state = tag.load(name)
        module = state.get("module") if isinstance(state, dict) else None
        if not module:
            raise ConfigError(f"{tag.file(name)} holds no weights: not a complete checkpoint")
        yield dict(module)
    for key in sorted(experts):
        piece = {}
        for name in sorted(experts[key]):
            piece.update(tag.load(name))
        yield piece


def open_checkpoint(ckpt_dir, tag=None):
    """(checkpoint.load.Tag, recipe, recipe config, seekspeed meta) of a seekspeed
    checkpoint, every weight file checked (manifest, allowed types) before any is read."""
    from recipes import get_recipe
    ckpt = open_tag(ckpt_dir, tag)
    recipe_name, fields, meta = checkpoint_model_config(ckpt)
    ckpt.check(weight_files(ckpt))
    recipe = get_recipe(recipe_name)
    config = recipe.config_from_fields(fields, where="checkpoint model_config")
    return ckpt, recipe, config, meta


# ---- export ------------------------------------------------------------------------

class _ShardWriter:
    """Writes tensors into safetensors shards of at most ``max_bytes`` each."""

    def __init__(self, out_dir, max_bytes):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending, self.pending_bytes, self.files, self.weight_map, self.total = {}, 0, [], {}, 0

    def add(self, name, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total += nbytes

    def flush(self):
        from safetensors.torch import save_file
        if not self.pending:
            return
        name = f"shard-{len(self.files):05d}.tmp"
        save_file(self.pending, os.path.join(self.out_dir, name), metadata={"format": "pt"})
        self.files.append((name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self):
        self.flush()
        n = len(self.files)
        if n == 1:
            os.replace(os.path.join(self.out_dir, self.files[0][0]), os.path.join(self.out_dir, SINGLE))
            return [SINGLE]
        names = []
        for i, (tmp, keys) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, final))
            self.weight_map.update({k: final for k in keys})
            names.append(final)
        with open(os.path.join(self.out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": self.weight_map}, f, indent=2)
        return names


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def export_hf(ckpt_dir, out_dir, *, tag=None, max_shard_bytes=2 * 2**30, dtype=None, log=print):
    """Write ``out_dir`` (config.json + safetensors) from a pipeline checkpoint, one
    piece of the checkpoint in memory at a time. Nothing appears at ``out_dir``
    unless the whole export succeeds."""
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"--out {out_dir} exists and is not empty: choose a new directory")
    ckpt, recipe, config, _ = open_checkpoint(ckpt_dir, tag)
    if recipe.hf is None:
        raise ConfigError(f"recipe {recipe.name} has no transformers counterpart (its spec's hf is None): it cannot "
                          f"be exported; give its RecipeSpec a TransformersAdapter (recipes/spec.py)")
    layout = recipe.hf_layout(config)
    tag_dir = ckpt.path
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        writer, written, saved_dtype = _ShardWriter(tmp, max_shard_bytes), set(), None
        for number, piece in enumerate(read_weight_pieces(ckpt, config)):
            for name, tensor in layout.state_dict_to_hf(piece).items():
                if name in written:       # a tied embedding appears on two stages
                    continue
                written.add(name)
                saved_dtype = saved_dtype or tensor.dtype
                if dtype is not None and tensor.is_floating_point() and not name.endswith("e_score_correction_bias"):
                    tensor = tensor.to(_DTYPES[dtype])
                writer.add(name, tensor)
            log(f"export: piece {number + 1} ({len(written)} tensors so far)")
        expected = _expected_hf_keys(recipe, config, layout)
        if written != expected:
            missing = sorted(expected - written)[:3]
            raise ConfigError(f"{tag_dir}: the checkpoint lacks {missing}: incomplete checkpoint")
        files = writer.finish()
        hf_config = recipe.hf.to_hf_config(config)
        hf_config.dtype = _DTYPES[dtype] if dtype else saved_dtype
        hf_config.save_pretrained(tmp)
        if os.path.exists(out_dir):   # an existing empty directory
            _move_into(tmp, out_dir)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out_dir, "files": files, "bytes": writer.total, "tag_dir": tag_dir}


def _expected_hf_keys(recipe, config, layout):
    """Every transformers tensor name the recipe's model has (built on the meta device)."""
    keys = set()
    for position, spec in enumerate(recipe.layer_specs(config, seed=0)):
        if getattr(spec, "forward_fn", None) is not None:
            continue
        with torch.device("meta"):
            module = spec.build()
        prefix = f"tied_modules.{spec.key}." if hasattr(spec, "key") else f"{position}."
        keys.update(layout.hf_tensor(prefix + name)[0] for name in module.state_dict())
    return keys


def _move_into(tmp, out_dir):
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    os.rmdir(tmp)


# ---- import ------------------------------------------------------------------------

def check_hf_dir(hf_dir, config, *, where="seekspeed.init_from"):
    """The directory holds config.json and weights, and its config is this recipe's
    (the same transformers model_type and the spec's identity_fields)."""
    from recipes import spec_for
    recipe = spec_for(config)
    if recipe.hf is None:
        raise ConfigError(f"{where}: recipe {recipe.name} has no transformers counterpart (its spec's hf is None), so "
                          f"it cannot start from a transformers directory")
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"{where} {hf_dir} does not exist")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{where} {hf_dir} has no config.json: not a transformers model directory")
    if not (os.path.isfile(os.path.join(hf_dir, INDEX)) or os.path.isfile(os.path.join(hf_dir, SINGLE))):
        raise ConfigError(f"{where} {hf_dir} has neither {INDEX} nor {SINGLE}")
    with open(path) as f:
        theirs = json.load(f)
    ours = recipe.hf.to_hf_config(config).to_dict()
    if theirs.get("model_type") not in (None, ours.get("model_type")):
        raise ConfigError(f"{where} {hf_dir} is a {theirs['model_type']!r} model, and recipe {recipe.name} is "
                          f"{ours.get('model_type')!r}: choose the recipe of that model")
    keys = recipe.hf.identity_fields
    diff = [f"{k} {theirs.get(k)!r} (recipe: {ours.get(k)!r})" for k in keys if theirs.get(k) != ours.get(k)]
    if diff:
        raise ConfigError(f"{where} {hf_dir} is another model: {'; '.join(diff)}; set recipe.overrides to match")


def load_hf_into_module(module, hf_dir, config):
    """Copy the tensors of ``module``'s own layers from ``hf_dir``; returns how many.
    A missing or misshaped tensor is a ConfigError naming it and the expected shape."""
    from safetensors import safe_open
    from recipes import spec_for
    index_path = os.path.join(hf_dir, INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(hf_dir, SINGLE), framework="pt") as f:
            weight_map = {k: SINGLE for k in f.keys()}
    recipe = spec_for(config)
    offset, layout = recipe.first_expert(module), recipe.hf_layout(config)
    wanted = {}
    for key, tensor in module.state_dict().items():
        hf_key, index = layout.hf_tensor(key)
        expected = list(tensor.shape) if index is None else [config.n_routed_experts] + list(tensor.shape)
        if hf_key not in weight_map:
            raise ConfigError(f"init_from {hf_dir}: tensor {hf_key} is missing (expected shape {expected})")
        wanted.setdefault(weight_map[hf_key], []).append((hf_key, index, expected, tensor))
    loaded = 0
    with torch.no_grad():
        for file, items in sorted(wanted.items()):
            with safe_open(os.path.join(hf_dir, file), framework="pt") as f:
                for hf_key, index, expected, target in items:
                    source = f.get_slice(hf_key)
                    shape = list(source.get_shape())
                    if shape != expected:
                        raise ConfigError(f"init_from {hf_dir}: tensor {hf_key} has shape {shape}, expected {expected}")
                    # a routed expert reads only its own row of the packed tensor
                    target.copy_(f.get_tensor(hf_key) if index is None else source[offset + index])
                    loaded += 1
    return loaded


# ---- a whole model in one process (generation, inspection) --------------------------

def load_checkpoint_model(ckpt_dir, *, tag=None):
    """(recipe config, SequentialReference, training meta) from a pipeline checkpoint
    (recipes.spec_for(config) is its recipe)."""
    ckpt, recipe, config, meta = open_checkpoint(ckpt_dir, tag)
    model = recipe.reference(recipe.layer_specs(config, seed=0))
    state = {}
    for piece in read_weight_pieces(ckpt, config):
        state.update(piece)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise ConfigError(f"{ckpt.path}: no tensor for {missing[:3]}: incomplete checkpoint")
    model.load_state_dict({k: state[k] for k in model.state_dict()})
    return config, model.eval(), meta


def recipe_of_hf_dir(hf_dir, *, where="--hf"):
    """The registered recipe whose transformers model_type the directory's config.json names."""
    from recipes import RECIPES, get_recipe
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{where} {hf_dir} has no config.json: not a transformers model directory")
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    specs = [get_recipe(n) for n in RECIPES]
    for spec in specs:
        if spec.hf is not None and spec.hf.model_type() == model_type:
            return spec
    known = {s.name: s.hf.model_type() for s in specs if s.hf is not None}
    raise ConfigError(f"{where} {hf_dir} holds a {model_type!r} model, and no registered recipe is one "
                      f"({known}): register a recipe whose TransformersAdapter has that model")


def load_hf_model(hf_dir):
    """(recipe spec, recipe config, SequentialReference) from a transformers-format
    directory, the recipe found by its model_type."""
    recipe = recipe_of_hf_dir(hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        fields = recipe.hf.from_hf_config(json.load(f))
    config = recipe.config_from_fields(fields, where=f"{hf_dir}/config.json")
    check_hf_dir(hf_dir, config, where="--hf")
    model = recipe.reference(recipe.layer_specs(config, seed=0))
    load_hf_into_module(model, hf_dir, config)
    return recipe, config, model.eval()
