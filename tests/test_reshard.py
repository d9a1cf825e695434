"""A checkpoint resumes on another layout (ds_ext/checkpoint/reshard.py): fewer or more
data-parallel replicas, another expert-parallel degree, another pipeline degree, under
1F1B and the zero-bubble DualPipeV, ZeRO-1 in fp32 and DeepSpeed's BF16 optimizer (bf16
with fp32 accumulation), through the real trainer with the tiered data pipeline (one
global order, continued at DeepSpeed's global_samples).

How each resumed run is checked against an uninterrupted one, fed the same rows:
- 1F1B and MoE: bitwise. The layouts are chosen so that every gradient is the same sum
  of two terms: 2 replicas x 1 micro-batch, 1 replica x 2 micro-batches, 1 stage x 2
  replicas add two micro-batches' gradients, each scaled by 1/2 (exact), in one
  commuting addition; expert parallelism changes no arithmetic (test_expert_parallel.py).
  Gradient clipping is on at 10, above every norm these runs reach: DeepSpeed sums the
  norm per ZeRO partition, so layouts with other partitions round it differently, and a
  binding clip would carry that last-bit difference into every weight.
- DualPipeV (zero bubble): it needs 4 micro-batches per replica, so 1 replica x 8 and
  2 x 4 add 8 terms in two associations: not bitwise. The first step after the change
  starts from the same weights on the same rows, so its per-micro-batch losses are the
  same and only their mean's rounding differs: within gamma_8 of the mean |loss|
  (tests/numerics.py). Later steps are not compared (no bound carries through Adam).

Refusals (single process, through the trainer's own check): the memory pipeline on another\ndegree, ZeRO stage 0, another model, a checkpoint from before layout records, each one\nline. The rest is multi-rank, through trainer.main on 2 and 4 harness ranks; about\n2.5 minutes.
"""

import json
import os
import shutil

import pytest

from tests.distributed import run_ranks
from tests.numerics import assert_same_checkpoint_weights, gamma
from tests.training import trainer_rank, write_config


def _cfg(tmp_path, name, *, base="tiny_cpu.json", stages=2, micro=2, gas=1, ep=1, schedule=None, engine="deepspeed",
         pipeline="tiered", bf16=False):
    def mutate(c):
        c.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas, gradient_clipping=10.0)
        if bf16:        # the production precision: DeepSpeed's BF16 optimizer, fp32 accumulation
            c.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
        c["pipeline"]["stages"] = stages
        s = c["seekspeed"]
        if schedule:
            s["schedule"] = schedule
        s["data"].update(seq_len=32, pipeline=pipeline)
        if pipeline == "tiered":
            s["data"].update(cache_dir=str(tmp_path / "cold"), rows_per_shard=256)
        s["checkpoint"].update(interval_steps=1, engine=engine)
        s["train"]["log_interval"] = 1
        s.setdefault("moe", {})["expert_parallel_size"] = ep
    path = write_config(tmp_path, base, mutate)
    target = tmp_path / f"{name}.json"
    shutil.move(path, target)
    return str(target)


def _train(tmp_path, cfg, *, world, steps, ckpt, resume_from=None, step=None):
    """Run the trainer; with ``resume_from``, first copy that run's checkpoint of ``step``
    into ``ckpt`` as the newest (a run that stopped there). Returns the summary."""
    if resume_from is not None:
        ckpt.mkdir()
        shutil.copytree(resume_from / f"global_step{step}", ckpt / f"global_step{step}")
        (ckpt / "latest").write_text(f"global_step{step}")
    summary = tmp_path / f"{ckpt.name}.summary.json"
    argv = ["--deepspeed", cfg, "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--summary-json", str(summary)]
    res = run_ranks(trainer_rank, world_size=world, init_dist=False, timeout=300,
                    args=(argv + (["--resume"] if resume_from is not None else []),))
    assert [r[0] for r in res] == [0] * world, res[0][1][-3000:] + res[0][2][-3000:]
    s = json.loads(summary.read_text())
    s["stdout"] = res[0][1]
    return s


