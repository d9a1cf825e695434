"""Config validation: strict seekspeed section, DeepSpeed batch arithmetic, the
bad-input errors of launch/train.py (one line, names the problem and the fix) and
that a run failing validation writes nothing. DeepSpeed's own keys through
DeepSpeed's code (ds_ext/ds_keys.py): optimizer and scheduler types and params
built on a dummy parameter, ZeRO and precision sections through DeepSpeed's pydantic
models and their strict twins, grad_accum_dtype; every shipped config passes.
Single process; about 10 s (the first optimizer build loads DeepSpeed's FusedAdam op,
about 3 s)."""

import copy
import json
import os

import pytest

from ds_ext import trainer
from ds_ext.config import load_config
from ds_ext.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "ds_configs", "tiny_cpu.json")


def _write(tmp_path, mutate, name="cfg.json"):
    with open(TINY) as f:
        cfg = json.load(f)
    cfg = copy.deepcopy(cfg)
    mutate(cfg)
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def _error(tmp_path, mutate, world_size=4):
    with pytest.raises(ConfigError) as exc:
        load_config(_write(tmp_path, mutate), world_size=world_size)
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_tiny_config_resolves():
    cfg = load_config(TINY, world_size=4)
    lay = cfg.layout
    assert (lay.pipe_stages, lay.data_parallel, lay.micro_batch, lay.grad_accum, lay.train_batch) == (2, 2, 4, 4, 32)
    assert lay.tokens_per_step == 32 * 128
    assert cfg.ds["scheduler"]["params"]["total_num_steps"] == cfg.section.train.steps
    assert cfg.warnings == []


def test_unknown_section_key_names_it_and_the_allowed_keys(tmp_path):
    msg = _error(tmp_path, lambda c: c["seekspeed"]["data"].update(seq_length=64))
    assert "'seq_length'" in msg and "seq_len" in msg and "allowed keys" in msg


def test_wrong_type_names_the_field(tmp_path):
    msg = _error(tmp_path, lambda c: c["seekspeed"]["data"].update(seq_len="128"))
    assert "seekspeed.data.seq_len" in msg and "integer" in msg


def test_unknown_schedule(tmp_path):
    msg = _error(tmp_path, lambda c: c["seekspeed"].update(schedule="gpipe"))
    assert "gpipe" in msg and "1f1b" in msg


def test_batch_arithmetic_that_does_not_fit(tmp_path):
    msg = _error(tmp_path, lambda c: c.update(train_batch_size=30))
    assert "30" in msg and "set train_batch_size to 32" in msg


def test_world_size_not_divisible_by_stages():
    with pytest.raises(ConfigError, match="not divisible by pipeline.stages 2"):
        load_config(TINY, world_size=3)


def test_zero_stage_2_refused(tmp_path):
    assert "stage 0 or 1" in _error(tmp_path, lambda c: c["zero_optimization"].update(stage=2))


def test_dualpipev_needs_enough_micro_batches(tmp_path):
    def mutate(c):
        c["seekspeed"]["schedule"] = "dualpipev"
        c["gradient_accumulation_steps"] = 3
    assert ">= 2 x pipeline.stages (4), got 3" in _error(tmp_path, mutate)


def test_misspelt_deepspeed_key_warns(tmp_path):
    def mutate(c):
        c["gradient_acumulation_steps"] = c.pop("gradient_accumulation_steps")
    cfg = load_config(_write(tmp_path, mutate), world_size=4)
    assert len(cfg.warnings) == 1
    assert "'gradient_acumulation_steps'" in cfg.warnings[0] and "'gradient_accumulation_steps'" in cfg.warnings[0]


def test_auto_only_for_total_steps(tmp_path):
    assert "warmup_num_steps" in _error(tmp_path, lambda c: c["scheduler"]["params"].update(warmup_num_steps="auto"))


