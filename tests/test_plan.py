"""The planner (launch/plan.py, ds_ext/planner/): parameter counts per pipeline
rank equal those of the PipelineModules DeepSpeed builds (2 gloo ranks, 1f1b and
dualpipev) and the total equals transformers' DeepseekV3 built on the meta device;
the activation model against the bytes autograd really keeps for our layers; the
bubble is the simulator's; the production configs fit an 80 GB GPU and a too-large
one is refused with its numbers; the compressed reduction's bytes (ds_ext/comm/traffic.py,
sign and int4's two phases by hand) and state per rank (target momentum's full local
momentum under ZeRO 1), and the planner charging the same. About 45 s."""

import json
import os

import pytest
import torch

from ds_ext.planner import Hardware, make_plan
from recipes.layers.costs import activation_bytes as layer_activation_bytes
from tests.distributed import run_ranks
from tests.numerics import saved_bytes_per_token

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


@pytest.mark.parametrize("preset,layer_idx,kind", [("tiny", 0, "dense"), ("tiny-moe", 1, "moe")])
@pytest.mark.parametrize("seq", [64, 128])
def test_activation_model_against_autograd(preset, layer_idx, kind, seq):
    """Within 15 % of what autograd keeps for our decoder layers (fp32, CPU: the math
    attention path keeps the softmax probabilities)."""
    from recipes import deepseek_v3
    from recipes.layers.pipe import DecoderLayerPipe
    config = deepseek_v3.make_config(preset)
    layer = DecoderLayerPipe(config, layer_idx=layer_idx, seed=0).train()
    measured = saved_bytes_per_token(layer, torch.randn(2, seq, config.hidden_size, requires_grad=True))
    model = layer_activation_bytes(config, kind, seq_len=seq, act_bytes=4, fused_attention=False)
    assert abs(model - measured) / measured < 0.15, (model, measured)


def _fast_links():
    """No transfer time: links all but infinitely fast and no latency, the collectives'
    per-step latencies (ds_ext/planner/collectives.py) included."""
    return Hardware(peak_tflops=100.0, efficiency=1.0, intra_gbps=1e12, inter_gbps=1e12, latency_us=0.0,
                    nvlink_latency_us=0.0, nic_latency_us=0.0)


def test_step_time_is_1f1b_by_hand(tmp_path):
    """Two stages, m micro-batches, no transfer time: the last stage (it holds the
    head) is the bottleneck, so 1F1B takes F0 + m (F1 + B1) + B0, with F from 2 FLOPs
    per activated parameter and token plus causal attention, and B = 2F, plus the
    memory-bound passes at HBM bandwidth: each decoder layer's kept activations
    (written by the forward; read, and gradients written, by the backward: in B = 2F),
    the embedding's rows (forward) and their fp32 gradients
    (backward), the head's logits written and read by the fp32 log-softmax (forward)
    and their fp32 gradient (backward)."""
    from recipes import deepseek_v3
    from recipes.layers.counts import activated_parameters
    from ds_ext.pipe.partition import stage_parameter_counts
    m = 8
    path = _config(tmp_path, "tiny_cpu.json", **{"gradient_accumulation_steps": m})
    plan = make_plan(path, nodes=1, ranks_per_node=2, hardware=_fast_links())
    config = deepseek_v3.make_config("tiny")
    specs = deepseek_v3.layer_specs(config, seed=0)
    tokens, seq = 4 * 128, 128
    qk_v = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    F, hbm = [], _fast_links().hbm_gbps * 1e9
    for row in stage_parameter_counts(specs, stages=2, schedule="1f1b", partition_method="type:DecoderLayerPipe"):
        (start, stop), = row["layer_ranges"]
        layers = sum(1 for spec in specs[start:stop] if spec.typename.__name__ == "DecoderLayerPipe")
        flops = tokens * (2 * activated_parameters(specs[start:stop]) + layers * config.num_attention_heads * seq * qk_v)
        kept = layers * tokens * layer_activation_bytes(config, "dense", seq_len=seq, act_bytes=4)
        F.append(flops / 100e12 + kept / hbm)
    B = [2 * f for f in F]
    h, logits = config.hidden_size, tokens * config.vocab_size      # fp32: 4-byte activations
    F[0] += tokens * h * 4 / hbm
    B[0] += tokens * h * 4 / hbm
    F[1] += logits * (2 * 4 + 4) / hbm
    B[1] += logits * (4 + 4) / hbm
    assert F[1] + B[1] > F[0] + B[0]
    assert plan.chunk_costs["F"] == pytest.approx(F) and plan.chunk_costs["B"] == pytest.approx(B)
    assert plan.makespan == pytest.approx(F[0] + m * (F[1] + B[1]) + B[0])
    assert plan.bubble == pytest.approx(plan.makespan - m * (F[0] + B[0]))
    assert plan.step_seconds == pytest.approx(plan.makespan + plan.dp_seconds + plan.optimizer_seconds)


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipev-zb", "dualpipe"])
def test_balanced_bubbles_are_the_dualpipe_formulas(tmp_path, schedule):
    """The planner's schedule times come from the simulator: with equal chunks and no
    transfer time its bubble is the DualPipe README's formula where there is one."""
    from ds_ext.pipe.simulate import formula_bubble, simulate
    path = _config(tmp_path, "tiny_cpu.json", **{"seekspeed.schedule": schedule, "gradient_accumulation_steps": 8})
    plan = make_plan(path, nodes=1, ranks_per_node=2, hardware=_fast_links())
    c = plan.chunk_costs
    sim = simulate(schedule, ranks=2, micro_batches=8, F=c["F"], B=c["B"], W=c["W"])
    assert plan.makespan == pytest.approx(sim.makespan)
    if schedule != "dualpipev":
        even = simulate(schedule, ranks=2, micro_batches=8, F=1.0, B=2.0, W=1.0)
        assert even.bubble == pytest.approx(formula_bubble(schedule, ranks=2, F=1.0, B=2.0, W=1.0))


