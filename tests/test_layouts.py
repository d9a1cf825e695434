"""The production configs' parallel layout and batch arithmetic for their world
sizes, checked without GPUs: ds_configs/128node.json (128 nodes x 8 GPUs) and
ds_configs/single_node.json (8 GPUs). Single process; about 5 s."""

import os

import pytest

from ds_ext.config import load_config
from ds_ext.errors import ConfigError
from recipes import deepseek_v3
from ds_ext.trainer import partition_for
from ds_ext.pipe.partition import stage_parameter_counts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(name, world):
    return load_config(os.path.join(ROOT, "ds_configs", name), world_size=world)


def test_128node_layout():
    cfg = _cfg("128node.json", 128 * 8)
    lay = cfg.layout
    assert (lay.pipe_stages, lay.data_parallel) == (4, 256)
    assert (lay.micro_batch, lay.grad_accum, lay.train_batch) == (1, 18, 4608)
    assert lay.train_batch == lay.micro_batch * lay.grad_accum * lay.data_parallel
    assert lay.tokens_per_step == 4608 * 4096 == 18_874_368
    assert lay.schedule == "dualpipev" and lay.grad_accum >= 2 * lay.pipe_stages
    assert cfg.ds["zero_optimization"]["stage"] == 1 and cfg.ds["bf16"]["enabled"] is True
    assert cfg.warnings == []


def test_single_node_layout():
    lay = _cfg("single_node.json", 8).layout
    assert (lay.pipe_stages, lay.data_parallel, lay.micro_batch, lay.grad_accum, lay.train_batch) == (4, 2, 1, 32, 64)
    assert lay.tokens_per_step == 64 * 4096


@pytest.mark.parametrize("name,world", [("128node.json", 1000), ("128node.json", 512), ("single_node.json", 4)])
def test_wrong_world_size_is_refused(name, world):
    with pytest.raises(ConfigError):
        _cfg(name, world)


@pytest.mark.parametrize("name,world", [("128node.json", 1024), ("single_node.json", 8)])
def test_stages_are_balanced_and_fit_the_model(name, world):
    cfg = _cfg(name, world)
    s = cfg.section
    config = deepseek_v3.make_config(s.recipe.preset, s.recipe.overrides)
    deepseek_v3.SPEC.check_stages(config, stages=cfg.layout.pipe_stages, schedule=s.schedule)
    rows = stage_parameter_counts(deepseek_v3.layer_specs(config, seed=0), stages=cfg.layout.pipe_stages,
                                  schedule=s.schedule, partition_method=partition_for(cfg, deepseek_v3.SPEC, config))
    params = [r["params"] for r in rows]
    assert max(params) / min(params) < 1.25, params
    # bf16 weights + fp32 gradient accumulation + ZeRO-1 shard of fp32 master/Adam states
    assert cfg.ds["data_types"]["grad_accum_dtype"] == "fp32"
    worst = max(params) * (2 + 4 + 12 / cfg.layout.data_parallel) / 2**30
    # leaves >= 26 GiB of an 80 GB (74.5 GiB) GPU for checkpointed activations and buffers
    assert worst < 48, f"model states alone need {worst:.1f} GiB per GPU"