def _main_error(tmp_path, capsys, mutate, extra=()):
    ckpt = tmp_path / "ckpt"
    path = _write(tmp_path, lambda c: (mutate(c), c["seekspeed"]["checkpoint"].update(dir=str(ckpt))))
    os.environ.pop("RANK", None)
    os.environ["WORLD_SIZE"] = "4"
    try:
        rc = trainer.main(["--deepspeed", path, *extra])
    finally:
        os.environ.pop("WORLD_SIZE")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not ckpt.exists(), "a run that failed validation wrote into the checkpoint directory"
    return err[0]


@pytest.mark.parametrize("mutate,expected", [
    (lambda c: c["seekspeed"]["data"].update(source="/nonexistent/corpus.jsonl"), "does not exist"),
    (lambda c: c["seekspeed"]["recipe"].update(preset="gpt5"), "unknown preset 'gpt5'"),
    (lambda c: c["seekspeed"]["recipe"].update(name="llama"), "unknown recipe 'llama'"),
    (lambda c: c["seekspeed"]["recipe"].update(overrides={"num_hidden_layers": 1}),
     "pipeline stages 2 exceed decoder layers (1)"),
    (lambda c: c["seekspeed"]["recipe"].update(overrides={"hidden_sise": 64}), "did you mean 'hidden_size'"),
    (lambda c: c["seekspeed"]["recipe"].update(overrides={"vocab_size": 200}), "vocab_size >= 257"),
    (lambda c: c.update(train_batch_size=64), "batch sizes do not fit 4 ranks"),
])
def test_train_rejects_bad_input_in_one_line(tmp_path, capsys, mutate, expected):
    assert expected in _main_error(tmp_path, capsys, mutate)


def test_dualpipev_stage_count_doubles(tmp_path, capsys):
    def mutate(c):
        c["seekspeed"]["schedule"] = "dualpipev"
        c["seekspeed"]["recipe"]["overrides"] = {"num_hidden_layers": 3}
    assert "pipeline stages 4 (2 ranks x 2 for dualpipev) exceed decoder layers (3)" in \
        _main_error(tmp_path, capsys, mutate)


def test_resume_without_checkpoint(tmp_path, capsys):
    assert "--resume: no checkpoint" in _main_error(tmp_path, capsys, lambda c: None, extra=["--resume"])


