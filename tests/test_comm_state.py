"""Compression state in checkpoints (ds_ext/comm/state.py): each rank's error-feedback
residuals, PowerSGD's Q, top-k's sampling generator and the reducer's step count are
saved by both checkpoint engines and restored by --resume.

Single process: the file's contents load through safe_pickle, torch's weights_only
loader and seekspeed's own format, naming no global; a top-k compressor restored from
it (scratch buffers dropped) compresses the next steps bitwise as the one that was
saved, through the torch ops and the fused kernel; the reducer's own dicts (momentum,
STATE_ATTRS) saved and refilled in place; a key that would name a global refused; the
settings fingerprint; what
--resume does per ``seekspeed.comm.on_mismatch`` (load, refuse in one line, restart
with a one-line warning naming what is lost, drop the state for compressor none).
Two gloo ranks through the trainer (2 data-parallel replicas, tiny), for each section of
COMM_CASES (sampled top-k with error feedback after one dense step; target momentum with
sign): an uninterrupted 4-step run (DeepSpeed's engine, checkpoints at 2 and 4; the
momentum at 3, after a momentum step, and 4), resumed from there (RESUMES: top-k with each
engine, momentum with the asynchronous one): the same losses and, at step 4, the same
compression state, bitwise (same arithmetic in the same order); the residuals at the
resumed step are not zero and the generator has moved, and a resume
that drops the state (on_mismatch restart) gives another loss. About 65 s on 2 cores:
six 2-rank training runs of about 10 s each, most of it start-up."""

import io
import json
import os
import shutil

import pytest
import torch

from ds_ext.checkpoint import format as fmt, safe_pickle
from ds_ext.checkpoint.load import check_file, load_file
from ds_ext.comm import state as comm_state
from ds_ext.config import CommSection
from ds_ext.errors import ConfigError
from tests.distributed import run_ranks
from tests.training import trainer_rank, write_config

TOPK = {"compressor": "topk", "ratio": 0.05, "selection": "sampled", "error_feedback": True}


class _Reducer:
    """What state.py reads of a GradientReducer: steps, compressor, section."""

    def __init__(self, section):
        from ds_ext.comm.compressors import make_compressor
        self.section, self.compressor, self.steps = section, make_compressor(section), 0


def _exchange(comp, key, region, views):
    """One top-k exchange on a world of one rank, its collectives done by hand."""
    gen = comp.exchange(key, region, views, None)
    req = next(gen)
    while True:
        for out in req.out:             # all_gather of one rank: its own payload
            out.copy_(req.tensor)
        try:
            req = gen.send(None)
        except StopIteration:
            return region


def _steps(reducer, grads, keys):
    out = []
    for g in grads:
        for c, key in enumerate(keys):
            part = g[c].clone()
            out.append(_exchange(reducer.compressor, key, part, [part[:700], part[700:]]))
        reducer.steps += 1
    return out


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_restored_topk_compresses_bitwise_as_the_saved_one(tmp_path, monkeypatch, kernel):
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    section = CommSection(**TOPK, kernel=kernel)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(2, 3000, generator=g) for _ in range(5)]
    keys = [("dense", 0), (("expert", "ep_size_2_group"), 1)]
    saved = _Reducer(section)
    _steps(saved, grads[:3], keys)
    sd = comm_state.state_dict(saved)
    assert all(set(st) == {"residual"} for _, st in sd["compressor"])     # the accumulator only: no scratch
    assert all(st["residual"].abs().sum() > 0 for _, st in sd["compressor"])
    # through torch.save (the deepspeed engine) and seekspeed's format (async-zstd), restricted loads
    torch.save(sd, tmp_path / "torch.pt")
    fmt.write(tmp_path / "ours.pt", fmt.snapshot(sd))
    check_file(str(tmp_path / "torch.pt"))
    # no global beyond what torch.save names for any tensor
    assert safe_pickle.torch_file_globals(str(tmp_path / "torch.pt")) <= {"torch._utils._rebuild_tensor_v2",
                                                                         "collections.OrderedDict"}
    assert safe_pickle.pickle_globals(io.BytesIO(fmt.read_skeleton(tmp_path / "ours.pt"))) == set()
    loads = [torch.load(tmp_path / "torch.pt", weights_only=True), load_file(str(tmp_path / "torch.pt")),
             load_file(str(tmp_path / "ours.pt"))]
    expected = _steps(saved, grads[3:], keys)
    for back in loads:
        restored = _Reducer(section)
        comm_state.load_state_dict(restored, back)
        assert restored.steps == 3
        got = _steps(restored, grads[3:], keys)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert all(torch.equal(restored.compressor.state[k]["residual"], saved.compressor.state[k]["residual"])
                   for k in keys)


