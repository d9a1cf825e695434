"""``seekspeed.overlap_grad_reduce``: each virtual stage's data-parallel reduction issued
after its last backward/W (ds_ext/pipe/grad_overlap.py).

Single-process: which instruction ends each chunk in the zero-bubble DualPipeV stream
(the W slots' first-in first-out order), DualPipe's shared issue order, the config key, the trace lane.
Multi-rank (4 gloo ranks = 2 stages x 2 data-parallel, one process set for all cases):
the same training with overlap on and off gives the same weights bitwise after 2 steps,
for 1F1B, zero-bubble DualPipeV and DualPipe, each with ZeRO 0 and 1, fp32 and bf16
(DeepSpeed's BF16_Optimizer, with fp32 accumulation under ZeRO 1), and each once with
top-k (exact selection, error feedback).
Why bitwise is the right test: an all-reduce is element-wise, so splitting the
gradients into chunks and buckets only changes which collective an element travels in;
with 2 ranks per data-parallel group each element's sum is a + b, and addition is
commutative, so the collective's internal order cannot change it either (the scaling
before/after the sum is DeepSpeed's, on the same dtype). And the reduction did overlap:
under the two-chunk schedules a chunk's reduction was issued before the rank's last backward
work of the step. About 40 s on 2 quiet cores.
"""

import numpy as np
import pytest

from tests.distributed import run_ranks

# -- single process ------------------------------------------------------------------

def _stream(schedule, stage_id, micro_batches=4, stages=2):
    from ds_ext.pipe import schedules
    from ds_ext.pipe.dualpipe import DualPipeSchedule
    cls = {"dualpipev-zb": schedules.DualPipeVZBSchedule, "dualpipe": DualPipeSchedule}[schedule]
    return [c for st in cls(micro_batches=micro_batches, stages=stages, stage_id=stage_id).steps() for c in st]


def test_last_instruction_of_each_chunk_follows_the_w_slots_fifo():
    from ds_ext.pipe import schedules
    from ds_ext.pipe.grad_overlap import last_instructions
    # rank 0: phase 1's last backward is the full B of buffer 7; phase 0 ends with the final W
    cmds = _stream("dualpipev-zb", 0)
    last = last_instructions(cmds)
    assert cmds[last[1]].name == "BackwardPass" and cmds[last[1]].kwargs == {"buffer_id": 7, "phase": 1, "zb": False}
    ws = [i for i, c in enumerate(cmds) if isinstance(c, schedules.WeightPass)]
    assert last[0] == ws[-1] and last[1] < last[0]
    # rank 1: two deferred B (buffer 7 of phase 1, then buffer 3 of phase 0), then two W:
    # the first W runs phase 1's deferred weights, so phase 1 ends there, not at its B
    cmds = _stream("dualpipev-zb", 1)
    last = last_instructions(cmds)
    ws = [i for i, c in enumerate(cmds) if isinstance(c, schedules.WeightPass)]
    assert (last[1], last[0]) == (ws[-2], ws[-1])
    b7 = next(i for i, c in enumerate(cmds) if c.name == "BackwardPass" and c.kwargs.get("buffer_id") == 7)
    assert cmds[b7].kwargs["zb"] and b7 < last[1]


def test_dualpipe_pair_issues_stage_sums_in_one_order():
    from ds_ext.pipe.grad_overlap import dualpipe_issue_points, last_instructions
    mine, partner = last_instructions(_stream("dualpipe", 0)), last_instructions(_stream("dualpipe", 1))
    a = dualpipe_issue_points(0, 2, mine, partner)
    b = dualpipe_issue_points(1, 2, partner, mine)
    # rank r's chunk p is model stage r (p 0) or 1-r (p 1): the same stage order on both ranks
    assert [0 if c == 0 else 1 for _, c in a] == [1 if c == 0 else 0 for _, c in b]
    # orders that disagree: rank 1 finishes stage 0 (its phase 1) first, rank 0 stage 1 (its phase 1)
    # first; both follow rank 0's order and rank 1 waits for its stage 1 copy before stage 0's sum
    assert dualpipe_issue_points(0, 2, {0: 9, 1: 4}, {0: 8, 1: 3}) == [(4, 1), (9, 0)]
    assert dualpipe_issue_points(1, 2, {0: 8, 1: 3}, {0: 9, 1: 4}) == [(8, 0), (8, 1)]


def test_config_key_is_strict_and_refuses_zero_overlap_comm(tmp_path):
    from ds_ext.config import load_config
    from tests.test_config import _error, _write
    msg = _error(tmp_path, lambda c: c["seekspeed"].update(overlap_grad_reduce="yes"))
    assert "seekspeed.overlap_grad_reduce" in msg
    cfg = load_config(_write(tmp_path, lambda c: c["seekspeed"].update(overlap_grad_reduce=True)), world_size=4)
    assert cfg.section.overlap_grad_reduce is True

    def zero_overlap(c):
        c["seekspeed"]["overlap_grad_reduce"] = True
        c["zero_optimization"] = {"stage": 1, "overlap_comm": True}
    msg = _error(tmp_path, zero_overlap)
    assert "overlap_comm" in msg and "false" in msg


