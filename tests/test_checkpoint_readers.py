"""Every reader of a checkpoint reads both engines' files, and none runs code from them.

Runs (shared by the tests below): tiny (bf16, ZeRO-1, fp32 accumulation, as the
production configs; 2 ranks = 2 stages) trained 2 steps once with each checkpoint
engine, the async-zstd one under the deepspeed launcher (its ranks must exit: DeepSpeedEngine.__del__
runs the checkpoint engine's cleanup at interpreter exit, which the harness's ranks, leaving by
os._exit, never reach); tiny-moe (fp32, ZeRO-1, 2 stages x 2 replicas, expert-parallel degree 2)
trained 4 steps with async-zstd (checkpoints at 2 and 4), then resumed from its step
2 with checkpoint.engine "deepspeed" (a DeepSpeed-format checkpoint of step 4).
Checked: the resumed losses equal the uninterrupted run's bitwise; export and
generation from an async-zstd checkpoint give what a DeepSpeed-format checkpoint of
the same run gives, bitwise; launch/convert_checkpoint.py writes exactly DeepSpeed's
files (names, types, values) and 'latest', refuses a non-empty destination and a
corrupt source, and leaves nothing behind when the disk fills (3 MB tmpfs, needs
root); DeepSpeed's ds_to_universal gives the same universal checkpoint from the
converted files as from DeepSpeed's own (dense; fp32 masters whose bf16 casts are the
trained weights), and zero_to_fp32 (both layouts) and ds_to_universal (MoE) fail on
both alike, at the place the README names. Crafted files whose unpickling would run a
command (torch.save zip and legacy, seekspeed's format) are refused naming the file
and the type, with the marker file never created: by the loader, by both checkpoint
engines, by export_hf.py, generate.py, convert_checkpoint.py and --resume (both
engines, every rank stops).
About 85 s on 2 cores, 150 s when other jobs share them (the fixtures' five training runs are most of it)."""

import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import traceback

import pytest
import torch

from ds_ext.checkpoint import catalog, format as fmt, safe_pickle
from ds_ext.checkpoint.convert import to_deepspeed
from ds_ext.checkpoint.load import CheckpointError, UnsafeCheckpointError, check_file, load_file, open_tag
from ds_ext.errors import ConfigError
from ds_ext.hf_io import export_hf
from tests.mounts import small_tmpfs
from tests.numerics import assert_same_checkpoint_weights
from tests.distributed import free_port, run_ranks
from tests.training import launcher_env, trainer_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(path, base, *, engine, mutate=None):
    with open(os.path.join(ROOT, "ds_configs", base)) as f:
        cfg = json.load(f)
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2)
    cfg["seekspeed"]["data"]["seq_len"] = 32
    cfg["seekspeed"]["checkpoint"].update(engine=engine, interval_steps=2)
    if mutate:
        mutate(cfg)
    path.write_text(json.dumps(cfg))
    return str(path)


def _train(cfg, ckpt, *, world, steps, resume=False, launcher=False):
    """A training run (``launcher``: under the real deepspeed launcher, whose ranks must
    also exit); its summary."""
    summary = f"{ckpt}.json"
    argv = ["--deepspeed", cfg, "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--summary-json", summary]
    argv += ["--resume"] if resume else []
    if launcher:
        proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", str(world),
                               "--master_port", str(free_port()), os.path.join(ROOT, "launch", "train.py"), *argv],
                              cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        res = run_ranks(trainer_rank, world_size=world, init_dist=False, timeout=300, args=(argv, ))
        assert [r[0] for r in res] == [0] * world, res
    with open(summary) as f:
        return json.load(f)