def test_reducer_dicts_are_saved_and_refilled_in_place():
    """``momentum`` and the dicts named in STATE_ATTRS are saved with the compressor's
    state; loading refills the reducer's own dicts, so whoever holds them sees it."""
    def reducer():
        r = _Reducer(CommSection(compressor="powersgd", rank=2))
        r.STATE_ATTRS, r.momentum, r.server = ("server",), {}, {}
        return r
    saved = reducer()
    saved.momentum[("dense", 0)] = torch.arange(3.)
    saved.server[("dense", 0)] = {"server": torch.ones(2)}
    saved.compressor.state[(("dense", 0), 0)] = {"q": torch.ones(4, 2), "e": torch.ones(4, 4)}
    sd = comm_state.state_dict(saved)
    assert sd["generator"] is None and set(sd["attrs"]) == {"momentum", "server"}
    fresh = reducer()
    momentum, server = fresh.momentum, fresh.server
    comm_state.load_state_dict(fresh, sd)
    assert fresh.momentum is momentum and torch.equal(momentum[("dense", 0)], torch.arange(3.))
    assert fresh.server is server and torch.equal(server[("dense", 0)]["server"], torch.ones(2))
    assert torch.equal(fresh.compressor.state[(("dense", 0), 0)]["e"], torch.ones(4, 4))
    with pytest.raises(ValueError, match="this reducer has no dict 'momentum'"):
        comm_state.load_state_dict(_Reducer(CommSection(compressor="powersgd", rank=2)), sd)


def test_a_key_that_would_name_a_global_is_refused_when_saving():
    reducer = _Reducer(CommSection(**TOPK))
    reducer.compressor.state[("dense", torch.Size([3]))] = {"residual": torch.ones(3)}
    with pytest.raises(TypeError, match=r"key part torch.Size\(\[3\]\) \(Size\) cannot be saved"):
        comm_state.state_dict(reducer)


LAYOUT = {"data_parallel": 2, "pipe_stages": 1, "expert_parallel_size": 1, "zero_stage": 1, "schedule": "1f1b",
          "bf16": False, "optimizer": "DeepSpeedZeroOptimizer", "stage_keys": [["0", "1"]], "train_batch": 4}