def test_expert_parallel_shards_memory_not_compute(tmp_path):
    """Expert parallelism divides the routed experts a rank holds and their optimizer
    shard, not the compute: each token still runs its k experts somewhere."""
    plans = {}
    for ep in (1, 2):
        path = _config(tmp_path, "tiny_moe_cpu.json", **{"seekspeed.moe": {"expert_parallel_size": ep}})
        plans[ep] = make_plan(path, nodes=1, ranks_per_node=4, hardware=_fast_links())
    one, two = plans[1].stages, plans[2].stages
    assert all(b.expert_params * 2 == a.expert_params > 0 for a, b in zip(one, two))
    assert plans[1].chunk_costs["F"] == pytest.approx(plans[2].chunk_costs["F"], rel=1e-6)
    assert plans[1].total_params == plans[2].total_params


def _real_state_bytes(cfg_path):
    """Bytes DeepSpeed really holds on this rank after a step: weights, gradients
    (bf16 param.grad and the BF16 optimizer's fp32 accumulation buffer), optimizer
    (fp32 master partition and Adam moments)."""
    from deepspeed.runtime.pipe.topology import ProcessTopology
    from ds_ext.config import load_config
    from ds_ext.pipe.engine import initialize
    from recipes import deepseek_v3
    cfg = load_config(cfg_path, world_size=2)
    model = deepseek_v3.build_pipeline(deepseek_v3.make_config("tiny"),
                                       topology=ProcessTopology(axes=["pipe", "data"], dims=[2, 1]))
    ds = {k: v for k, v in cfg.ds.items() if k != "seekspeed"}
    engine = initialize(model=model, config=ds, schedule="1f1b",
                        model_parameters=[p for p in model.parameters() if p.requires_grad], log=lambda m: None)
    opt = engine.optimizer

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
    seen = {}
    inner_step = opt.step

    def step(*args, **kwargs):       # gradients peak here: the step frees the bf16 ones
        seen["gradients"] = size(p.grad for p in model.parameters()) + size(opt.fp32_groups_gradients_flat)
        return inner_step(*args, **kwargs)
    opt.step = step
    x = torch.randint(0, 512, (4, 128))
    engine.train_batch(iter([(x, x)] * 4))
    states = [v for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"kind": type(opt).__name__, "weights": size(model.parameters()), "gradients": seen["gradients"],
            "optimizer": size(opt.fp32_groups_flat_partition) + size(states)}