def test_trace_shows_the_reduction_in_its_own_lane(tmp_path):
    import json

    from ds_ext.pipe.trace import DP_TID, from_engine_events, write_chrome_trace
    events = [("BackwardPass", {"buffer_id": 0}, 0.0, 1.0), ("GradReduce", {"chunk": "1"}, 1.0, 3.0),
              ("WaitGradReduce", {}, 2.5, 3.0), ("ReduceGrads", {}, 2.5, 3.1)]
    lane = from_engine_events(events)
    assert [k for k, *_ in lane] == ["B", "dp", "dp-wait", "other"] and "chunk 1" in lane[1][1]
    write_chrome_trace([lane], tmp_path / "t.json")
    tids = {e["name"]: e["tid"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"}
    assert tids[lane[1][1]] == DP_TID and tids["BackwardPass b0"] == 0


# -- multi-rank ------------------------------------------------------------------------

TOPK = {"compressor": "topk", "ratio": 0.1, "selection": "exact", "min_numel": 256, "chunk_mb": 64}
# each schedule with ZeRO 0 and 1 (fp32, bf16 on DeepSpeed's BF16_Optimizer) and once with
# top-k, which selects per tensor (exact: no sampling), so cutting the list into chunks
# changes nothing; the full matrix is benchmarks/grad_overlap_matrix.py
CASES = {
    "1f1b-zero0-fp32": {"schedule": "1f1b", "zero": 0, "precision": "fp32", "comm": None},
    "1f1b-zero1-bf16-fp32-accum": {"schedule": "1f1b", "zero": 1, "precision": "bf16-fp32-accum", "comm": None},
    "1f1b-zero1-fp32-topk": {"schedule": "1f1b", "zero": 1, "precision": "fp32", "comm": TOPK},
    "dualpipev-zb-zero0-bf16": {"schedule": "dualpipev-zb", "zero": 0, "precision": "bf16", "comm": None},
    "dualpipev-zb-zero1-fp32": {"schedule": "dualpipev-zb", "zero": 1, "precision": "fp32", "comm": None},
    "dualpipev-zb-zero0-fp32-topk": {"schedule": "dualpipev-zb", "zero": 0, "precision": "fp32", "comm": TOPK},
    "dualpipe-zero0-fp32": {"schedule": "dualpipe", "zero": 0, "precision": "fp32", "comm": None},
    "dualpipe-zero1-bf16-fp32-accum": {"schedule": "dualpipe", "zero": 1, "precision": "bf16-fp32-accum", "comm": None},
    "dualpipe-zero1-bf16-fp32-accum-topk": {"schedule": "dualpipe", "zero": 1, "precision": "bf16-fp32-accum",
                                            "comm": TOPK},
}


def train(c, overlap, *, steps=2):
    """2 x 2 ranks: a case of CASES trained ``steps`` steps, overlap on or off (also
    benchmarks/grad_overlap_matrix.py's run)."""
    from ds_ext.pipe.engine import InstructionTimeline
    from tests.test_comm_engine import engine_and_batches
    engine, batches = engine_and_batches(c["comm"], zero=c["zero"], precision=c["precision"], stages=2, gas=4,
                                         steps=steps, schedule=c["schedule"], overrides={})
    if overlap:
        engine.enable_grad_overlap()
    losses = []
    for _ in range(steps):
        engine.timeline = InstructionTimeline()
        losses.append(engine.train_batch(batches).item())
    events = engine.timeline.events
    issued = [s for n, _, s, _ in events if n == "GradReduce"]
    work = [s for n, _, s, _ in events if n in ("BackwardPass", "WeightPass", "ForwardBackwardPass")]
    state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    reducer = engine.grad_reducer
    return {"losses": losses, "state": state, "issued_before_last_work": bool(issued and min(issued) < max(work)),
            "num_issued": len(issued), "reducer_steps": reducer.steps if reducer else 0,
            "compressed_numel": reducer.last.compressed_numel if reducer else 0}


def _all_cases():
    return {case: {"off": train(c, False), "on": train(c, True)} for case, c in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, world_size=4, timeout=400)


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_reduction_is_bitwise_deepspeeds(results, case):
    for rank, r in enumerate(results):
        off, on = r[case]["off"], r[case]["on"]
        assert on["losses"] == off["losses"], rank
        for name, want in off["state"].items():
            np.testing.assert_array_equal(on["state"][name], want, err_msg=f"rank {rank} {name}")
        assert off["num_issued"] == 0 and on["num_issued"] > 0
        if CASES[case]["comm"]:
            # the compressor ran, once per step, on both
            assert on["reducer_steps"] == off["reducer_steps"] == 2
            assert on["compressed_numel"] == off["compressed_numel"] > 0
        if CASES[case]["schedule"] != "1f1b":
            # two chunks per rank: the first one's reduction was in flight while the rank still computed
            assert on["issued_before_last_work"], rank