def test_settings_name_what_the_state_depends_on():
    base = comm_state.settings(CommSection(**TOPK), layout=LAYOUT)
    assert comm_state.settings(CommSection(compressor="none"), layout=LAYOUT) is None
    assert "train_batch" not in base["layout"]
    # what the arithmetic or the chunk keys depend on changes the fingerprint ...
    for change in ({"ratio": 0.1}, {"chunk_mb": 1.0}, {"min_numel": 1}, {"dense_params": ["*embed*"]},
                   {"hierarchical": True}, {"target": "momentum", "warmup_steps": 1}):
        assert comm_state.settings(CommSection(**TOPK | change), layout=LAYOUT) != base, change
    assert comm_state.differences(base, comm_state.settings(CommSection(**TOPK), layout=LAYOUT | {
        "data_parallel": 4})) == ["layout data_parallel 2 -> 4"]
    # the residuals' dtype is recorded only away from fp32, so checkpoints from before it still match
    sign = comm_state.settings(CommSection(compressor="sign"), layout=LAYOUT)
    narrow = comm_state.settings(CommSection(compressor="sign", residual_dtype="bf16"), layout=LAYOUT)
    assert "residual_dtype" not in sign
    assert comm_state.differences(sign, narrow) == ["residual_dtype 'fp32' -> 'bf16'"]
    # so is var_rescale (its tracked level is state: a run that did not track it has none)
    momentum = {"compressor": "sign", "target": "momentum", "warmup_steps": 1}
    rescaled = comm_state.settings(CommSection(**momentum, var_rescale=True), layout=LAYOUT)
    assert "var_rescale" not in comm_state.settings(CommSection(**momentum), layout=LAYOUT)
    assert comm_state.differences(comm_state.settings(CommSection(**momentum), layout=LAYOUT), rescaled) == [
        "var_rescale False -> True"]
    per_tensor = comm_state.settings(CommSection(**momentum, var_rescale="tensor"), layout=LAYOUT)
    assert comm_state.differences(rescaled, per_tensor) == ["var_rescale True -> 'tensor'"]
    # ... what only schedules or checks it does not
    for change in ({"kernel": "torch"}, {"pipeline_depth": 4}, {"warmup_steps": 3}, {"on_mismatch": "restart"}):
        assert comm_state.settings(CommSection(**TOPK | change), layout=LAYOUT) == base, change


def _plan(saved_kw, now_kw, *, layout=LAYOUT, saved_layout=LAYOUT):
    saved = None if saved_kw is None else comm_state.settings(CommSection(**saved_kw), layout=saved_layout)
    section = CommSection(**now_kw)
    return comm_state.resume_plan(saved, comm_state.settings(section, layout=layout), section=section,
                                  path="/ck/global_step2")


@pytest.mark.parametrize("saved_kw, now_kw, saved_layout, match", [
    (TOPK, TOPK | {"ratio": 0.1}, LAYOUT, r"other compression settings \(ratio 0.05 -> 0.1\)"),
    (TOPK, TOPK, LAYOUT | {"data_parallel": 4}, r"other compression settings \(layout data_parallel 4 -> 2\)"),
    (None, TOPK, LAYOUT, r"holds no compression state \(written with seekspeed.comm.compressor none"),
])
def test_resume_refuses_state_that_does_not_apply_in_one_line(saved_kw, now_kw, saved_layout, match):
    with pytest.raises(ConfigError, match=match) as info:
        _plan(saved_kw, now_kw, saved_layout=saved_layout)
    message = str(info.value)
    assert "\n" not in message and message.startswith("--resume: /ck/global_step2")
    assert 'seekspeed.comm.on_mismatch "restart"' in message and "resume with" in message


def test_resume_loads_restarts_or_drops():
    assert _plan(TOPK, TOPK) == comm_state.ResumePlan(load=True, warning=None)
    assert _plan(None, {"compressor": "none"}) == comm_state.ResumePlan(load=False, warning=None)
    dropped = _plan(TOPK, {"compressor": "none"})
    assert not dropped.load and "holds compression state (topk), dropped" in dropped.warning
    restart = _plan(None, TOPK | {"on_mismatch": "restart", "warmup_steps": 3})
    assert not restart.load and "\n" not in restart.warning
    assert restart.warning.endswith("seekspeed.comm.on_mismatch is restart: error-feedback residuals and top-k's "
                                    "sampling generator start empty, and the run begins again with 3 dense warm-up "
                                    "steps")
    powersgd = _plan({"compressor": "powersgd"}, {"compressor": "powersgd", "rank": 8, "on_mismatch": "restart"})
    assert "(rank 4 -> 8)" in powersgd.warning and "residuals and PowerSGD's warm-start Q start empty, and " \
        "compression starts at once (warmup_steps 0)" in powersgd.warning


# -- through the trainer: 2 ranks, 2 data-parallel replicas ---------------------------------------