def test_existing_checkpoint_is_never_overwritten(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest").write_text("global_step5")
    path = _write(tmp_path, lambda c: c["seekspeed"]["checkpoint"].update(dir=str(ckpt)))
    os.environ["WORLD_SIZE"] = "4"
    try:
        assert trainer.main(["--deepspeed", path]) == 2
    finally:
        os.environ.pop("WORLD_SIZE")
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert sorted(os.listdir(ckpt)) == ["latest"] and (ckpt / "latest").read_text() == "global_step5"


def test_missing_and_invalid_json(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.json"), world_size=1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,\n "seekspeed": {,}}')
    with pytest.raises(ConfigError, match=r"bad.json:2:\d+: invalid JSON"):
        load_config(str(bad), world_size=1)


@pytest.mark.parametrize("mutate,expected", [
    (lambda c: c.update(train_micro_batch_size_per_gpu="4"), "train_micro_batch_size_per_gpu must be a positive"),
    (lambda c: c["zero_optimization"].update(stagee=1),
     "zero_optimization.stagee is not a key of DeepSpeed's zero_optimization section (did you mean 'stage'?)"),
    (lambda c: c["pipeline"].update(stage=2), "pipeline.stage is not a DeepSpeed pipeline key (did you mean 'stages'?)"),
    (lambda c: c["pipeline"].update(activation_checkpoint_interval="1"), "activation_checkpoint_interval must be"),
    (lambda c: c.update(pipeline=None), "'pipeline' must be an object"),
    (lambda c: c.update(scheduler=[]), "'scheduler' must be an object"),
    (lambda c: c["zero_optimization"].update(stage=3), "stage 3 cannot be used"),
    (lambda c: c["seekspeed"].update(recipe=None), "seekspeed.recipe: expected an object"),
    (lambda c: c["seekspeed"]["checkpoint"].update(dir=""), "must be a path or null"),
    (lambda c: c["seekspeed"]["data"].update(seq_len=1), "data.seq_len must be >= 2"),
    (lambda c: c["seekspeed"]["data"].update(pipeline="memory", mixture=[{"source": "x"}]),
     "mixture needs seekspeed.data.pipeline \"tiered\""),
    (lambda c: c["seekspeed"]["checkpoint"].update(engine="async"), "engine 'async' is not one of"),
    (lambda c: c["seekspeed"]["checkpoint"].update(keep_last=3), "keep_last needs engine \"async-zstd\""),
    (lambda c: c["seekspeed"]["checkpoint"].update(engine="async-zstd", when_busy="queue"), "when_busy 'queue'"),
    (lambda c: c["seekspeed"]["checkpoint"].update(engine="async-zstd", zstd_level=30), "zstd_level must be"),
])
def test_deepspeed_and_section_mistakes_are_one_line(tmp_path, mutate, expected):
    assert expected in _error(tmp_path, mutate)


def test_top_level_key_meant_for_a_section_warns(tmp_path):
    cfg = load_config(_write(tmp_path, lambda c: c.update(grad_accum_dtype="fp32")), world_size=4)
    assert len(cfg.warnings) == 1 and "'grad_accum_dtype'" in cfg.warnings[0]


def test_checkpoint_override_on_a_null_section(tmp_path):
    path = _write(tmp_path, lambda c: c["seekspeed"].update(checkpoint=None))
    with pytest.raises(ConfigError, match="expected an object"):
        load_config(path, world_size=4)
    cfg = load_config(_write(tmp_path, lambda c: c["seekspeed"].pop("checkpoint")), world_size=4,
                      overrides={"checkpoint.dir": "x"})
    assert cfg.section.checkpoint.dir == "x"


@pytest.mark.parametrize("overrides,expected", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 64}},
     "yarn needs factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "10000"}}, "rope_theta must be a positive number"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 64, "truncate": "false"}}, "truncate must be true"),
    ({"initializer_range": -1.0}, "initializer_range must be positive"),
    ({"n_shared_experts": -1}, "n_shared_experts must be >= 0"),
])
def test_recipe_value_errors(overrides, expected):
    from recipes import deepseek_v3
    with pytest.raises(ConfigError, match=expected):
        deepseek_v3.make_config("tiny", overrides)


def test_partition_method_is_checked_before_launch(tmp_path, capsys):
    assert "matches no layer" in _main_error(tmp_path, capsys, lambda c: c["pipeline"].update(partition="type:Foo"))
    assert "not a DeepSpeed partition method" in _main_error(
        tmp_path, capsys, lambda c: c["pipeline"].update(partition="profile"))


@pytest.mark.parametrize("mutate,world,expected", [
    (lambda c: c.update(pipeline={"stages": 3}), 3, "dualpipe pairs rank r with rank R-1-r, so it needs an even"),
    (lambda c: c.update(gradient_accumulation_steps=5), 4, "even gradient_accumulation_steps >= 2 x pipeline.stages"),
    (lambda c: c.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp16"}), 4,
     "dualpipe does not support bf16 weights with data_types.grad_accum_dtype fp16"),
    (lambda c: c.update(bf16={"enabled": True, "immediate_grad_update": True}, data_types={"grad_accum_dtype": "fp32"}),
     4, "bf16.immediate_grad_update true does not work with schedule dualpipe"),
])
def test_dualpipe_constraints(tmp_path, mutate, world, expected):
    def both(c):
        c["seekspeed"]["schedule"] = "dualpipe"
        mutate(c)
    assert expected in _error(tmp_path, both, world_size=world)


