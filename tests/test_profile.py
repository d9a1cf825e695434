"""Profiling (ds_ext/profile/window.py, ds_ext/profile/comms.py): the --profile step
range, the names of communication events, the rule that counts each collective call
once (c10d front end, gloo/NCCL span, NCCL kernel), a torch.profiler window over two
steps of a 2-rank gloo run (trace files, the ops table, exact all_reduce counts, the
communication share), and DeepSpeed's comms logger summarised per op (counts, bytes,
each call's own time rather than DeepSpeed's running total). Two multi-rank cases of
2 gloo ranks; about 15 s in all on 2 cores.
"""

import json
import os
import time

import pytest

from tests.distributed import run_ranks

# -- the step range -----------------------------------------------------------------------


@pytest.mark.parametrize("text, window", [("10:12", (10, 12)), ("7", (7, 7)), (" 3:3 ", (3, 3)), ("1:100", (1, 100))])
def test_parse_window(text, window):
    from ds_ext.profile.window import parse_window
    assert parse_window(text) == window


@pytest.mark.parametrize("text, match", [
    ("12:10", r"--profile '12:10': the first step must not exceed the last; write FIRST:LAST such as 10:12"),
    ("0:2", r"--profile '0:2': steps count from 1"),
    ("a:b", r"--profile 'a:b' is not a step range; write FIRST:LAST"),
    ("", r"--profile '' is not a step range"),
    ("1:2:3", r"--profile '1:2:3' is not a step range"),
    ("-1", r"--profile '-1' is not a step range"),
    ("3:", r"--profile '3:' is not a step range"),
])
def test_bad_window_is_one_line_error_naming_the_value(text, match):
    from ds_ext.errors import ConfigError
    from ds_ext.profile.window import parse_window
    with pytest.raises(ConfigError, match=match) as info:
        parse_window(text)
    assert "\n" not in str(info.value)


# -- event names and the counting rule ------------------------------------------------------