# the seekspeed.comm sections a resumed run is checked under, one test case each
COMM_CASES = {
    "topk-sampled-error-feedback": TOPK | {"warmup_steps": 1, "min_numel": 2048},
    # the momentum (the reducer's M: after the momentum step 3, where it is resumed, kept as
    # sign's codes), sign's worker and server residuals; the frozen variance and its step
    # count are in DeepSpeed's optimizer state; 0/1 Adam's refreshes (kappa 1: steps 1, 2
    # and 4, the last after the resume, decoding M) follow from the reducer's step count;
    # the residuals kept in bf16 (an fp32 residual is saved as top-k's is, a tensor as it
    # stands); the variance rescaled by the tracked level of the gradient's squared norm
    # (var_rescale: the level is the reducer's variance_level, the factor then enters the
    # optimizer's step), the norm sketched (clip_norm "sketch": its signs seeded by the step)
    "sign-momentum": {"compressor": "sign", "target": "momentum", "warmup_steps": 1, "var_update_scaler": 1,
                      "min_numel": 2048, "residual_dtype": "bf16", "var_rescale": True, "clip_norm": "sketch"},
}
# the step a case is checkpointed every and resumed at (else 2)
RESUME_AT = {"sign-momentum": 3}
# DeepSpeed settings a case changes: the momentum's clip far above the tiny runs' gradient
# norms (about 8 at the first step), so that step 3 keeps M as sign's codes (a momentum
# step that clips keeps it in fp32, as before: test_comm.py's kept-as-codes test)
CASE_CONFIG = {"sign-momentum": {"gradient_clipping": 100.0}}
# (case, engine) resumed: top-k with both engines, the momentum mode with the asynchronous one
RESUMES = [("topk-sampled-error-feedback", "deepspeed"), ("topk-sampled-error-feedback", "async-zstd"),
           ("sign-momentum", "async-zstd")]


def _cfg(tmp_path, name, comm, *, engine, interval=2, ds=None):
    def mutate(c):
        c.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2, **(ds or {}))
        c["pipeline"]["stages"] = 1
        s = c["seekspeed"]
        s["data"]["seq_len"] = 32
        s["checkpoint"].update(interval_steps=interval, engine=engine)
        s["comm"] = comm
    path = tmp_path / f"{name}.json"
    shutil.move(write_config(tmp_path, "tiny_cpu.json", mutate), path)
    return str(path)


def _train(cfg, ckpt, *, resume_from=None, step=2):
    """4 steps, or (``resume_from``) on from its checkpoint of ``step``: (summary, rank 0's stdout, stderr)."""
    if resume_from is not None:
        ckpt.mkdir()
        shutil.copytree(resume_from / f"global_step{step}", ckpt / f"global_step{step}")
        (ckpt / "latest").write_text(f"global_step{step}")
    summary = f"{ckpt}.json"
    argv = ["--deepspeed", cfg, "--steps", "4", "--checkpoint-dir", str(ckpt), "--summary-json", summary]
    res = run_ranks(trainer_rank, world_size=2, init_dist=False, timeout=300,
                    args=(argv + (["--resume"] if resume_from is not None else []),))
    assert [r[0] for r in res] == [0, 0], res[0][1][-3000:] + res[0][2][-3000:]
    with open(summary) as f:
        return json.load(f), res[0][1], res[0][2]


def _comm_files(tag_dir):
    return [load_file(os.path.join(tag_dir, comm_state.file_name(r))) for r in range(2)]


def _tensors(state):
    """Every tensor of a saved reducer state (the compressor's, the reducer's dicts)."""
    def inside(x):
        if torch.is_tensor(x):
            return [x]
        return [t for v in (x.values() if isinstance(x, dict) else x) for t in inside(v)] \
            if isinstance(x, (dict, list, tuple)) else []
    return inside([st for _, st in state["compressor"]]) + inside([x for entries in state["attrs"].values()
                                                                   for _, x in entries])