@pytest.mark.multirank
def test_memory_equals_deepspeeds_bf16_optimizer(tmp_path):
    """bf16 with fp32 accumulation and ZeRO-1, as the production configs: the plan's
    weights, gradients and optimizer state equal what DeepSpeed allocates (2 ranks)."""
    path = _config(tmp_path, "tiny_cpu.json", **{"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})
    plan = make_plan(path, nodes=1, ranks_per_node=2)
    real = run_ranks(_real_state_bytes, world_size=2, args=(path,), timeout=180)
    for st, got in zip(plan.stages, real):
        assert got["kind"] == "BF16_Optimizer"
        assert st.weights == got["weights"]
        assert st.gradients == pytest.approx(got["gradients"], rel=0.01)
        assert st.optimizer == pytest.approx(got["optimizer"], rel=0.01)


@pytest.mark.parametrize("comm", [{"compressor": "sign"}, {"compressor": "int4"}, {"compressor": "topk"},
                                  {"compressor": "sign", "target": "momentum", "warmup_steps": 100,
                                   "residual_dtype": "bf16"}])
def test_compressors_fit_128node_with_a_tenth_to_spare(tmp_path, comm):
    """sign, int4 and top-k 1 % (fp32 residuals) and the momentum as signs (its residuals in bf16:
    the fp32 local momentum and residual together, 33.4 GB on the fullest rank, do not
    leave the tenth) on 128node.json at 128 nodes x 8: every pipeline rank's total, comm
    state included, within 90 % of an 80 GB GPU."""
    from ds_ext.planner.hardware import GB
    plan = make_plan(_config(tmp_path, "128node.json", **{"seekspeed.comm": comm}), nodes=128, ranks_per_node=8)
    fullest = max(st.total for st in plan.stages)
    assert all(st.comm_state > 0 for st in plan.stages)
    assert fullest <= 0.9 * plan.hardware.memory_gb * GB, fullest / GB


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
    # the JSON's per-rank busy seconds and the reduction's total beside what the step waits for
    assert all(st["busy"] > 0 and st["reduce_seconds"] > 0 for st in figures["stages"])
    assert figures["overlap_grad_reduce"] and 0 < figures["dp_seconds"] < figures["dp_total_seconds"]
    v3 = make_plan(os.path.join(ROOT, "ds_configs", "128node_v3.json"), nodes=128, ranks_per_node=8)
    assert v3.fits and v3.total_params > 670e9 and len(v3.stages) == 16 and v3.schedule == "dualpipev-zb"


def test_compression_shrinks_the_inter_node_bytes(tmp_path):
    (tmp_path / "dense").mkdir()
    dense = make_plan(_config(tmp_path / "dense", "128node.json", **{"seekspeed.overlap_grad_reduce": False}),
                      nodes=128, ranks_per_node=8)
    path = _config(tmp_path, "128node.json", **{"seekspeed.comm": {"compressor": "powersgd", "rank": 4,
                                                                   "hierarchical": True},
                                                "seekspeed.overlap_grad_reduce": False})
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
    # the recipe's own cut (rank 0: the embedding and four decoder layers, with the head's chunk)
    by_type = {"pipeline.partition": "type:DecoderLayerPipe"}
    no_ckpt = make_plan(_config(tmp_path, "128node.json", **{"pipeline.activation_checkpoint_interval": 0}, **by_type),
                        nodes=128, ranks_per_node=8, hardware=Hardware(memory_gb=60))
    assert not no_ckpt.fits and no_ckpt.stages[0].activations > 3 * no_ckpt.stages[0].activations_checkpointed
    every_2 = make_plan(_config(tmp_path, "128node.json", **{"pipeline.activation_checkpoint_interval": 2}, **by_type),
                        nodes=128, ranks_per_node=8)
    (tmp_path / "one").mkdir()
    with_1 = make_plan(_config(tmp_path / "one", "128node.json", **by_type), nodes=128, ranks_per_node=8)
    assert every_2.fits and all(a.activations_checkpointed < b.activations_checkpointed or a.rank == 0
                                for a, b in zip(with_1.stages, every_2.stages))


def test_all_to_all_charged_only_where_no_compute_covers_it(tmp_path):
    """MoE with expert parallelism across nodes: the all-to-all in flight is the same
    whatever the overlap; overlap none charges it less the dispatch the shared expert
    covers, overlap layer also less what the other half of each F&B chunk covers, and an
    F&B chunk costs its two halves' compute plus the uncovered remainder, by hand."""
    plans = {}
    for overlap in ("none", "layer"):
        path = _config(tmp_path, "tiny_moe_cpu.json", **{"seekspeed.moe": {"expert_parallel_size": 2},
                                                         "seekspeed.schedule": "dualpipev-zb",
                                                         "seekspeed.overlap": overlap,
                                                         "gradient_accumulation_steps": 8})
        plans[overlap] = make_plan(path, nodes=2, ranks_per_node=2, hardware=Hardware(inter_gbps=0.05))
    note = {k: next(n for n in p.notes if n.startswith("expert all-to-all")) for k, p in plans.items()}
    wait = {k: next(g.seconds for g in p.traffic if g.group == "expert all-to-all") for k, p in plans.items()}
    flight = {k: float(note[k].split(" ms per step in flight")[0].split(": ")[1].replace(",", "")) for k in note}
    assert flight["none"] == flight["layer"] > wait["none"] * 1e3 > wait["layer"] * 1e3 > 0
    assert plans["layer"].makespan < plans["none"].makespan


# ---- compressed reduction: bytes (ds_ext/comm/traffic.py) and the planner's charge ----

def test_two_phase_bytes_by_hand():
    """sign and int4 (all-to-all, then all-gather of the recompressed segments): P per
    phase = the codes plus a scale per block (sign: 256 entries, int4: 64, their
    defaults); hierarchical 2 (N-1)/N x P per node, flat the node's m ranks' all-to-all
    m (N-1)/N x P plus the ring all-gather's (W-1)/W x P; like a ring all-reduce of P, it
    stays flat in N."""
    from ds_ext.comm.traffic import inter_node_bytes, payload_bytes
    n = 10_000_000
    p = 1_250_000 + 4 * 39_063                                             # ceil(n / 256) scales
    assert payload_bytes("sign", numel=n) == (p, "two_phase")
    assert inter_node_bytes("sign", nodes=2, per_node=8, hierarchical=True, numel=n) == 2 * (2 - 1) / 2 * p
    flat = inter_node_bytes("sign", nodes=2, per_node=8, hierarchical=False, numel=n)
    assert flat == pytest.approx(8 * (1 / 2) * p + 15 / 16 * p)
    int4 = 5_000_000 + 4 * 156_250                                         # ceil(n / 64) scales
    assert inter_node_bytes("int4", nodes=4, per_node=8, hierarchical=True, numel=n) == pytest.approx(2 * 3 / 4 * int4)
    assert payload_bytes("int4", numel=n, block_size=256)[0] == 5_000_000 + 4 * 39_063
    for name in ("sign", "int4"):
        two, many = (inter_node_bytes(name, nodes=k, per_node=8, hierarchical=True, numel=n) for k in (2, 128))
        assert 1.9 * two < many < 2 * two                                   # 2 (N-1)/N: flat in N
        assert inter_node_bytes(name, nodes=128, per_node=8, hierarchical=False, numel=n) < 10 * many
    assert inter_node_bytes("int8", nodes=128, per_node=8, hierarchical=True, numel=n) > 50 * many   # all-gather grows


def test_comm_state_by_hand():
    """What the compression keeps per rank: a chunk-sized region per chunk in flight
    (two-phase: also its encoded input and the segment's sum and tail), the worker
    residual (full size), the two-phase server residual (1/W), target momentum's full
    local momentum; hierarchical: the chunks this rank exchanges (1/m), none on one node."""
    from ds_ext.comm.traffic import CHUNK_NUMEL, state_bytes
    n, c = 16 * CHUNK_NUMEL, CHUNK_NUMEL
    kw = dict(numel=n, nodes=2, per_node=8)
    scratch, two_phase = 4 * 2 * c, 4 * 2 * c * (2 + 2 / 16)
    assert state_bytes("none", hierarchical=False, **kw) == {}
    assert state_bytes("fp32", hierarchical=False, **kw) == {"chunk scratch": scratch}
    assert state_bytes("int8", hierarchical=False, **kw) == {"chunk scratch": scratch, "residual": 4 * n}
    assert state_bytes("sign", hierarchical=False, **kw) == {"chunk scratch": two_phase, "residual": 4 * n,
                                                            "server residual": 4 * n // 16}
    assert state_bytes("int4", hierarchical=False, target="momentum", **kw) == {
        "chunk scratch": two_phase, "local momentum": 4 * n, "residual": 4 * n, "server residual": 4 * n // 16}
    assert state_bytes("sign", hierarchical=True, target="momentum", **kw) == {
        "chunk scratch": 4 * 2 * c * (2 + 2 / 2), "local momentum": 4 * n, "residual": 4 * n / 8,
        "server residual": 4 * n // 16}
    assert state_bytes("sign", hierarchical=True, numel=n, nodes=1, per_node=8) == {"chunk scratch": scratch}
    assert state_bytes("sign", hierarchical=False, numel=1000, nodes=2, per_node=8) == {
        "chunk scratch": 4 * 1000 * (2 + 2 / 16), "residual": 4000, "server residual": 4 * 63}
    # residual; the chunks in flight's new accumulators and one chunk's magnitudes, pooled
    assert state_bytes("topk", hierarchical=False, **kw) == {"chunk scratch": scratch + 4 * 2 * c + 4 * c,
                                                            "residual": 4 * n}
    assert state_bytes("topk", hierarchical=False, momentum=0.9, **kw) == {
        "chunk scratch": scratch + 2 * 4 * 2 * c + 4 * c, "DGC momentum u": 4 * n, "DGC accumulator v": 4 * n}
    assert state_bytes("sign", hierarchical=False, error_feedback=False, **kw) == {"chunk scratch": two_phase}


def _comm_plan(tmp_path, hardware=None, **comm):
    path = _config(tmp_path, "tiny_cpu.json", **{"seekspeed.comm": comm, "seekspeed.topology.placement": "data-pipe"})
    return make_plan(path, nodes=2, ranks_per_node=4, hardware=hardware)      # 2 stages x 4 replicas, 2 per node


@pytest.mark.parametrize("compressor", ["sign", "int4"])
@pytest.mark.parametrize("hierarchical", [False, True])
def test_planner_charges_two_phase_compressors_as_traffic_counts(tmp_path, compressor, hierarchical):
    """The planner's data-parallel bytes out of each node are traffic.py's for the same
    group (2 nodes x 2 replicas of the stage), and its memory adds traffic.py's state;
    target momentum adds exactly the full local momentum (ZeRO 1 shards the optimizer,
    not that). Compression is faster where bytes set the time: on 1 Gb/s links (the
    tiny model's 2 MB gradient on 400 Gb/s ones is latency-bound, ~30 us, where the
    compressors' two or three collectives cost more alpha terms than one all-reduce)."""
    from ds_ext.comm.traffic import inter_node_bytes, state_bytes
    from recipes import deepseek_v3
    slow = Hardware(intra_gbps=1.25, inter_gbps=0.125)
    plans = {target: _comm_plan(tmp_path, slow, compressor=compressor, hierarchical=hierarchical, target=target,
                                warmup_steps=10) for target in ("gradient", "momentum")}
    dense = make_plan(_config(tmp_path, "tiny_cpu.json", **{"seekspeed.topology.placement": "data-pipe"}),
                      nodes=2, ranks_per_node=4, hardware=slow)
    plan = plans["gradient"]
    big = max(plan.stages, key=lambda st: st.params)
    dp = next(t for t in plan.traffic if t.group == "data-parallel")
    counted = inter_node_bytes(compressor, nodes=2, per_node=2, hierarchical=hierarchical, numel=big.params)
    assert dp.inter_bytes_compressed / 2 == pytest.approx(counted)
    assert dp.inter_bytes == next(t for t in dense.traffic if t.group == "data-parallel").inter_bytes
    assert plan.dp_seconds < dense.dp_seconds
    for st, base, mom in zip(plan.stages, dense.stages, plans["momentum"].stages):
        state = state_bytes(compressor, numel=st.params, nodes=2, per_node=2, hierarchical=hierarchical)
        assert st.comm_state_parts == state and st.comm_state == sum(state.values()) > 0
        assert st.total == pytest.approx(base.total + st.comm_state) and base.comm_state == 0
        assert mom.optimizer == st.optimizer == pytest.approx(8 * st.params / 4)     # fp32 Adam, ZeRO 1 over 4
        assert mom.comm_state_parts["local momentum"] == 4 * st.params
        assert mom.total == pytest.approx(st.total + 4 * st.params)
    pipe = next(t for t in plan.traffic if t.group == "pipeline")      # 1f1b: each micro-batch there and back
    assert pipe.intra_bytes + pipe.inter_bytes == 2 * 4 * (4 * 128) * deepseek_v3.make_config("tiny").hidden_size * 4
    mom_dp = next(t for t in plans["momentum"].traffic if t.group == "data-parallel")
    assert mom_dp.inter_bytes_compressed == dp.inter_bytes_compressed       # same bytes per step as the gradient
    assert any("first 10 optimizer steps reduce dense" in n for n in plan.notes)
    assert any(n.startswith("target momentum") for n in plans["momentum"].notes)


def test_comm_state_in_report_json_and_fit_check(tmp_path, capsys):
    from launch.plan import main
    path = _config(tmp_path, "tiny_cpu.json", **{"seekspeed.comm": {"compressor": "sign", "target": "momentum",
                                                                    "warmup_steps": 5}})
    out = tmp_path / "plan.json"
    assert main(["--deepspeed", path, "--nodes", "1", "--gpus-per-node", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "comm state" in text and "after the 5 dense warm-up steps" in text
    stage = json.loads(out.read_text())["stages"][0]
    assert stage["comm_state"] > 0 and "local momentum" in stage["comm_state_parts"]
    tight = stage["total"] - stage["comm_state"] / 2
    assert main(["--deepspeed", path, "--nodes", "1", "--gpus-per-node", "2", "--memory-gb", str(tight / 1e9)]) == 2
    assert "comm state" in capsys.readouterr().err


def _max_load(bounds, costs, schedule, stages):
    from ds_ext.pipe import rank_chunks
    chunk = [sum(costs[bounds[p]:bounds[p + 1]]) for p in range(len(bounds) - 1)]
    return max(sum(chunk[p] for p in set(rank_chunks(schedule, rank=r, stages=stages))) for r in range(stages))


@pytest.mark.parametrize("schedule,stages", [("1f1b", 4), ("dualpipev", 2), ("dualpipev-zb", 3), ("dualpipe", 4)])
def test_balanced_cut_is_the_best_cut(schedule, stages):
    """balanced_cut's busiest rank equals the best over every cut (enumerated), for
    costs with a cheap embedding, a heavy head and uneven layers."""
    import itertools
    import random
    from ds_ext.pipe import virtual_stages
    from ds_ext.pipe.partition import balanced_cut
    rng = random.Random(stages)
    parts = virtual_stages(schedule, stages)
    for _ in range(40):
        n = rng.randint(parts, 11)
        costs = [rng.choice([0.01, 0.3, 1.0, 1.0, 1.05, 2.5]) for _ in range(n)]
        bounds = balanced_cut(costs, schedule=schedule, stages=stages)
        assert bounds[0] == 0 and bounds[-1] == n and all(a < b for a, b in zip(bounds, bounds[1:])), bounds
        best = min(_max_load([0, *cut, n], costs, schedule, stages)
                   for cut in itertools.combinations(range(1, n), parts - 1))
        assert _max_load(bounds, costs, schedule, stages) == pytest.approx(best, rel=1e-12), (costs, bounds)


def _built_bounds(paths):
    """Per schedule: DeepSpeed's parts and this rank's (start, stop) per held chunk."""
    from deepspeed.runtime.pipe.topology import ProcessTopology
    from ds_ext.config import load_config
    from ds_ext.trainer import partition_for
    from recipes import deepseek_v3
    out = {}
    for schedule, cfg_path in paths.items():
        cfg = load_config(cfg_path, world_size=2)
        config = deepseek_v3.make_config("tiny", cfg.section.recipe.overrides)
        model = deepseek_v3.build_pipeline(config, topology=ProcessTopology(axes=["pipe", "data"], dims=[2, 1]),
                                           schedule=schedule, partition_method=partition_for(cfg, deepseek_v3.SPEC, config))
        out[schedule] = (list(model.parts), [list(b) for b in getattr(model, "phase_bounds", [(model._local_start,
                                                                                           model._local_stop)])])
    return out


def test_balanced_partition_builds_the_planned_cut(tmp_path):
    """pipeline.partition "balanced" on a head-heavy tiny model, for 1f1b, dualpipev and
    dualpipe (the three module classes): DeepSpeed's module is cut where the planner cut
    it, the busiest rank is less busy than with the recipe's default cut, and every rank
    holds the chunks the schedule gives it."""
    from ds_ext.pipe import rank_chunks
    overrides = {"vocab_size": 16384, "num_hidden_layers": 8, "first_k_dense_replace": 8}
    plans, paths = {}, {}
    for schedule in ("1f1b", "dualpipev", "dualpipe"):
        changes = {"seekspeed.schedule": schedule, "seekspeed.recipe.overrides": overrides,
                   "gradient_accumulation_steps": 8}
        (tmp_path / schedule / "default").mkdir(parents=True)
        paths[schedule] = _config(tmp_path / schedule, "tiny_cpu.json", **changes,
                                  **{"pipeline.partition": "balanced"})
        plans[schedule] = plan = make_plan(paths[schedule], nodes=1, ranks_per_node=2)
        default = make_plan(_config(tmp_path / schedule / "default", "tiny_cpu.json", **changes), nodes=1,
                            ranks_per_node=2)
        assert plan.partition == "balanced"
        if schedule != "dualpipe":      # on 2 ranks each dualpipe rank holds both parts: every cut is balanced
            assert plan.bounds != default.bounds
            assert max(st.busy for st in plan.stages) < max(st.busy for st in default.stages)
    built = run_ranks(_built_bounds, world_size=2, args=(paths,), timeout=180)
    for rank, per_schedule in enumerate(built):
        for schedule, (parts, phases) in per_schedule.items():
            bounds = plans[schedule].bounds
            assert parts == bounds, schedule
            assert phases == [[bounds[p], bounds[p + 1]] for p in rank_chunks(schedule, rank=rank, stages=2)]


def test_balanced_partition_names_a_layer_the_planner_cannot_cost():
    from deepspeed.pipe import LayerSpec
    from ds_ext.errors import ConfigError
    from ds_ext.trainer import check_partition
    from recipes import deepseek_v3
    config = deepseek_v3.make_config("tiny")
    specs = deepseek_v3.layer_specs(config, seed=0) + [LayerSpec(torch.nn.Identity)]
    with pytest.raises(ConfigError, match="cannot cost layer class Identity"):
        check_partition("balanced", specs, config)


def test_fp8_gemm_throughput_speeds_only_the_weight_matmuls(tmp_path):
    """--fp8-tflops: W (the weight gradients, GEMMs only) runs at the FP8 rate; the
    forward keeps attention's S^2 terms and the memory-bound passes at their rate."""
    import dataclasses
    path = _config(tmp_path, "tiny_dualpipev_cpu.json", **{"seekspeed.schedule": "dualpipev-zb"})
    bf16 = make_plan(path, nodes=1, ranks_per_node=2, hardware=_fast_links())
    fp8 = make_plan(path, nodes=1, ranks_per_node=2, hardware=dataclasses.replace(_fast_links(), fp8_tflops=200.0))
    assert fp8.chunk_costs["W"] == pytest.approx([w / 2 for w in bf16.chunk_costs["W"]])
    assert all(w / 2 < a < b for w, a, b in zip(bf16.chunk_costs["W"][1:-1], fp8.chunk_costs["F"][1:-1],
                                                bf16.chunk_costs["F"][1:-1]))


def test_overlapped_reduction_starts_after_each_chunks_last_backward(tmp_path):
    """seekspeed.overlap_grad_reduce under 1f1b on 2 ranks: the last stage finishes its
    backwards first and reduces while stage 0 drains; stage 0's reduction starts at the
    end of the pipeline. Exposed = max over ranks of (last backward end + reduction)
    - pipeline, from the simulated timeline by hand."""
    import dataclasses
    from ds_ext.config import load_config
    path = _config(tmp_path, "tiny_cpu.json", **{"gradient_accumulation_steps": 8, "pipeline.stages": 2})
    slow = dataclasses.replace(_fast_links(), inter_gbps=0.05, intra_gbps=0.05)
    plain = make_plan(path, nodes=4, ranks_per_node=1, hardware=slow)
    cfg = load_config(path, world_size=4)
    cfg.section.overlap_grad_reduce = True
    over = make_plan(cfg, nodes=4, ranks_per_node=1, hardware=slow)
    assert not plain.overlap_grad_reduce and plain.dp_seconds == plain.dp_total_seconds > 0
    assert over.overlap_grad_reduce and over.dp_total_seconds == plain.dp_total_seconds
    from ds_ext.pipe.simulate import simulate
    c = over.chunk_costs
    sim = simulate("1f1b", ranks=2, micro_batches=8, F=c["F"], B=c["B"], comm=c["p2p"])
    last_b = [max(op.end for op in ops if op.kind == "B") for ops in sim.timeline]
    assert last_b[1] < last_b[0] == pytest.approx(sim.makespan)
    per_rank = [st.reduce_seconds for st in plain.stages]
    assert max(per_rank) == plain.dp_total_seconds
    exposed = max(0.0, max(b + d for b, d in zip(last_b, per_rank)) - sim.makespan)
    assert over.dp_seconds == pytest.approx(exposed)
    assert over.dp_seconds < over.dp_total_seconds
    assert over.step_seconds == pytest.approx(over.makespan + over.dp_seconds + over.optimizer_seconds)


def test_sweep_ranks_the_layouts_that_fit(tmp_path):
    """--sweep on a tiny MoE config (1 node x 4 ranks): every listed layout fits, they
    come fastest first, each is the plan of that layout made on its own, and refused
    combinations are counted with their reason."""
    from ds_ext.planner.sweep import sweep
    path = _config(tmp_path, "tiny_moe_cpu.json")
    fitting, skipped = sweep(path, nodes=1, ranks_per_node=4, hardware=Hardware(), log=lambda m: None)
    assert len(fitting) >= 4 and skipped
    speeds = [c.plan.tokens_per_s for c in fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert {c.schedule for c in fitting} >= {"1f1b", "dualpipev-zb"} and {c.pipe_stages for c in fitting} >= {1, 2}
    assert all(c.micro_batch * c.grad_accum * (4 // c.pipe_stages) == 4 * 4 * 2 for c in fitting)   # the batch
    best = fitting[0]
    from ds_ext.planner.sweep import _variant
    (tmp_path / "best").mkdir()
    p = tmp_path / "best" / "cfg.json"
    p.write_text(json.dumps(_variant(json.loads(open(path).read()), best)))
    assert make_plan(str(p), nodes=1, ranks_per_node=4).tokens_per_s == pytest.approx(best.plan.tokens_per_s)


@pytest.mark.parametrize("shape", [(64, 320), (320, 64), (128, 128), (96, 40)])
def test_newton_schulz_flops_are_deepspeeds_muon_update(shape):
    """The planner's Newton-Schulz FLOPs per matrix equal the matmul FLOPs torch counts
    in DeepSpeed's own muon_update (wide, tall, square)."""
    from torch.utils.flop_counter import FlopCounterMode
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    from ds_ext.muon import newton_schulz_flops
    with FlopCounterMode(display=False) as counter:
        muon_update(torch.randn(*shape), torch.zeros(*shape))
    assert counter.get_total_flops() == newton_schulz_flops(*shape)


def test_muon_matrices_are_the_ones_deepspeed_tags_and_muon_is_priced(tmp_path):
    """The planner's Muon matrices (each layer built alone, named as the pipeline names it)
    are the ones deepspeed.set_optimizer_flags and muon_split put on Newton-Schulz in the
    whole tiny V4 model; on 128node_v4.json switched to Muon (bf16 accumulation, the only
    form DeepSpeed runs it in there) each rank's optimizer state is AdamW's less 4 bytes per
    orthogonalised element of its shard (12 against 8: momentum and staged copy in bf16 plus
    the fp32 master), plus at most two matrices its partition cuts held whole in each Muon
    group (non-expert, routed-expert: their partitions are cut apart), and the step
    grows by the busiest rank's Newton-Schulz seconds (less the smaller state's memory-bound
    pass); a note says so."""
    import deepspeed
    from ds_ext.config import load_config
    from ds_ext.muon import muon_split
    from ds_ext.planner.model import plan_model
    from recipes import deepseek_v4
    from recipes.layers.reference import SequentialReference

    class _MuonConfig:
        optimizer_name, optimizer_params = "muon", {}
    cfg = load_config(_config(tmp_path, "tiny_v4_cpu.json", **{"seekspeed.moe.expert_parallel_size": 1}),
                      world_size=4)
    m = plan_model(cfg)
    model = SequentialReference(deepseek_v4.layer_specs(m.mc, seed=0))
    deepspeed.set_optimizer_flags(_MuonConfig(), model)
    muon_split(model, list(model.parameters()))
    tagged = sorted(p.numel() for p in model.parameters() if p.use_muon)
    planned = sorted(a * b for r in m.rows for f in (True, False) for a, b in r["muon"][f])
    assert planned == tagged and len(tagged) > 20

    adam = make_plan(_config(tmp_path, "128node_v4.json", data_types={}), nodes=128, ranks_per_node=8)
    muon = make_plan(_config(tmp_path, "128node_v4.json", data_types={}, optimizer={"type": "Muon",
                                                                                      "params": {"lr": 2e-2}}),
                     nodes=128, ranks_per_node=8)
    dp = adam.layout["data_parallel"]
    with open(os.path.join(ROOT, "ds_configs", "128node_v4.json")) as f:
        ep = json.load(f)["seekspeed"]["moe"]["expert_parallel_size"]
    mm = plan_model(load_config(_config(tmp_path, "128node_v4.json", data_types={}), world_size=1024))
    for a, b in zip(adam.stages, muon.stages):
        rows = [r for lo, hi in a.layers for r in mm.rows[lo:hi]]
        mats = [(x, f) for r in rows for f in (True, False) for x in r["muon"][f]]
        share = sum(x[0] * x[1] / (dp // ep if f else dp) for x, f in mats)
        whole = sum(sum(sorted((x[0] * x[1] for x, g in mats if g == f), reverse=True)[:2])
                    for f in (True, False)) * 2 * 2
        assert b.optimizer == pytest.approx(a.optimizer - 4 * share + whole, rel=1e-9)
        assert b.muon_seconds > 0 and a.muon_seconds == 0
    # the optimizer's memory-bound pass reads and writes the (smaller) state of the rank with the most parameters
    from ds_ext.planner.hardware import GB
    big = max(range(len(adam.stages)), key=lambda i: adam.stages[i].params)
    pass_change = 2 * (muon.stages[big].optimizer - adam.stages[big].optimizer) / (adam.hardware.hbm_gbps * GB)
    assert muon.step_seconds - adam.step_seconds == pytest.approx(
        max(st.muon_seconds for st in muon.stages) + pass_change, rel=1e-9)
    assert any(n.startswith("optimizer Muon: Newton-Schulz (5 steps") for n in muon.notes), muon.notes
    assert not any("Muon" in n for n in adam.notes)


def test_exact_grad_norm_is_priced_on_each_ranks_share(tmp_path):
    """``seekspeed.grad_norm: "exact"`` on 128node_v4.json (the BF16 optimizer, experts
    across nodes): the optimizer time grows by the busiest rank's share of the gradients
    (non-expert over the data-parallel group, routed experts over their own) times the
    passes' bytes at the GPU's memory bandwidth, and a note names it; nothing else moves."""
    from ds_ext.grad_norm import BYTES_PER_ELEMENT
    from ds_ext.planner.hardware import GB
    base = make_plan(os.path.join(ROOT, "ds_configs", "128node_v4.json"), nodes=128, ranks_per_node=8)
    exact = make_plan(_config(tmp_path, "128node_v4.json", **{"seekspeed.grad_norm": "exact"}), nodes=128,
                      ranks_per_node=8)
    dp = base.layout["data_parallel"]
    with open(os.path.join(ROOT, "ds_configs", "128node_v4.json")) as f:
        ep = json.load(f)["seekspeed"]["moe"]["expert_parallel_size"]
    want = max(((st.params - st.expert_params) / dp + st.expert_params / (dp // ep)) for st in base.stages) \
        * BYTES_PER_ELEMENT / (base.hardware.hbm_gbps * GB)
    assert exact.optimizer_seconds - base.optimizer_seconds == pytest.approx(want, rel=1e-9)
    assert exact.step_seconds - base.step_seconds == pytest.approx(want, rel=1e-9)
    assert 0 < want < 0.01 * base.step_seconds          # 57 ms of 26 s
    assert [n for n in exact.notes if n not in base.notes] == [next(n for n in exact.notes
                                                                    if n.startswith("grad_norm exact: "))]


def test_zero_one_schedule_is_named_with_its_dense_steps(tmp_path, capsys):
    """0/1 Adam's variance schedule in the planner's notes: its dense steps counted as the
    reducer takes them (the warm-up, then every refresh step after it)."""
    from ds_ext.comm.reducer import GradientReducer
    from ds_ext.config import CommSection
    from ds_ext.planner.notes import dense_steps
    from launch.plan import main
    comm = {"compressor": "sign", "target": "momentum", "warmup_steps": 2, "var_update_scaler": 4,
            "var_freeze_step": 500}
    path = _config(tmp_path, "tiny_cpu.json", **{"seekspeed.comm": comm})
    assert main(["--deepspeed", path, "--nodes", "1", "--gpus-per-node", "2"]) == 0
    text = capsys.readouterr().out
    section = CommSection(**comm)
    reducer = GradientReducer(section, node_of=[0, 0])
    taken = {}
    for step in range(1, 1001):
        taken[step] = taken.get(step - 1, 0) + reducer.dense_now
        reducer.steps += 1
    for run in (300, 1000):
        assert dense_steps(section, run) == taken[run]
    assert "var_update_scaler 4, var_freeze_step 500" in text and f"{taken[300]} of the first 300" in text


def test_sketched_clip_norm_adds_one_small_all_reduce_a_group():
    """seekspeed.comm.clip_norm "sketch": each data-parallel group's compressed reduction
    gains a flat all-reduce of the sketch's 4 x clip_sketch_buckets bytes (the dense
    figures are DeepSpeed's, unchanged); 16 nodes x 8 ranks, sign's two-phase payload."""
    from ds_ext.comm.traffic import payload_bytes
    from ds_ext.planner import collectives as cc
    from ds_ext.planner.reductions import dp_group
    hw = Hardware()
    members = [r // 8 for r in range(128)]

    def payload(numel, ranks):
        return payload_bytes("sign", numel=numel, block_size=256)
    kw = dict(numel=50_000_000, grad_bytes=4, members=members, hw=hw, compressor="sign", hierarchical=False,
              payload=payload)
    base, sketched = dp_group(**kw), dp_group(**kw, sketch_bytes=4096)
    extra = cc.all_reduce(4096, nodes=16, per_node=8, fabric=hw.fabric())
    for k in ("intra_bytes", "inter_bytes", "seconds"):
        assert sketched[k] == base[k]
    assert sketched["inter_bytes_compressed"] == pytest.approx(base["inter_bytes_compressed"] + extra.inter_bytes)
    assert sketched["seconds_compressed"] == pytest.approx(base["seconds_compressed"] + extra.seconds)
    assert 0 < extra.inter_bytes < 1e-3 * base["inter_bytes_compressed"]


def test_tensor_rescale_adds_each_tensors_sketch_to_the_all_reduce():
    """var_rescale "tensor" sends, in the clip sketch's all-reduce, min(numel,
    var_rescale_buckets) fp32 entries per tensor of the group (ds_ext/comm/norm_sketch.py
    tensor_sketches); the planner's sketch bytes are the clip sketch's 4 x 1024 plus those.
    No sketch (clip_norm "rms", target gradient): none."""
    from ds_ext.config import CommSection
    from ds_ext.planner.reductions import sketch_bytes
    matrices = [(7168, 2048), (1, 7168), (4, 5)]
    base = dict(compressor="sign", target="momentum", warmup_steps=1, clip_norm="sketch")
    assert sketch_bytes(CommSection(**base), matrices) == 4096
    assert sketch_bytes(CommSection(**base, var_rescale="tensor"), matrices) == 4096 + 4 * (32 + 32 + 20)
    assert sketch_bytes(CommSection(**base, var_rescale="tensor", var_rescale_buckets=64), matrices) == \
        4096 + 4 * (64 + 64 + 20)
    assert sketch_bytes(CommSection(**base | {"clip_norm": "rms"}), matrices) == 0
    assert sketch_bytes(CommSection(compressor="sign"), matrices) == 0
