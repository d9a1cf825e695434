"""transformers import/export: a trained pipeline checkpoint (tiny-moe, tied
embeddings, 2 stages x 2 replicas, expert-parallel degree 2) exports to config.json + safetensors that
AutoModelForCausalLM.from_pretrained loads offline with the same logits; training
starts from such a directory with each stage reading only its layers; bad
directories are refused naming the tensor and its expected shape.
Multi-rank (4 gloo ranks, twice) plus single-process checks; about 60 s."""

import glob
import json
import os

import pytest
import torch

from ds_ext.errors import ConfigError
from ds_ext.checkpoint import CheckpointError
from ds_ext.hf_io import check_hf_dir, export_hf, load_hf_into_module
from recipes import deepseek_v3
from recipes.layers.reference import SequentialReference
from tests.distributed import run_ranks
from tests.training import trainer_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {"tie_word_embeddings": True}


def _config(tmp_path, name, mutate):
    with open(os.path.join(ROOT, "ds_configs", "tiny_moe_cpu.json")) as f:
        cfg = json.load(f)
    cfg["seekspeed"]["recipe"]["overrides"] = dict(OVERRIDES)
    cfg["seekspeed"]["checkpoint"]["interval_steps"] = 0
    cfg["seekspeed"]["moe"]["expert_parallel_size"] = 2
    mutate(cfg)
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    cfg = _config(tmp, "train.json", lambda c: None)
    ckpt = tmp / "ckpt"
    res = run_ranks(trainer_rank, world_size=4, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "3", "--checkpoint-dir", str(ckpt)],))
    assert [r[0] for r in res] == [0] * 4, res
    out = tmp / "hf"
    export_hf(str(ckpt), str(out), max_shard_bytes=2**20, log=lambda *_: None)   # 1 MiB: several shards
    return tmp, ckpt, out


def _reference_from_checkpoint(ckpt):
    from ds_ext.hf_io import load_checkpoint_model
    return load_checkpoint_model(str(ckpt))[1]


@pytest.mark.multirank
def test_export_loads_in_transformers_with_the_same_logits(trained):
    from transformers import AutoModelForCausalLM
    _, ckpt, out = trained
    assert len(glob.glob(str(out / "model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    ours = _reference_from_checkpoint(ckpt)
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0          # trained routing biases travel with the weights
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours(ids)).abs().max().item() <= 1e-5


@pytest.mark.multirank
def test_training_starts_from_a_transformers_directory(trained, tmp_path):
    _, _, out = trained
    def mutate(c):
        c["seekspeed"]["init_from"] = str(out)
        c["optimizer"]["params"].update(lr=0.0, weight_decay=0.0)
        c.pop("scheduler")
        c["seekspeed"]["moe"]["bias_update_speed"] = 0.0
    cfg = _config(tmp_path, "init.json", mutate)
    ckpt, summary = tmp_path / "ckpt", tmp_path / "s.json"
    res = run_ranks(trainer_rank, world_size=4, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "1", "--checkpoint-dir", str(ckpt),
                           "--summary-json", str(summary)],))
    assert [r[0] for r in res] == [0] * 4, res
    counts = json.loads(summary.read_text())["init_from_tensors_per_rank"]
    with open(out / "model.safetensors.index.json") as f:
        total = len(json.load(f)["weight_map"])
    # one replica (ranks 0 and 2: stages 0 and 1, expert-parallel rank 0) reads every dense
    # tensor once, the tied embedding twice, and for each of the 3 MoE layers 2 weights x 4 of
    # its 8 experts (the other 4 are read by the replica's expert-parallel partner)
    packed = 3 * 2
    assert counts[0] + counts[2] == total + 1 - packed + 3 * 2 * 4
    assert counts == [counts[0], counts[0], counts[2], counts[2]]
    config = deepseek_v3.make_config("tiny-moe", OVERRIDES)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    ours = _reference_from_checkpoint(ckpt)   # lr 0: still the imported weights
    from recipes.layers.hf import to_hf_state_dict
    hf_state = hf.state_dict()
    for key, value in to_hf_state_dict(ours.state_dict(), config).items():
        assert torch.equal(value, hf_state[key]), key


def _small_hf_dir(tmp_path, mutate):
    """A transformers directory of the tiny recipe with one tensor removed or reshaped."""
    from safetensors.torch import save_file
    config = deepseek_v3.make_config("tiny")
    model = SequentialReference(deepseek_v3.layer_specs(config, seed=0))
    from recipes.layers.hf import to_hf_state_dict
    state = {k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), config).items()}
    mutate(state)
    d = tmp_path / "bad"
    d.mkdir()
    save_file(state, str(d / "model.safetensors"))
    config.to_hf_config().save_pretrained(str(d))
    return config, model, d


def test_missing_tensor_is_named_with_its_shape(tmp_path):
    config, model, d = _small_hf_dir(tmp_path, lambda s: s.pop("model.layers.2.self_attn.kv_b_proj.weight"))
    with pytest.raises(ConfigError, match=r"tensor model.layers.2.self_attn.kv_b_proj.weight is missing "
                                          r"\(expected shape \[256, 32\]\)"):
        load_hf_into_module(model, str(d), config)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path):
    def reshape(s):
        s["model.norm.weight"] = torch.ones(64)
    config, model, d = _small_hf_dir(tmp_path, reshape)
    with pytest.raises(ConfigError, match=r"tensor model.norm.weight has shape \[64\], expected \[128\]"):
        load_hf_into_module(model, str(d), config)


def test_other_model_and_bad_directories_are_refused(tmp_path):
    config, _, d = _small_hf_dir(tmp_path, lambda s: None)
    with pytest.raises(ConfigError, match="hidden_size 128 \\(recipe: 256\\)"):
        check_hf_dir(str(d), deepseek_v3.make_config("tiny", {"hidden_size": 256}))
    with pytest.raises(ConfigError, match="has no config.json"):
        check_hf_dir(str(tmp_path), config)
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        export_hf(str(tmp_path), str(tmp_path / "out"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export_hf(str(d), str(tmp_path / "full"))


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"num_mtp_layers": 1},
                                       {"num_mtp_layers": 1, "tie_word_embeddings": True}])
def test_names_round_trip(overrides):
    from recipes.layers.hf import hf_to_pipeline_key
    config = deepseek_v3.make_config("tiny-moe", overrides)
    state = SequentialReference(deepseek_v3.layer_specs(config, seed=0)).state_dict()
    from recipes.layers.hf import expert_key, is_packed_experts, to_hf_state_dict
    hf_state = to_hf_state_dict(state, config)
    hf_keys = set(hf_state)
    back = set()
    for k, v in hf_state.items():
        target = hf_to_pipeline_key(k, config)
        back |= {expert_key(target, e) for e in range(v.shape[0])} if is_packed_experts(k) else {target}
    assert back == set(state)
    assert "model.layers.1.mlp.experts.gate_up_proj" in hf_keys and hf_state[
        "model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 192, 128)
    if overrides.get("num_mtp_layers"):
        assert "model.layers.4.eh_proj.weight" in hf_keys and "model.layers.4.shared_head.norm.weight" in hf_keys