def _same(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


_UNINTERRUPTED = {}


def _uninterrupted(case, tmp_path_factory):
    """The uninterrupted 4-step run of ``case``, trained once per session."""
    if case not in _UNINTERRUPTED:
        tmp = tmp_path_factory.mktemp(case)
        comm = COMM_CASES[case]
        at = RESUME_AT.get(case, 2)
        ds = CASE_CONFIG.get(case)
        summary, _, _ = _train(_cfg(tmp, "full", comm, engine="deepspeed", interval=at, ds=ds), tmp / "full")
        _UNINTERRUPTED[case] = {"tmp": tmp, "comm": comm, "dir": tmp / "full", "summary": summary, "at": at,
                                "ds": ds}
    return _UNINTERRUPTED[case]


@pytest.mark.multirank
@pytest.mark.parametrize("case, engine", RESUMES)
def test_resume_restores_compression_state_bitwise(case, engine, tmp_path_factory):
    uninterrupted = _uninterrupted(case, tmp_path_factory)
    full, tmp, comm, at = (uninterrupted[k] for k in ("dir", "tmp", "comm", "at"))
    # what the resumed run must get back (without it the losses differ: the restart test)
    fresh = torch.Generator().manual_seed(0).get_state()
    for rank, saved in enumerate(_comm_files(full / f"global_step{at}")):
        assert saved["rank"] == rank and saved["state"]["steps"] == at
        assert any(t.abs().sum() > 0 for t in _tensors(saved["state"]))
        assert saved["state"]["generator"] is None or not torch.equal(saved["state"]["generator"], fresh)
        if comm.get("target") == "momentum":        # M as sign's codes: packed bits and a scale a block
            assert "dict" in [type(m).__name__ for _, m in saved["state"]["attrs"]["momentum"]]
            level = dict(saved["state"]["attrs"]["variance_level"])
            assert float(level["count"]) == at and float(level["level"]) > 0
    resumed, out, _ = _train(_cfg(tmp, f"resume-{engine}", comm, engine=engine, interval=at,
                                  ds=uninterrupted["ds"]),
                             tmp / f"resumed-{engine}", resume_from=full, step=at)
    assert resumed["start_step"] == at
    assert f"comm: every rank's compression state restored ({comm['compressor']}, {at} steps reduced)" in out
    assert resumed["losses"] == uninterrupted["summary"]["losses"][at:]      # same arithmetic, same order: bitwise
    tag = tmp / f"resumed-{engine}" / "global_step4"
    if engine == "async-zstd":   # staged, hashed and committed with the checkpoint
        manifest = json.loads((tag / "manifest.json").read_text())
        assert {comm_state.file_name(r) for r in range(2)} <= set(manifest["files"])
    for ours, theirs in zip(_comm_files(tag), _comm_files(full / "global_step4")):
        assert ours["state"]["steps"] == 4 and _same(ours, theirs)


def _unread(comm):
    """A settings change that ``comm``'s compressor does not read: PowerSGD's rank, or
    (for PowerSGD) the quantisers' block size."""
    if comm["compressor"] == "powersgd":
        return {"block_size": 128}, "(block_size 256 -> 128)"
    return {"rank": 8}, "(rank 4 -> 8)"


@pytest.mark.multirank
def test_resume_that_drops_the_state_trains_otherwise(tmp_path_factory):
    """on_mismatch restart after a settings change the compressor does not read: the
    state is dropped, the dense warm-up runs again; the step-3 loss (computed before
    any reduction) is the same, the step-4 loss is not (top-k)."""
    uninterrupted = _uninterrupted("topk-sampled-error-feedback", tmp_path_factory)
    tmp, comm = uninterrupted["tmp"], uninterrupted["comm"]
    change, named = _unread(comm)
    resumed, _, err = _train(_cfg(tmp, "restart", comm | change | {"on_mismatch": "restart"}, engine="deepspeed"),
                             tmp / "restart", resume_from=uninterrupted["dir"])
    losses = uninterrupted["summary"]["losses"]
    assert resumed["losses"][0] == losses[2] and resumed["losses"][1] != losses[3]
    warning = [line for line in err.splitlines() if "on_mismatch is restart" in line]
    n = comm.get("warmup_steps", 0)
    assert len(warning) == 1 and named in warning[0], err
    assert warning[0].endswith(f"begins again with {n} dense warm-up step{'s' if n != 1 else ''}" if n else
                               "compression starts at once (warmup_steps 0)")