@pytest.mark.multirank
def test_1f1b_resumes_on_fewer_and_more_replicas_and_stages_bitwise(tmp_path):
    # the uninterrupted run: 2 stages x 2 replicas x 1 micro-batch
    full = _train(tmp_path, _cfg(tmp_path, "p2d2", stages=2, gas=1), world=4, steps=8, ckpt=tmp_path / "full")
    # 1 stage x 2 replicas from its step 3 (pipeline degree 2 -> 1) ...
    one = _train(tmp_path, _cfg(tmp_path, "p1d2", stages=1, gas=1), world=2, steps=8, ckpt=tmp_path / "one",
                 resume_from=tmp_path / "full", step=3)
    assert "pipe_stages 2 -> 1" in one["stdout"] and "cutting it anew" in one["stdout"]
    # ... 2 stages x 1 replica x 2 micro-batches from that run's step 5 (data-parallel 2 -> 1, pipeline 1 -> 2) ...
    two = _train(tmp_path, _cfg(tmp_path, "p2d1", stages=2, gas=2), world=2, steps=8, ckpt=tmp_path / "two",
                 resume_from=tmp_path / "one", step=5)
    assert "data_parallel 2 -> 1" in two["stdout"]
    # ... and 2 stages x 2 replicas again from its step 7 (data-parallel 1 -> 2)
    three = _train(tmp_path, _cfg(tmp_path, "p2d2", stages=2, gas=1), world=4, steps=8, ckpt=tmp_path / "three",
                   resume_from=tmp_path / "two", step=7)
    assert "data_parallel 1 -> 2" in three["stdout"]
    assert (one["start_step"], two["start_step"], three["start_step"]) == (3, 5, 7)
    assert one["losses"] == full["losses"][3:]
    assert two["losses"] == full["losses"][5:]
    assert three["losses"] == full["losses"][7:]
    for run in ("one", "two", "three"):      # and every weight (losses alone can hide a last-bit difference)
        assert_same_checkpoint_weights(tmp_path / "full", tmp_path / run, "global_step8")
    assert max(full["losses"][:2]) > full["losses"][-1]          # it trained


@pytest.mark.multirank
def test_moe_in_bf16_resumes_with_expert_parallel_two_on_one_replica_bitwise(tmp_path):
    """The production settings: bf16 with fp32 accumulation (DeepSpeed's BF16 optimizer),
    async-zstd checkpoints, experts split over the replicas."""
    kw = dict(base="tiny_moe_cpu.json", engine="async-zstd", bf16=True)
    full = _train(tmp_path, _cfg(tmp_path, "ep2", gas=1, ep=2, **kw), world=4, steps=4, ckpt=tmp_path / "full")
    # 2 stages x 2 replicas, experts split over both -> 2 stages x 1 replica, all experts on it
    resumed = _train(tmp_path, _cfg(tmp_path, "ep1", gas=2, ep=1, **kw), world=2, steps=4,
                     ckpt=tmp_path / "resumed", resume_from=tmp_path / "full", step=2)
    assert "expert_parallel_size 2 -> 1" in resumed["stdout"]
    assert resumed["losses"] == full["losses"][2:]
    assert_same_checkpoint_weights(tmp_path / "full", tmp_path / "resumed", "global_step4")
    # the routers' correction biases came along: the same expert loads after the change
    assert resumed["moe"]["expert_load"] == full["moe"]["expert_load"]


def _within_mean_rounding(got, want, micro_batches):
    """The mean of the same ``micro_batches`` fp32 losses, summed in another order."""
    return abs(got - want) <= 2 * gamma(micro_batches) * abs(want)


@pytest.mark.multirank
def test_dualpipev_zb_resumes_on_more_then_fewer_replicas(tmp_path):
    kw = dict(base="tiny_dualpipev_cpu.json", schedule="dualpipev-zb", micro=1)
    full = _train(tmp_path, _cfg(tmp_path, "d1", gas=8, **kw), world=2, steps=4, ckpt=tmp_path / "full")
    more = _train(tmp_path, _cfg(tmp_path, "d2", gas=4, **kw), world=4, steps=4, ckpt=tmp_path / "more",
                  resume_from=tmp_path / "full", step=2)
    assert "data_parallel 1 -> 2" in more["stdout"]
    fewer = _train(tmp_path, _cfg(tmp_path, "d1", gas=8, **kw), world=2, steps=4, ckpt=tmp_path / "fewer",
                   resume_from=tmp_path / "more", step=3)
    assert "data_parallel 2 -> 1" in fewer["stdout"]
    assert _within_mean_rounding(more["losses"][0], full["losses"][2], 8), (more["losses"], full["losses"])
    assert _within_mean_rounding(fewer["losses"][0], more["losses"][1], 8), (fewer["losses"], more["losses"])