def _bf16(c):
    c["bf16"] = {"enabled": True}
    c["data_types"] = {"grad_accum_dtype": "fp32"}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dense")
    out = {}
    for engine in ("async-zstd", "deepspeed"):
        cfg = _config(tmp / f"{engine}.json", "tiny_cpu.json", engine=engine, mutate=_bf16)
        # the production configs' engine, as a user runs it: under the launcher, whose ranks exit
        # through the interpreter's finalization (the harness's leave by os._exit)
        out[engine] = (tmp / engine, _train(cfg, tmp / engine, world=2, steps=2, launcher=engine == "async-zstd"))
    assert out["async-zstd"][1]["losses"] == out["deepspeed"][1]["losses"]   # the engine changes no arithmetic
    return {"tmp": tmp, "async": out["async-zstd"][0], "deepspeed": out["deepspeed"][0]}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    ep2 = lambda c: c["seekspeed"]["moe"].update(expert_parallel_size=2)
    full = _train(_config(tmp / "async.json", "tiny_moe_cpu.json", engine="async-zstd", mutate=ep2),
                  tmp / "async", world=4, steps=4)
    part = tmp / "resumed"
    part.mkdir()
    shutil.copytree(tmp / "async" / "global_step2", part / "global_step2")
    (part / "latest").write_text("global_step2")
    resumed = _train(_config(tmp / "deepspeed.json", "tiny_moe_cpu.json", engine="deepspeed", mutate=ep2), part,
                     world=4, steps=4, resume=True)
    return {"tmp": tmp, "async": tmp / "async", "deepspeed": part, "full": full, "resumed": resumed}


# -- resume -------------------------------------------------------------------------------------

@pytest.mark.multirank
def test_moe_resume_from_async_zstd_continues_bitwise(moe):
    full, resumed = moe["full"], moe["resumed"]
    assert resumed["start_step"] == 2 and resumed["steps"] == 2
    assert resumed["losses"] == full["losses"][2:]          # same arithmetic in the same order
    assert_same_checkpoint_weights(moe["async"], moe["deepspeed"], "global_step4")
    assert resumed["moe"]["expert_load"] == full["moe"]["expert_load"]
    assert (moe["deepspeed"] / "latest").read_text().strip() == "global_step4"
    assert catalog.read_manifest(str(moe["deepspeed"] / "global_step4")) is None     # DeepSpeed's format


# -- export and generation ----------------------------------------------------------------------