@pytest.mark.parametrize("zero,accum", [(1, "fp32"), (1, None), (0, None)])
def test_dualpipe_trains_in_bf16(tmp_path, zero, accum):
    """bf16 with fp32 accumulation and ZeRO-1 (the production configs), or bf16 throughout."""
    def mutate(c):
        c["seekspeed"]["schedule"] = "dualpipe"
        c.update(bf16={"enabled": True}, zero_optimization={"stage": zero})
        if accum:
            c["data_types"] = {"grad_accum_dtype": accum}
    assert load_config(_write(tmp_path, mutate), world_size=4).layout.schedule == "dualpipe"


# DeepSpeed's own keys, through DeepSpeed's own code (ds_ext/ds_keys.py): each mistake is
# one line naming the key path, the value and the fix, before any process group exists.
@pytest.mark.parametrize("mutate,expected", [
    (lambda c: c["optimizer"]["params"].update(lr="fast"),
     ['optimizer.params.lr "fast": FusedAdam, what DeepSpeed builds for optimizer.type \'AdamW\', fails with it',
      "give a number such as its default 0.001"]),
    (lambda c: c["optimizer"]["params"].update(betas=[0.9, "0.95"]), ["optimizer.params.betas [0.9, \"0.95\"]",
                                                                     "a list such as its default [0.9, 0.999]"]),
    (lambda c: c["optimizer"].update(type="AdamX"),
     ["optimizer.type 'AdamX' is not an optimizer DeepSpeed can build", "did you mean 'Adamax'?", "'adamw'"]),
    (lambda c: c["optimizer"]["params"].update(lrr=0.1),
     ["optimizer.params.lrr is not a parameter of FusedAdam", "did you mean 'lr'?", "remove it or use one of"]),
    (lambda c: c["optimizer"]["params"].update(max_grad_norm=1.0),
     ["optimizer.params.max_grad_norm is not a parameter", "gradient_clipping"]),
    (lambda c: c["optimizer"].update(param={}), ["optimizer.param is not a DeepSpeed optimizer key",
                                                 "did you mean 'params'?"]),
    (lambda c: c["scheduler"].update(type="WarmupCosine"),
     ["scheduler.type 'WarmupCosine' is not a scheduler DeepSpeed can build", "did you mean 'WarmupCosineLR'?"]),
    (lambda c: c["scheduler"]["params"].update(warmup_num_steps="ten"),
     ['scheduler.params.warmup_num_steps "ten": WarmupCosineLR', "warmup_num_steps must be a positive integer",
      "give an integer such as its default 1000"]),
    (lambda c: c["scheduler"]["params"].update(warmup_steps=20),
     ["scheduler.params.warmup_steps is not a parameter of WarmupCosineLR", "did you mean 'warmup_num_steps'?"]),
    (lambda c: c["scheduler"]["params"].update(total_num_steps="many"),
     ['scheduler.params.total_num_steps "many"', "give an integer"]),
    (lambda c: c["scheduler"]["params"].pop("total_num_steps"), ["add scheduler.params.total_num_steps"]),
    (lambda c: c.update(scheduler={"type": "StepLR", "params": {"step_size": "x"}}),
     ['scheduler.params.step_size "x": StepLR', "give an integer"]),
    (lambda c: c["zero_optimization"].update(stage="1"),
     ['zero_optimization.stage "1" must be one of [0, 1, 2, 3], not a string', "write 1"]),
    (lambda c: c["zero_optimization"].update(stage=True), ["zero_optimization.stage true", "not a boolean"]),
    (lambda c: c["zero_optimization"].update(stage="two"), ['zero_optimization.stage "two" must be one of']),
    (lambda c: c["bf16"].update(enabled="false"),
     ['bf16.enabled "false" must be true or false, not a string', "would read it as false", "write false"]),
    (lambda c: c["bf16"].update(enabled=1), ["bf16.enabled 1 must be true or false, not a number", "write true"]),
    (lambda c: c.update(fp16={"enabled": False, "loss_scale": "dynamic"}), ['fp16.loss_scale "dynamic" must be']),
    (lambda c: c.update(data_types={"grad_accum_dtype": "fp64"}),
     ["data_types.grad_accum_dtype 'fp64' is not a dtype DeepSpeed knows", "'fp32'", "or remove it"]),
    (lambda c: c.update(train_batch_size=30), ["batch sizes do not fit", "set train_batch_size to 32"]),
    (lambda c: c.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"},
                        optimizer={"type": "Muon", "params": {"lr": 1e-3}}),
     ["optimizer.type Muon with bf16 weights and fp32 accumulation under ZeRO stage 1",
      "remove data_types.grad_accum_dtype", "or use optimizer AdamW"]),
    (lambda c: c.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}, zero_optimization={"stage": 0}),
     ["data_types.grad_accum_dtype fp32 with bf16 weights needs ZeRO stage 1", "set zero_optimization.stage 1",
      "or remove data_types.grad_accum_dtype"]),
])
def test_deepspeed_keys_are_checked_before_the_run(tmp_path, mutate, expected):
    message = _error(tmp_path, mutate)
    for part in expected:
        assert part in message, (part, message)