def _saved_and_now(tmp_path, saved_kw, now_kw, *, saved_world, now_world, overrides=None):
    """The resume state a run with ``saved_kw`` records, and what a run with ``now_kw``
    checks it against (checkpointer.check_resume_state's arguments)."""
    import dataclasses
    from ds_ext import checkpointer, run_plan
    from ds_ext.config import load_config
    from recipes import get_recipe
    recipe = get_recipe("deepseek_v3")
    out = []
    for name, kw, world in (("saved", saved_kw, saved_world), ("now", now_kw, now_world)):
        cfg = load_config(_cfg(tmp_path, name, **kw), world_size=world)
        model = recipe.make_config(cfg.section.recipe.preset, cfg.section.recipe.overrides)
        record = run_plan.layout_record(cfg, model, run_plan.layer_cut(cfg, recipe, model),
                                        optimizer="DeepSpeedZeroOptimizer")
        out.append((cfg, model, record))       # the optimizer an engine of this config builds (ZeRO-1, fp32)
    (scfg, smodel, slayout), (cfg, model, layout) = out
    saved = checkpointer.resume_state(scfg) | {"model_config": dataclasses.asdict(smodel) | (overrides or {}),
                                               "layout": slayout}
    return saved, cfg, layout, model


@pytest.mark.parametrize("saved_kw, now_kw, worlds, overrides, match", [
    # the memory pipeline cuts the corpus per replica: another degree would replay and skip data
    (dict(pipeline="memory"), dict(pipeline="memory", gas=2), (4, 2), None,
     r'data_parallel 2 -> 1; grad_accum 1 -> 2\) \(data.pipeline "memory" gives each replica .* '
     r'seekspeed.data.pipeline "tiered"'),
    # ZeRO stage 0 in fp32 (DeepSpeed's FusedAdam on whole tensors) keeps no cut of its state to put together
    (dict(), dict(gas=2), (4, 2), {}, r"needs an optimizer state DeepSpeed cuts by replicas on both sides "
                                      r"\(ZeRO stage 1, or bf16; checkpoint: FusedAdam"),
    # another model
    (dict(), dict(gas=2), (4, 2), {"hidden_size": 256}, r"holds another model \(hidden_size 256 -> 128\)"),
])
def test_resume_on_another_layout_refusals(tmp_path, saved_kw, now_kw, worlds, overrides, match):
    from ds_ext import checkpointer
    from ds_ext.errors import ConfigError
    saved, cfg, layout, model = _saved_and_now(tmp_path, saved_kw, now_kw, saved_world=worlds[0],
                                               now_world=worlds[1], overrides=overrides)
    if overrides == {}:
        saved["layout"]["optimizer"] = "FusedAdam"
    with pytest.raises(ConfigError, match=match) as info:
        checkpointer.check_resume_state(saved, cfg, "/ck/global_step1", layout=layout, model_config=model)
    assert "\n" not in str(info.value)


def test_resume_state_names_the_layout_changes(tmp_path):
    from ds_ext import checkpointer
    saved, cfg, layout, model = _saved_and_now(tmp_path, dict(stages=2, ep=2, base="tiny_moe_cpu.json"),
                                               dict(stages=1, gas=2, base="tiny_moe_cpu.json"), saved_world=4,
                                               now_world=2)
    changed = checkpointer.check_resume_state(saved, cfg, "/ck/x", layout=layout, model_config=model)
    assert changed == ["pipe_stages", "expert_parallel_size"]        # 2 x 2 -> 1 x 2: the same replicas
    del saved["layout"]                                                 # a checkpoint from before the records
    saved["data_parallel"] = 4
    from ds_ext.errors import ConfigError
    with pytest.raises(ConfigError, match="predates seekspeed's layout records"):
        checkpointer.check_resume_state(saved, cfg, "/ck/x", layout=layout, model_config=model)


def test_layout_record_names_each_ranks_layers():
    from ds_ext import run_plan
    from ds_ext.config import load_config
    from recipes import get_recipe
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "ds_configs", "tiny_dualpipev_cpu.json"), world_size=2)
    recipe = get_recipe("deepseek_v3")
    model = recipe.make_config("tiny", {})
    record = run_plan.layout_record(cfg, model, run_plan.layer_cut(cfg, recipe, model))
    # DualPipeV on 2 ranks, 4 virtual stages of one decoder layer each: rank 0 holds the first
    # (embedding, layer 1) and the last (layer 4, final norm, head), rank 1 the middle two
    assert record["stage_keys"] == [["0", "1", "4", "5", "6"], ["2", "3"]]
    assert record["pipe_stages"] == 2 and record["schedule"] == "dualpipev" and record["zero_stage"] == 1