@pytest.mark.parametrize("name, collective", [
    ("c10d::allreduce_", "all_reduce"), ("gloo:all_reduce", "all_reduce"), ("nccl:all_reduce", "all_reduce"),
    ("c10d::allreduce_coalesced_", "all_reduce"), ("gloo:sparse_all_reduce", "all_reduce"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_reduce"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "all_reduce"),
    ("c10d::allgather_", "all_gather"), ("c10d::_allgather_base_", "all_gather"), ("gloo:all_gather", "all_gather"),
    ("nccl:_all_gather_base", "all_gather"), ("nccl:all_gather_into_tensor_coalesced", "all_gather"),
    ("ncclDevKernel_AllGather_RING_LL", "all_gather"),
    ("c10d::_reduce_scatter_base_", "reduce_scatter"), ("c10d::reduce_scatter_tensor_coalesced_", "reduce_scatter"),
    ("nccl:_reduce_scatter_base", "reduce_scatter"), ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce_scatter"),
    ("c10d::alltoall_base_", "all_to_all"), ("gloo:all_to_all", "all_to_all"), ("nccl:all_to_all", "all_to_all"),
    ("c10d::broadcast_", "broadcast"), ("gloo:broadcast", "broadcast"), ("nccl:_broadcast_oop", "broadcast"),
    ("ncclDevKernel_Broadcast_RING_LL", "broadcast"),
    ("c10d::send", "send"), ("gloo:send", "send"), ("nccl:send 0->1", "send"),
    ("c10d::recv_", "recv"), ("gloo:recv", "recv"), ("gloo:recvAnySource", "recv"), ("nccl:recv 0<-1", "recv"),
    ("c10d::barrier", "barrier"), ("gloo:barrier", "barrier"), ("nccl:all_reduce_barrier", "barrier"),
    ("c10d::monitored_barrier_", "barrier"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "send_recv"),
    ("c10d::reduce_", "reduce"), ("nccl:_reduce_oop", "reduce"), ("gloo:gather", "gather"), ("c10d::scatter_", "scatter"),
    ("record_param_comms", None), ("c10d::check_for_nan", None), ("aten::add_", None), ("aten::all", None),
    ("AllReduce", None), ("ncclDevKernel_Generic", None), ("ProfilerStep#3", None),
])
def test_classify(name, collective):
    from ds_ext.profile.window import classify
    assert classify(name) == collective


def _x(name, cat, start, end, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": start, "dur": end - start, "tid": tid}


def test_each_call_counts_once_from_its_start_to_its_completion():
    from ds_ext.profile.window import collective_intervals, union_us
    events = [
        _x("gloo:all_reduce", "user_annotation", -50, -10, tid=2),          # launched before the window
        _x("c10d::allreduce_", "cpu_op", 0, 10),
        _x("record_param_comms", "cpu_op", 1, 9),
        _x("gloo:all_reduce", "user_annotation", 5, 100, tid=2),            # starts inside the c10d call
        _x("c10d::allreduce_", "cpu_op", 120, 130),
        _x("gloo:all_reduce", "user_annotation", 135, 150, tid=3),          # starts after it returned
        _x("c10d::_reduce_scatter_base_", "cpu_op", 200, 210),
        _x("gloo:all_reduce", "user_annotation", 215, 300, tid=2),          # gloo's reduce_scatter
        _x("c10d::send", "cpu_op", 400, 405),
        _x("gloo:send", "user_annotation", 404, 500),
        _x("aten::mm", "cpu_op", 0, 1000),
        {"ph": "i", "name": "c10d::barrier", "ts": 0},
    ]
    calls = collective_intervals(events)
    assert calls == {"all_reduce": [(0, 100), (120, 150)], "reduce_scatter": [(200, 300)], "send": [(400, 500)]}
    assert union_us([(0, 100), (50, 150), (200, 210)]) == 160
    # with NCCL kernels in the trace, only they count (the collectives' GPU time)
    gpu = events + [_x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 20, 60, tid=7),
                    _x("nccl:all_reduce", "gpu_user_annotation", 20, 60, tid=7)]
    assert collective_intervals(gpu) == {"all_reduce": [(20, 60)]}


def test_window_names_out_dir_when_it_cannot_write(tmp_path):
    from ds_ext.profile.window import ProfileWindow
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out_dir = str(blocker / "profile")
    window = ProfileWindow(1, 1, out_dir=out_dir, rank=0, log=lambda line: None)
    window.before_step(1)
    assert window.active
    with pytest.raises(OSError, match=f"out_dir '{out_dir}'.*choose a writable directory"):
        window.after_step(1)
    assert not window.active


# -- a window over two steps of a 2-rank run -------------------------------------------------

STEPS, FIRST, LAST = 4, 2, 3
PARAMS = 2                               # nn.Linear: weight and bias
CALLS_PER_STEP = 2 * PARAMS              # each gradient all-reduced by torch.distributed and by deepspeed.comm


def _window_rank(out_dir):
    import torch
    import torch.distributed as tdist
    import deepspeed.comm as dist
    from ds_ext.profile.window import ProfileWindow
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logs = []
    window = ProfileWindow(FIRST, LAST, out_dir=out_dir, rank=tdist.get_rank(), log=logs.append)
    active = []
    for step in range(1, STEPS + 1):
        window.before_step(step)
        active.append(window.active)
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        for p in model.parameters():
            tdist.all_reduce(p.grad)
            dist.all_reduce(p.grad)
        opt.step()
        window.after_step(step)
    return {"summary": window.summary, "logs": logs, "active": active + [window.active]}


@pytest.mark.multirank
def test_window_writes_traces_and_counts_each_all_reduce_once(tmp_path):
    out_dir = str(tmp_path / "profile")
    results = run_ranks(_window_rank, world_size=2, args=(out_dir,), timeout=120)
    for rank, res in enumerate(results):
        assert res["active"] == [False, True, True, False, False]
        trace = os.path.join(out_dir, f"rank{rank}.trace.json")
        assert res["logs"] == [f"profile: steps {FIRST}-{LAST} -> {trace}"]
        with open(trace) as f:
            names = [e.get("name") for e in json.load(f)["traceEvents"]]
        calls = (LAST - FIRST + 1) * CALLS_PER_STEP
        assert names.count("c10d::allreduce_") == calls
        assert names.count("gloo:all_reduce") == calls

        s = res["summary"]
        assert s["rank"] == rank and s["steps"] == [FIRST, LAST]
        assert set(s["by_collective"]) == {"all_reduce"}
        assert s["by_collective"]["all_reduce"]["calls"] == calls
        assert 0 < s["comm_share"] <= 1
        assert 0 < s["comm_ms_per_step"] <= s["wall_ms_per_step"]
        assert s["by_collective"]["all_reduce"]["ms_per_step"] == pytest.approx(s["comm_ms_per_step"])
        assert 0 < len(s["top_ops"]) <= 10 and {"name", "self_ms", "calls"} <= set(s["top_ops"][0])
        json.dumps(s)

        with open(os.path.join(out_dir, f"rank{rank}.ops.txt")) as f:
            text = f.read()
        assert "Top 25 operations by self time" in text
        table = text.split("Communication by collective")[1]
        assert any(line.split()[:2] == ["all_reduce", str(calls)] for line in table.splitlines())


# -- DeepSpeed's comms logger ------------------------------------------------------------------

def test_summarise_units_and_bandwidths():
    from ds_ext.profile.comms import format_table, summarise
    logged = {"all_reduce": {400: [2, [1.0, 3.0], [0.0, 0.0], [0.0, 0.0]]},
              "all_gather_into_tensor": {100: [1, [0.5], [0.0], [0.0]]}}
    rows = summarise(logged, world_size=4, per_size=True)
    assert [r["op"] for r in rows] == ["all_reduce", "all_gather_into_tensor"]
    ar, ag = rows
    assert (ar["count"], ar["bytes"], ar["total_ms"], ar["mean_ms"]) == (2, 800, 4.0, 2.0)
    assert ar["algbw_GBps"] == pytest.approx(800 / 4e-3 / 1e9)
    assert ar["busbw_GBps"] == pytest.approx(ar["algbw_GBps"] * 2 * 3 / 4)
    assert ag["algbw_GBps"] == pytest.approx(4 * 100 / 0.5e-3 / 1e9)      # the whole gathered buffer
    assert ag["busbw_GBps"] == pytest.approx(ag["algbw_GBps"] * 3 / 4)
    assert ar["per_size"] == [{"msg_bytes": 400, "count": 2, "bytes": 800, "total_ms": 4.0, "mean_ms": 2.0,
                               "algbw_GBps": ar["algbw_GBps"], "busbw_GBps": ar["busbw_GBps"]}]
    table = format_table(rows)
    assert "all_reduce" in table and "800 B" in table and "GB/s" in table
    assert "comms_logger" in format_table([])


N = 10
BIG, SMALL = 1000, 100                   # float32 elements


def _comms_logger_rank():
    import torch
    import deepspeed.comm as dist
    from ds_ext.profile import comms
    before = comms.enabled()
    dist.configure(enabled=True, prof_all=True)
    try:
        comms.reset()
        big, small = torch.ones(BIG), torch.ones(SMALL)
        t0 = time.perf_counter()
        for _ in range(N):
            dist.all_reduce(big)
            dist.all_reduce(small)
        wall_ms = (time.perf_counter() - t0) * 1e3
        dist.broadcast(small, 0)
        during = comms.enabled()
        rows = comms.summarise(per_size=True)
        table = comms.format_table(rows)
        comms.reset()
        after_reset = comms.summarise()
    finally:
        dist.configure(enabled=False)
    return {"before": before, "during": during, "rows": rows, "table": table, "wall_ms": wall_ms,
            "after_reset": after_reset}


@pytest.mark.multirank
def test_comms_logger_counts_bytes_and_each_calls_own_time():
    for res in run_ranks(_comms_logger_rank, world_size=2, timeout=120):
        assert res["before"] is False and res["during"] is True
        rows = {r["op"]: r for r in res["rows"]}
        assert set(rows) == {"all_reduce", "broadcast"}
        ar = rows["all_reduce"]
        assert ar["count"] == 2 * N and ar["bytes"] == N * 4 * (BIG + SMALL)
        assert [(s["msg_bytes"], s["count"], s["bytes"]) for s in ar["per_size"]] == [
            (4 * SMALL, N, N * 4 * SMALL), (4 * BIG, N, N * 4 * BIG)]
        # DeepSpeed's logged latencies are running totals; summed, they would exceed the loop's time ~N-fold
        assert 0 < ar["total_ms"] <= res["wall_ms"]
        assert ar["mean_ms"] == pytest.approx(ar["total_ms"] / (2 * N))
        assert ar["busbw_GBps"] == pytest.approx(ar["algbw_GBps"])          # 2 (n-1) / n = 1 for 2 ranks
        assert (rows["broadcast"]["count"], rows["broadcast"]["bytes"]) == (1, 4 * SMALL)
        assert "all_reduce" in res["table"] and "broadcast" in res["table"]
        assert res["after_reset"] == []