@pytest.mark.parametrize("mutate", [
    lambda c: c["zero_optimization"].update(reduce_bucket_size=5e8),     # a number for an integer: the same
    lambda c: c.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "float"}),   # DeepSpeed's alias
    lambda c: c.update(scheduler={"type": "StepLR", "params": {"step_size": 10}}),          # a torch scheduler
    lambda c: c.update(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}),  # a torch optimizer
    # DeepSpeed's Muon, built and stepped on tagged parameters as the engine gives it them
    lambda c: c.update(optimizer={"type": "Muon", "params": {"lr": 2e-3, "muon_lr": 2e-2, "momentum": 0.95}}),
])
def test_valid_deepspeed_keys_pass(tmp_path, mutate):
    from ds_ext.config import fp32_grad_accumulation
    cfg = load_config(_write(tmp_path, mutate), world_size=4)
    assert cfg.warnings == []
    if cfg.ds.get("data_types"):
        assert fp32_grad_accumulation(cfg.ds)          # "float" is fp32 to DeepSpeed, so to seekspeed too


@pytest.mark.parametrize("name,world", [("128node.json", 1024), ("single_node.json", 8), ("tiny_1rank.json", 1),
                                        ("tiny_cpu.json", 4), ("tiny_dualpipev_cpu.json", 2),
                                        ("tiny_moe_cpu.json", 4)])
def test_every_shipped_config_passes_deepspeeds_checks(name, world):
    assert load_config(os.path.join(ROOT, "ds_configs", name), world_size=world).warnings == []


def test_bad_learning_rate_fails_through_validate_and_writes_nothing(tmp_path, capsys):
    line = _main_error(tmp_path, capsys, lambda c: c["optimizer"]["params"].update(lr="fast"))
    assert line.startswith('error: optimizer.params.lr "fast"')


