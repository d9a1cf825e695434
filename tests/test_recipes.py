"""Every registered recipe keeps its contract (recipes/spec.py): a new recipe is tested
by registering it in recipes/__init__.py.

Per recipe, on its "tiny" preset: every preset checks; the layer list builds on the
meta device with the parameter count of its transformers model, cut into stages by the
default partition; the planner costs every layer and plans a run; the classes the
spec names for activation checkpointing exist; a 2-rank, 2-step training run with
1f1b and with dualpipev-zb, whose checkpoint exports to the transformers format and
loads through AutoModelForCausalLM.from_pretrained with the same logits. Then the
silent traps of a copied recipe: each is a start-up error or warning naming the class.
"""

import importlib
import json
import os
import sys

import pytest
import torch

from recipes import RECIPES, get_recipe
from tests.distributed import run_ranks
from tests.training import trainer_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = sorted(RECIPES)


def _meta_params(module_or_specs):
    from ds_ext.pipe.partition import held_once
    specs = module_or_specs
    total = 0
    for i in held_once(specs, range(len(specs))):
        if getattr(specs[i], "forward_fn", None) is not None:
            continue
        with torch.device("meta"):
            total += sum(p.numel() for p in specs[i].build().parameters())
    return total


@pytest.mark.parametrize("name", NAMES)
def test_spec_builds_costs_and_cuts_its_model(name):
    from ds_ext.trainer import check_partition
    from recipes.layers.pipe import check_checkpointing, layer_warnings
    from ds_ext.pipe.partition import stage_parameter_counts
    spec = get_recipe(name)
    assert "tiny" in spec.presets, f"recipe {name} needs a 'tiny' preset (the CPU test shape)"
    for preset in spec.presets:
        spec.make_config(preset)
    config = spec.make_config("tiny")
    specs = spec.layer_specs(config, seed=0)
    names = {s.typename.__name__ for s in specs}
    assert set(spec.checkpointable_layers) & names, (spec.checkpointable_layers, names)
    check_checkpointing(spec, specs, interval=1)
    check_partition(spec.default_partition, specs, config, spec)
    kinds = spec.layer_kinds(specs, config)
    assert all(spec.planner.activation_bytes(config, k, seq_len=64, act_bytes=4) > 0 for k in kinds)
    assert any(spec.planner.attention_flops(config, k, seq_len=64) > 0 for k in kinds)
    assert layer_warnings(spec, specs, schedule="dualpipev-zb", checkpoint_interval=1) == []
    unique = _meta_params(specs)
    if spec.hf is not None:
        with torch.device("meta"):
            assert sum(p.numel() for p in spec.hf.model(config).parameters()) == unique
    for schedule in ("1f1b", "dualpipev"):
        rows = stage_parameter_counts(specs, stages=2, schedule=schedule, partition_method=spec.default_partition)
        assert rows[0]["unique_total"] == unique and all(r["params"] > 0 for r in rows), rows


def _run_config(tmp_path, name, schedule):
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4)
    cfg["pipeline"]["partition"] = "best"          # the spec's default_partition
    s = cfg["seekspeed"]
    s["recipe"] = {"name": name, "preset": "tiny"}
    s["schedule"] = schedule
    s["data"]["seq_len"] = 64
    s["checkpoint"]["interval_steps"] = 0
    path = tmp_path / f"{name}-{schedule}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev-zb"])
@pytest.mark.parametrize("name", NAMES)
def test_recipe_trains_plans_and_exports(name, schedule, tmp_path, capsys):
    from ds_ext.hf_io import export_hf, load_checkpoint_model
    from ds_ext.planner import make_plan
    cfg = _run_config(tmp_path, name, schedule)
    ckpt, summary = tmp_path / "ckpt", tmp_path / "summary.json"
    res = run_ranks(trainer_rank, world_size=2, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "2", "--checkpoint-dir", str(ckpt),
                           "--summary-json", str(summary)],))
    assert [r[0] for r in res] == [0, 0], res
    assert "warning" not in res[0][2], res[0][2]
    losses = json.loads(summary.read_text())["losses"]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses
    plan = make_plan(cfg, nodes=1, ranks_per_node=2)
    assert plan.step_seconds > 0 and len(plan.stages) == 2 and plan.fits
    if schedule != "1f1b" or get_recipe(name).hf is None:
        return
    from transformers import AutoModelForCausalLM
    out = tmp_path / "hf"
    export_hf(str(ckpt), str(out), log=lambda *_: None)
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert type(hf).__name__ == get_recipe(name).hf.model_class
    config, ours, _ = load_checkpoint_model(str(ckpt))
    ids = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours(ids)).abs().max().item() <= 1e-5
    # launch/generate.py decodes the exported directory with the recipe's own cache
    from launch.generate import main as generate
    assert generate(["--hf", str(out), "--prompt", "def f(", "--max-new-tokens", "8"]) == 0
    out_text, err = capsys.readouterr()
    assert out_text.startswith("def f(") and get_recipe(name).decoder.cache_name in err, err


# ---- a copied recipe's traps are start-up errors or warnings naming the class -------------

