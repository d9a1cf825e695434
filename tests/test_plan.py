"""The planner (launch/plan.py, ds_ext/profile/plan.py): parameter counts per pipeline
rank equal those of the PipelineModules DeepSpeed builds (2 gloo ranks, 1f1b and
dualpipev) and the total equals transformers' DeepseekV3 built on the meta device;
the activation model against the bytes autograd really keeps for our layers; the
bubble is the simulator's; the production configs fit an 80 GB GPU and a too-large
one is refused with its numbers. About 40 s."""

import json
import os

import pytest
import torch

from ds_ext.profile.plan import Hardware, layer_activation_bytes, make_plan
from tests.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(tmp_path, name, **changes):
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        cfg = json.load(f)
    for dotted, value in changes.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def _built_counts(schedule):
    from deepspeed.runtime.pipe.topology import ProcessTopology
    from recipes import deepseek_v3
    config = deepseek_v3.make_config("tiny")
    model = deepseek_v3.build_pipeline(config, topology=ProcessTopology(axes=["pipe", "data"], dims=[2, 1]),
                                       schedule=schedule)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_parameters_per_rank_equal_the_built_pipeline(tmp_path, schedule):
    path = _config(tmp_path, "tiny_cpu.json", **{"seekspeed.schedule": schedule})
    plan = make_plan(path, nodes=1, ranks_per_node=2)
    built = run_ranks(_built_counts, world_size=2, args=(schedule,), timeout=120)
    assert [st.params for st in plan.stages] == [built[0], built[1]]


def test_total_equals_transformers_deepseek_v3(tmp_path):
    from transformers import DeepseekV3ForCausalLM
    from recipes import deepseek_v3
    plan = make_plan(os.path.join(ROOT, "ds_configs", "128node.json"), nodes=128, ranks_per_node=8)
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "128node.json")))["seekspeed"]["recipe"]
    hf = deepseek_v3.make_config(cfg["preset"], cfg["overrides"]).to_hf_config()
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(hf)
    assert plan.total_params == sum(p.numel() for p in model.parameters())
    assert plan.total_params == sum(st.params for st in plan.stages)      # ep 1, untied: each layer once


def _saved_bytes_per_token(layer, x):
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(kept.values()) / (x.shape[0] * x.shape[1])


@pytest.mark.parametrize("preset,layer_idx,kind", [("tiny", 0, "dense"), ("tiny-moe", 1, "moe")])
@pytest.mark.parametrize("seq", [64, 128])
def test_activation_model_against_autograd(preset, layer_idx, kind, seq):
    """Within 15 % of what autograd keeps for our decoder layers (fp32, CPU: the math
    attention path keeps the softmax probabilities)."""
    from recipes import deepseek_v3
    from recipes.layers.pipe import DecoderLayerPipe
    config = deepseek_v3.make_config(preset)
    layer = DecoderLayerPipe(config, layer_idx=layer_idx, seed=0).train()
    measured = _saved_bytes_per_token(layer, torch.randn(2, seq, config.hidden_size, requires_grad=True))
    model = layer_activation_bytes(config, kind, seq_len=seq, act_bytes=4, fused_attention=False)
    assert abs(model - measured) / measured < 0.15, (model, measured)


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev", "dualpipev-zb"])
def test_bubble_is_the_simulators(tmp_path, schedule):
    from ds_ext.pipe.simulate import formula_bubble, simulate
    path = _config(tmp_path, "tiny_cpu.json", **{"seekspeed.schedule": schedule, "pipeline.stages": 2,
                                                 "gradient_accumulation_steps": 8})
    plan = make_plan(path, nodes=1, ranks_per_node=2)
    c = plan.chunk_costs
    sim = simulate(schedule, ranks=2, micro_batches=8, F=c["F"], B=c["B"], W=c["W"], comm=c["p2p"])
    assert plan.makespan == pytest.approx(sim.makespan) and plan.bubble == pytest.approx(sim.bubble)
    if schedule == "1f1b":   # no transfer time: DeepSpeed's 1F1B bubble is (stages - 1)(F + B)
        flat = simulate(schedule, ranks=2, micro_batches=8, F=c["F"], B=c["B"])
        assert flat.bubble == pytest.approx(formula_bubble("1f1b", ranks=2, F=c["F"], B=c["B"]))
    assert plan.step_seconds == pytest.approx(plan.makespan + plan.dp_seconds + plan.optimizer_seconds)


def test_production_configs_fit_and_report(tmp_path):
    from launch.plan import main
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"node-{i:03d} slots=8\n" for i in range(128)))
    out = tmp_path / "plan.json"
    assert main(["--deepspeed", os.path.join(ROOT, "ds_configs", "128node.json"), "--hostfile", str(hosts),
                 "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["fits"] and len(figures["stages"]) == 4 and figures["layout"]["data_parallel"] == 256
    assert all(st["total"] < 80e9 for st in figures["stages"])
    groups = {t["group"]: t for t in figures["traffic"]}
    assert groups["data-parallel"]["inter_bytes"] > 0 and groups["pipeline"]["inter_bytes"] > 0
    assert 0 < figures["bubble_fraction"] < 0.5


def test_compression_shrinks_the_inter_node_bytes(tmp_path):
    dense = make_plan(os.path.join(ROOT, "ds_configs", "128node.json"), nodes=128, ranks_per_node=8)
    path = _config(tmp_path, "128node.json", **{"seekspeed.comm": {"compressor": "powersgd", "rank": 4,
                                                                   "hierarchical": True}})
    comp = make_plan(path, nodes=128, ranks_per_node=8)
    d = next(t for t in comp.traffic if t.group == "data-parallel")
    assert d.inter_bytes_compressed < 0.5 * d.inter_bytes
    assert comp.dp_seconds < dense.dp_seconds


def test_too_large_config_is_refused(tmp_path, capsys):
    from launch.plan import main
    rc = main(["--deepspeed", os.path.join(ROOT, "ds_configs", "single_node.json"), "--nodes", "1",
               "--memory-gb", "40"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "pipeline rank 0 needs" in err and "of the 40 GB" in err and "optimizer" in err, err
    no_ckpt = make_plan(_config(tmp_path, "128node.json", **{"pipeline.activation_checkpoint_interval": 0}),
                        nodes=128, ranks_per_node=8, hardware=Hardware(memory_gb=60))
    assert not no_ckpt.fits and no_ckpt.stages[0].activations > no_ckpt.stages[0].activations_checkpointed