def test_overlap_choices_and_refusals(tmp_path):
    assert "seekspeed.overlap 'layers' is not one of ['auto', 'layer', 'none']" in _error(
        tmp_path, lambda c: c["seekspeed"].update(overlap="layers"))

    def section(schedule, overlap, ep):
        def mutate(c):
            c["seekspeed"].update(schedule=schedule, overlap=overlap)
            c["seekspeed"]["moe"] = {"expert_parallel_size": ep}
            c["gradient_accumulation_steps"] = 8
        return load_config(_write(tmp_path, mutate), world_size=4).section

    assert section("dualpipev-zb", "auto", 2).resolve_overlap(has_moe=True) == "layer"
    assert section("dualpipe", "auto", 2).resolve_overlap(has_moe=True) == "layer"
    assert section("dualpipev-zb", "auto", 1).resolve_overlap(has_moe=True) == "none"
    assert section("1f1b", "auto", 2).resolve_overlap(has_moe=True) == "none"
    assert section("dualpipev-zb", "none", 2).resolve_overlap(has_moe=True) == "none"
    with pytest.raises(ConfigError, match="only schedules dualpipev-zb and dualpipe run; schedule '1f1b' takes 'none'"):
        section("1f1b", "layer", 2).resolve_overlap(has_moe=True)
    with pytest.raises(ConfigError, match=r"this run has none \(no MoE layers\)"):
        section("dualpipev-zb", "layer", 2).resolve_overlap(has_moe=False)
    with pytest.raises(ConfigError, match=r"moe.expert_parallel_size 1"):
        section("dualpipe", "layer", 1).resolve_overlap(has_moe=True)