@pytest.fixture
def copied(tmp_path, monkeypatch):
    """recipes/deepseek_v3.py copied as a new user would: file renamed, config class
    renamed, the spec's name changed, registered."""
    with open(os.path.join(ROOT, "recipes", "deepseek_v3.py")) as f:
        source = f.read()
    source = source.replace("DeepseekV3Config", "MyModelConfig").replace('name="deepseek_v3"', 'name="my_model"')
    (tmp_path / "my_model.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(RECIPES, "my_model", "my_model")
    yield importlib.import_module("my_model")
    sys.modules.pop("my_model", None)


def test_a_copied_recipe_exports_and_generates_through_its_spec(copied, tmp_path):
    from ds_ext.hf_io import check_hf_dir, load_hf_model
    from recipes import spec_for
    from recipes.layers.hf import to_hf_state_dict
    from recipes.layers.reference import SequentialReference
    spec = get_recipe("my_model")
    config = spec.make_config("tiny")
    assert type(config).__name__ == "MyModelConfig" and spec_for(config) is spec
    model = SequentialReference(spec.layer_specs(config, seed=0)).eval()
    state = {k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), config).items()}
    from safetensors.torch import save_file
    save_file(state, str(tmp_path / "model.safetensors"))
    spec.hf.to_hf_config(config).save_pretrained(str(tmp_path))
    check_hf_dir(str(tmp_path), config)
    ids = torch.tensor([[1, 2, 3]])
    out = spec.decoder(model, config).generate(ids, max_new_tokens=3)
    assert out.shape == (1, 6)
    # a transformers directory maps to the first registered recipe of its model_type
    loaded_spec, _, loaded = load_hf_model(str(tmp_path))
    assert loaded_spec.name == "deepseek_v3"
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def _respec(module, **changes):
    import dataclasses
    return dataclasses.replace(module.SPEC, **changes)


def test_a_renamed_decoder_class_is_named_in_the_checkpointing_warning(copied):
    from recipes.layers.pipe import DecoderLayerPipe, layer_warnings

    class MyDecoderLayer(DecoderLayerPipe):
        pass

    def specs_fn(config, **kw):
        specs = copied.layer_specs(config, **kw)
        for s in specs:
            if s.typename is DecoderLayerPipe:
                s.typename = MyDecoderLayer
        return specs

    spec = _respec(copied, layer_specs=specs_fn)
    config = spec.make_config("tiny")
    warnings = layer_warnings(spec, spec.layer_specs(config, seed=0), schedule="1f1b", checkpoint_interval=1)
    assert any("4 layers of class MyDecoderLayer are not checkpointed" in w for w in warnings), warnings


def test_checkpointing_that_matches_no_layer_is_an_error(copied):
    from ds_ext.errors import ConfigError
    from recipes.layers.pipe import check_checkpointing
    spec = _respec(copied, checkpointable_layers=("DecoderLayer",))
    specs = spec.layer_specs(spec.make_config("tiny"), seed=0)
    check_checkpointing(spec, specs, interval=0)          # off: nothing to match
    with pytest.raises(ConfigError, match=r"checkpointable_layers \['DecoderLayer'\] name no layer class"):
        check_checkpointing(spec, specs, interval=2)


def test_a_plain_linear_is_named_under_a_zero_bubble_schedule(copied):
    from recipes.layers.pipe import DecoderLayerPipe, layer_warnings

    class PlainProjection(DecoderLayerPipe):
        def __init__(self, config, **kw):
            super().__init__(config, **kw)
            self.extra = torch.nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def specs_fn(config, **kw):
        specs = copied.layer_specs(config, **kw)
        specs[1].typename = PlainProjection
        return specs

    spec = _respec(copied, layer_specs=specs_fn, checkpointable_layers=("DecoderLayerPipe", "PlainProjection"))
    specs = spec.layer_specs(spec.make_config("tiny"), seed=0)
    assert layer_warnings(spec, specs, schedule="1f1b", checkpoint_interval=0) == []
    (warning,) = layer_warnings(spec, specs, schedule="dualpipev-zb", checkpoint_interval=0)
    assert "PlainProjection.extra is a torch.nn.Linear" in warning and "zero_bubble.Linear" in warning


def test_a_layer_the_planner_cannot_cost_is_named(copied):
    from deepspeed.pipe import LayerSpec
    from ds_ext.errors import ConfigError

    class Adapter(torch.nn.Module):
        def forward(self, x):
            return x

    spec = copied.SPEC
    config = spec.make_config("tiny")
    specs = spec.layer_specs(config, seed=0)
    with pytest.raises(ConfigError, match="planner cannot cost layer class Adapter"):
        spec.layer_kinds(specs[:2] + [LayerSpec(Adapter)] + specs[2:], config)


def test_a_recipe_section_the_recipe_does_not_read_is_refused():
    from ds_ext.config import parse_section
    from ds_ext.errors import ConfigError
    section = parse_section({"train": {"steps": 1}, "dsa": {"stage": "warmup"}})
    with pytest.raises(ConfigError, match="seekspeed.dsa is set, and recipe deepseek_v3 does not read it"):
        get_recipe("deepseek_v3").train_options(section)