def _exported(ckpt, out):
    from safetensors.torch import load_file as load_safetensors
    export_hf(str(ckpt), str(out), log=lambda *_: None)
    return load_safetensors(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_export_from_async_zstd_equals_deepspeed_format(layout, dense, moe, tmp_path):
    run = {"dense": dense, "moe": moe}[layout]
    ours, ours_cfg = _exported(run["async"], tmp_path / "async")
    theirs, theirs_cfg = _exported(run["deepspeed"], tmp_path / "deepspeed")
    assert ours.keys() == theirs.keys() and ours_cfg == theirs_cfg
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    assert ours["model.embed_tokens.weight"].dtype == (torch.bfloat16 if layout == "dense" else torch.float32)


def _cli(script, argv, capsys):
    """launch/SCRIPT's main(argv) in this process: (exit code, stdout, stderr)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"cli_{script}", os.path.join(ROOT, "launch", f"{script}.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    capsys.readouterr()
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _generate(argv, capsys):
    return _cli("generate", argv, capsys)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_generate_from_async_zstd_checkpoint(layout, dense, moe, capsys):
    run = {"dense": dense, "moe": moe}[layout]
    texts = []
    for engine in ("async", "deepspeed"):
        rc, out, err = _generate(["--checkpoint", str(run[engine]), "--prompt", "def f(", "--max-new-tokens", "16"],
                                 capsys)
        assert rc == 0, err
        texts.append(out)
    assert texts[0].startswith("def f(") and texts[0] == texts[1]


# -- conversion to DeepSpeed's layout -------------------------------------------------------------

def _assert_same(a, b, where):
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):      # DeepSpeed's loss scaler
        _assert_same(vars(a), vars(b), where)
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def converted(dense, moe):
    out = {}
    for name, run in (("dense", dense), ("moe", moe)):
        target = run["tmp"] / "converted"
        lines = []
        to_deepspeed(str(run["async"]), str(target), log=lines.append)
        assert "files verified against manifest.json" in lines[0]
        assert any(line.startswith("convert: [1/") for line in lines)
        out[name] = target
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["dense", "moe"])
def test_converted_checkpoint_is_deepspeeds_own(layout, dense, moe, converted):
    run, target = {"dense": dense, "moe": moe}[layout], converted[layout]
    ours, theirs = open_tag(str(target)), open_tag(str(run["deepspeed"]))
    assert ours.tag == theirs.tag == ("global_step2" if layout == "dense" else "global_step4")
    assert ours.kind == "deepspeed" and ours.files() == theirs.files()
    for name in ours.files():
        assert not fmt.is_seekspeed_file(ours.file(name))
        _assert_same(torch.load(ours.file(name), weights_only=False), torch.load(theirs.file(name), weights_only=False),
                     name)
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        assert (target / script).read_bytes() == (run["deepspeed"] / script).read_bytes()
    assert sorted(os.listdir(target)) == sorted(["latest", ours.tag, "zero_to_fp32.py", "zero_to_torch.py"])


def _failure(fn):
    """(exception type, message with paths cut, innermost frame's file and function) of ``fn()``."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            fn()
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            return type(exc).__name__, os.path.basename(str(exc)), os.path.basename(frame.filename), frame.name
    return None


def _ds_to_universal(src, out):
    from deepspeed.checkpoint import ds_to_universal
    argv = ["ds_to_universal", "--input_folder", str(src), "--output_folder", str(out), "--num_extract_workers", "1",
            "--num_merge_workers", "1", "--inject_missing_state"]
    old, sys.argv = sys.argv, argv
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = old


@pytest.mark.multirank
def test_deepspeed_tools_on_a_converted_checkpoint(dense, moe, converted, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    # zero_to_fp32 reads mp_rank_*_model_states.pt as whole-model files: a pipeline's hold
    # no weights (module None) and an MoE pipeline's glob also takes in the expert files
    failures = {}
    for layout, run in (("dense", dense), ("moe", moe)):
        ours = _failure(lambda: get_fp32_state_dict_from_zero_checkpoint(str(converted[layout])))  # noqa: B023
        theirs = _failure(lambda: get_fp32_state_dict_from_zero_checkpoint(str(run["deepspeed"])))  # noqa: B023
        assert ours == theirs and ours[2:] == ("zero_to_fp32.py", "parse_model_states"), (ours, theirs)
        failures[layout] = ours[:2]
    assert failures == {"dense": ("AttributeError", "'NoneType' object has no attribute 'items'"),
                        "moe": ("ValueError", "layer_0_expert_0_mp_rank_00_model_states.pt is not a model state "
                                              "checkpoint")}

    # ds_to_universal: the dense pipeline converts, to the same files as from DeepSpeed's own
    _ds_to_universal(converted["dense"] / "global_step2", tmp_path / "ours")
    _ds_to_universal(dense["deepspeed"] / "global_step2", tmp_path / "theirs")
    files = sorted(os.path.relpath(os.path.join(d, f), tmp_path / "ours") for d, _, fs in os.walk(tmp_path / "ours")
                   for f in fs)
    assert files == sorted(os.path.relpath(os.path.join(d, f), tmp_path / "theirs")
                           for d, _, fs in os.walk(tmp_path / "theirs") for f in fs)
    for rel in files:
        _assert_same(torch.load(tmp_path / "ours" / rel, weights_only=False),
                     torch.load(tmp_path / "theirs" / rel, weights_only=False), rel)
    # its fp32 masters are the trained weights before the bf16 cast: cast, they are those weights
    layer = torch.load(converted["dense"] / "global_step2" / "layer_01-model_states.pt", weights_only=False)
    for name, weight in layer.items():
        fp32 = torch.load(tmp_path / "ours" / "zero" / f"1.{name}" / "fp32.pt", weights_only=False)["param"]
        assert fp32.dtype == torch.float32 and torch.equal(fp32.to(torch.bfloat16), weight), name
    # ... the MoE pipeline does not: the expert-parallel ranks' expert shards are merged as data-parallel ones
    ours = _failure(lambda: _ds_to_universal(converted["moe"] / "global_step4", tmp_path / "moe-ours"))
    theirs = _failure(lambda: _ds_to_universal(moe["deepspeed"] / "global_step4", tmp_path / "moe-theirs"))
    assert ours == theirs and ours[0] == "RuntimeError" and ours[2:] == ("ds_to_universal.py", "_merge_zero_shards")
    assert "is invalid for input of size" in ours[1]


@pytest.mark.multirank
def test_convert_refuses_bad_input_and_writes_nothing(dense, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        to_deepspeed(str(dense["async"]), str(full), log=lambda m: None)
    assert os.listdir(full) == ["keep"]
    with pytest.raises(ConfigError, match="in DeepSpeed's format already"):
        to_deepspeed(str(dense["deepspeed"]), str(tmp_path / "x"), log=lambda m: None)
    # a corrupt file in the source: refused before anything is written, naming it
    src = tmp_path / "src"
    shutil.copytree(dense["async"], src)
    victim = src / "global_step2" / "layer_03-model_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="layer_03-model_states.pt: checksum mismatch"):
        to_deepspeed(str(src), str(tmp_path / "out"), log=lambda m: None)
    assert sorted(os.listdir(tmp_path)) == ["full", "src"]            # no destination, no temporary directory


@pytest.mark.multirank
def test_convert_into_a_full_disk_leaves_nothing(dense, tmp_path):
    with small_tmpfs(tmp_path / "small") as mnt:
        with pytest.raises(CheckpointError, match="No space left on device.*nothing was written to"):
            to_deepspeed(str(dense["async"]), str(mnt / "out"), log=lambda m: None)
        assert os.listdir(mnt) == []
    assert catalog.newest_complete(str(dense["async"]), log=lambda m: None).tag == "global_step2"   # source intact


# -- crafted files --------------------------------------------------------------------------------

class _RunsCommand:
    """Unpickling this runs ``touch MARKER`` (os.system: posix.system on Linux)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}", )


def _crafted_torch(path, marker, *, legacy=False, base=None):
    state = dict(base or {"module": None}, payload=_RunsCommand(marker))
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)


def _crafted_seekspeed(path, marker, *, base=None):
    """A seekspeed file holding the payload; the manifest beside it (if any) made to match."""
    state = dict(base or {"module": None}, payload=_RunsCommand(marker))
    size, sha = fmt.write(path, fmt.snapshot(state))
    manifest = catalog.read_manifest(os.path.dirname(path))
    if manifest is not None:
        manifest["files"][os.path.basename(path)] = {"size": size, "sha256": sha}
        catalog.write_atomic(os.path.join(os.path.dirname(path), catalog.MANIFEST), json.dumps(manifest).encode())


def _refusal(path):
    return rf"^{path}: refused to unpickle posix\.system, which no DeepSpeed or seekspeed checkpoint holds"


@pytest.mark.parametrize("kind", ["torch-zip", "torch-legacy", "seekspeed"])
def test_loader_refuses_a_file_that_runs_a_command(kind, tmp_path):
    from ds_ext.checkpoint.engine import RestrictedTorchCheckpointEngine
    marker, path = tmp_path / "marker", tmp_path / "mp_rank_00_model_states.pt"
    if kind == "seekspeed":
        _crafted_seekspeed(str(path), marker)
    else:
        _crafted_torch(path, marker, legacy=kind == "torch-legacy")
    for load in (lambda: check_file(str(path)), lambda: load_file(str(path)),
                 lambda: RestrictedTorchCheckpointEngine().load(str(path))):
        with pytest.raises(UnsafeCheckpointError, match=_refusal(path)) as info:
            load()
        assert "\n" not in str(info.value)
    assert not marker.exists()
    # the payload is live: opened as DeepSpeed's own engine opens a file (or, for seekspeed's
    # format, with a plain unpickler), it runs the command
    if kind == "seekspeed":
        plain = pickle.Unpickler(io.BytesIO(fmt.read_skeleton(str(path))))
        plain.persistent_load = lambda pid: None
        plain.load()
    else:
        torch.load(path, weights_only=False)
    assert marker.exists()


def test_static_listing_follows_the_memo_and_refuses_computed_globals():
    # the module name from the memo (as a pickler writes a second global of one module)
    ops = (b"\x80\x04" + b"\x8c\x05posix\x94" + b"\x8c\x04Size\x94\x93" + b"h\x00" + b"\x8c\x06system\x94\x93"
           + b"\x86.")
    assert safe_pickle.pickle_globals(io.BytesIO(ops)) == {"posix.Size", "posix.system"}
    with pytest.raises(safe_pickle.RefusedGlobal, match="posix.Size"):
        safe_pickle.load(io.BytesIO(ops))
    # names it cannot tell without running the pickle (a push popped again before STACK_GLOBAL) are refused
    computed = b"\x80\x04" + b"\x8c\x05posix\x8c\x06system\x8c\x01x0" + b"\x93."
    with pytest.raises(safe_pickle.UnreadableGlobal):
        safe_pickle.pickle_globals(io.BytesIO(computed))
    with pytest.raises(safe_pickle.RefusedGlobal, match="posix.system"):
        safe_pickle.load(io.BytesIO(computed))


def test_fp16_loss_scaler_is_allowed(tmp_path):
    """What ZeRO holds under fp16 with dynamic scaling (DeepSpeed refuses fp16 on CPU, so
    no run here makes one): CreateLossScaler's object loads from both formats."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    scaler = CreateLossScaler(dtype=torch.half, static_loss_scale=0, dynamic_scaling=True,
                              dynamic_loss_args={"init_scale": 2**16, "scale_window": 1000, "min_scale": 1,
                                                 "delayed_shift": 2, "consecutive_hysteresis": False})
    state = {"optimizer_state_dict": {"loss_scaler": scaler, "zero_stage": 1}}
    torch.save(state, tmp_path / "torch.pt")
    fmt.write(tmp_path / "ours.pt", fmt.snapshot(state))
    for name in ("torch.pt", "ours.pt"):
        check_file(str(tmp_path / name))
        back = load_file(str(tmp_path / name))["optimizer_state_dict"]["loss_scaler"]
        assert type(back) is type(scaler) and vars(back) == vars(scaler) and back.dtype is torch.float16


def _crafted_copy(src, dst, marker, *, name):
    shutil.copytree(src, dst)
    path = dst / open_tag(str(dst)).tag / name
    base = load_file(str(path), verify="none")
    (_crafted_seekspeed(str(path), marker, base=base) if fmt.is_seekspeed_file(path)
     else _crafted_torch(path, marker, base=base))
    return path


@pytest.mark.multirank
def test_export_and_generate_refuse_a_crafted_checkpoint(dense, tmp_path, capsys):
    marker = tmp_path / "marker"
    for engine in ("deepspeed", "async"):
        ckpt = tmp_path / engine
        path = _crafted_copy(dense[engine], ckpt, marker, name="mp_rank_00_model_states.pt")
        for script, argv in (("export_hf", ["--out", str(tmp_path / f"hf-{engine}")]), ("generate", ["--prompt", "x"]),
                             ("convert_checkpoint", ["--out", str(tmp_path / f"ds-{engine}")])):
            rc, _, err = _cli(script, ["--checkpoint", str(ckpt)] + argv, capsys)
            lines = err.strip().splitlines()
            if script == "convert_checkpoint" and engine == "deepspeed":
                assert rc == 2 and "in DeepSpeed's format already" in lines[-1], err
                continue
            assert rc == 2 and len(lines) == 1, err
            assert lines[0].startswith(f"error: {path}: refused to unpickle posix.system"), err
        assert not (tmp_path / f"hf-{engine}").exists() and not (tmp_path / f"ds-{engine}").exists()
    assert not marker.exists()


@pytest.mark.multirank
def test_resume_refuses_a_crafted_checkpoint_on_every_rank(dense, tmp_path):
    marker = tmp_path / "marker"
    ckpt = tmp_path / "ckpt"
    # a file only stage 1 reads: without the check first, stage 0 would wait for it in a collective
    path = _crafted_copy(dense["deepspeed"], ckpt, marker, name="layer_06-model_states.pt")
    cfg = _config(tmp_path / "cfg.json", "tiny_cpu.json", engine="deepspeed", mutate=_bf16)
    res = run_ranks(trainer_rank, world_size=2, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume"], ))
    assert [r[0] for r in res] == [2, 2], res
    lines = res[0][2].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: refused to unpickle posix.system"), res[0][2]
    assert res[1][2] == "" and not marker.exists()


def _async_engine_refuses_rank(ckpt, name):
    from ds_ext.checkpoint.engine import AsyncCheckpointEngine, check_before_load
    from ds_ext.config import CheckpointSection
    engine = AsyncCheckpointEngine(CheckpointSection(dir=ckpt, engine="async-zstd"), log=lambda m: None)
    tag = engine.resolve(ckpt)                       # the crafted file matches the manifest: it verifies
    errors = []
    for attempt in (lambda: check_before_load(ckpt, tag, group=engine.group),
                    lambda: engine.load(os.path.join(ckpt, tag, name))):
        try:
            attempt()
        except UnsafeCheckpointError as exc:
            errors.append(str(exc))
    return tag, errors


@pytest.mark.multirank
def test_async_engine_refuses_a_crafted_checkpoint_on_every_rank(dense, tmp_path):
    """The async-zstd side of --resume: the check before DeepSpeed's load (every rank
    gets rank 0's refusal) and the engine's load itself."""
    marker = tmp_path / "marker"
    ckpt = tmp_path / "ckpt"
    path = _crafted_copy(dense["async"], ckpt, marker, name="layer_06-model_states.pt")
    res = run_ranks(_async_engine_refuses_rank, world_size=2, args=(str(ckpt), "layer_06-model_states.pt"),
                    timeout=120)
    for tag, errors in res:
        assert tag == "global_step2" and len(errors) == 2, errors
        assert all(e.startswith(f"{path}: refused to unpickle posix.system") for e in errors), errors
    assert not marker.exists()


@pytest.mark.multirank
def test_universal_checkpoint_loading_is_refused(tmp_path):
    """DeepSpeed reads a universal checkpoint with torch.load(weights_only=False) outside
    the checkpoint engine: that mode is refused at start-up, before anything is written."""
    cfg = _config(tmp_path / "cfg.json", "tiny_1rank.json", engine="deepspeed",
                  mutate=lambda c: c.update(checkpoint={"load_universal": True}))
    res = run_ranks(trainer_rank, world_size=1, init_dist=False, timeout=300,
                    args=(["--deepspeed", cfg, "--steps", "1", "--checkpoint-dir", str(tmp_path / "ckpt")], ))
    assert res[0][0] == 2 and res[0][2].strip().splitlines()[-1].startswith(
        "error: DeepSpeed's checkpoint.load_universal reads files with torch.load(weights_only=False)"), res[0][2]
    assert not (tmp_path / "ckpt").exists()