def _shipped_world(path):
    """The smallest world size of 1, 2, 4, 8 or 1024 that ``path`` (a config of ds_configs/) resolves on."""
    for world in (1, 2, 4, 8, 1024):
        try:
            load_config(path, world_size=world)
            return world
        except ConfigError:
            continue
    raise AssertionError(f"{path} resolves on none of the world sizes tried")


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(ROOT, "ds_configs")) if n.endswith(".json")))
def test_bad_moe_dispatch_settings_are_refused_for_every_shipped_config(tmp_path, name):
    """seekspeed.moe.dispatcher and dispatch_dtype, wrong, in every config of ds_configs/: one
    line naming the key and the choices, from the loader (before anything is built or written)."""
    src = os.path.join(ROOT, "ds_configs", name)
    world = _shipped_world(src)
    with open(src) as f:
        base = json.load(f)
    for moe, pattern in (({"dispatcher": "all"}, r"^seekspeed\.moe\.dispatcher 'all' is not one of \['deduplicated', "
                                                  r"'every-copy'\]$"),
                         ({"dispatch_dtype": "fp16"}, r"^seekspeed\.moe\.dispatch_dtype 'fp16': the dispatch sends the "
                                                      r"activation dtype \((fp32|bf16)\) or fp8")):
        cfg = copy.deepcopy(base)
        cfg["seekspeed"].setdefault("moe", {}).update(moe)
        path = tmp_path / name
        path.write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match=pattern) as exc:
            load_config(str(path), world_size=world)
        assert "\n" not in str(exc.value)


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(ROOT, "ds_configs")) if n.endswith(".json")))
def test_muon_where_deepspeeds_bf16_optimizer_would_take_it_is_refused_for_every_shipped_config(tmp_path, name):
    """Every config of ds_configs/ switched to Muon with bf16 weights and fp32 accumulation
    (DeepSpeed's BF16 optimizer, which stops on any pipeline or MoE model): one line naming
    the optimizer and the fix, from the loader, before anything is built or written."""
    src = os.path.join(ROOT, "ds_configs", name)
    world = _shipped_world(src)
    with open(src) as f:
        cfg = json.load(f)
    cfg["optimizer"] = {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 1e-2}}
    cfg["bf16"] = {"enabled": True}
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    cfg.setdefault("zero_optimization", {})["stage"] = 1
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"^optimizer\.type Muon with bf16 weights and fp32 accumulation under ZeRO "
                                          r"stage 1: .*remove data_types\.grad_accum_dtype\), or use optimizer AdamW$") \
            as exc:
        load_config(str(path), world_size=world)
    assert "\n" not in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == [name]                    # nothing written beside the config


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(ROOT, "ds_configs")) if n.endswith(".json")))
def test_exact_grad_norm_loads_or_is_refused_in_one_line_for_every_shipped_config(tmp_path, name):
    """``seekspeed.grad_norm: "exact"`` in every config of ds_configs/: it loads where
    DeepSpeed runs its ZeRO stage 1/2 or BF16 optimizer; the same config in fp32 at ZeRO
    stage 0 (DeepSpeed's engine clips with its own norm there), or with a value that is
    not a choice, is refused in one line by the loader, before anything is written."""
    src = os.path.join(ROOT, "ds_configs", name)
    world = _shipped_world(src)
    with open(src) as f:
        base = json.load(f)
    path = tmp_path / name

    def load(cfg):
        path.write_text(json.dumps(cfg))
        return load_config(str(path), world_size=world)
    cfg = copy.deepcopy(base)
    cfg["seekspeed"]["grad_norm"] = "exact"
    zero = base.get("zero_optimization", {}).get("stage", 0)
    bf16 = base.get("bf16", {}).get("enabled", False)
    if zero in (1, 2) or bf16:
        assert load(cfg).section.grad_norm == "exact"
    cfg["zero_optimization"] = {"stage": 0}
    cfg["bf16"] = {"enabled": False}
    cfg.pop("data_types", None)
    for section, pattern in (({}, r"^seekspeed\.grad_norm 'exact' with ZeRO stage 0 and fp32 weights: .*set "
                                  r"zero_optimization\.stage 1 \(or bf16\.enabled with stage 0\), or grad_norm 'deepspeed'$"),
                             ({"grad_norm": "fast"}, r"^seekspeed\.grad_norm 'fast' is not one of \['deepspeed', "
                                                     r"'exact'\]$")):
        cfg["seekspeed"].update(section)
        with pytest.raises(ConfigError, match=pattern) as exc:
            load(cfg)
        assert "\n" not in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == [name]                    # nothing written beside the config


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(ROOT, "ds_configs")) if n.endswith(".json")))
def test_muon_update_loads_with_muon_or_is_refused_in_one_line_for_every_shipped_config(tmp_path, name):
    """``seekspeed.muon_update`` in every config of ds_configs/: "compiled" and "eager"
    load where the optimizer is DeepSpeed's Muon and are refused in one line elsewhere
    (the key would do nothing); a value that is not a choice is refused; nothing is
    written beside the config."""
    src = os.path.join(ROOT, "ds_configs", name)
    world = _shipped_world(src)
    with open(src) as f:
        cfg = json.load(f)
    path = tmp_path / name
    muon = cfg["optimizer"]["type"].lower() == "muon"
    for mode in ("compiled", "eager"):
        cfg["seekspeed"]["muon_update"] = mode
        path.write_text(json.dumps(cfg))
        if muon:
            assert load_config(str(path), world_size=world).section.muon_update == mode
            continue
        with pytest.raises(ConfigError, match=rf"^seekspeed\.muon_update '{mode}' chooses how DeepSpeed's Muon runs "
                                              rf"its update, and optimizer\.type is .*: remove the key or set "
                                              rf"optimizer\.type Muon$"):
            load_config(str(path), world_size=world)
    cfg["seekspeed"]["muon_update"] = "fast"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"^seekspeed\.muon_update 'fast' is not one of \['auto', 'compiled', "
                                          r"'eager'\]$"):
        load_config(str(path), world_size=world)
    assert sorted(os.listdir(tmp_path)) == [name]                    # nothing written beside the config


def test_checking_a_muon_config_compiles_nothing():
    """The optimizer trial steps DeepSpeed's Muon, whose update is torch.compile'd: run
    eagerly it checks the same values without compiling for a 2x2 matrix on every rank
    at every launch (measured at 20 s of a tiny_v4_cpu rank's 55, 2 cores under load)."""
    import torch._dynamo.utils
    frames = torch._dynamo.utils.counters["frames"]
    before = dict(frames)
    cfg = load_config(os.path.join(ROOT, "ds_configs", "tiny_v4_cpu.json"), world_size=4)
    assert cfg.ds["optimizer"]["type"] == "Muon" and cfg.warnings == []
    assert dict(frames) == before, (before, dict(frames))
