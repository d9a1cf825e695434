"""Pipelined training computes the single-process model's gradients, step after step.

DeepSpeed's 1F1B (2 stages: dense, MoE, and 2 replicas with tied embeddings), DeepSpeed's
DualPipeV (2 ranks x 2 stages each; tied embeddings; MTP), this repository's zero-bubble
DualPipeV (an F&B hook that runs backward first; document-bounded attention with the token
ids travelling along; MoE on 4 ranks) and its bidirectional DualPipe (2 and 4 ranks) train
the tiny recipe for a few optimizer steps on fixed data, ZeRO-1, gradient clipping at 1.0
and DeepSpeed's AdamW.

At every step a single-process reference starts from the pipelined run's own weights
(teacher forcing: a difference in one step never compounds into the next), runs each
micro-batch of each replica alone, every occurrence of a tied layer as its own module, and
checks:
- the step's loss, the gradient norm DeepSpeed clipped with, and the gradient DeepSpeed's
  optimizer received (reduced over micro-batches, replicas, tied layers and stage copies,
  then clipped; read from ZeRO's fp32 partitions), against bounds derived from fp32's unit
  roundoff (tests/numerics.py, and _gradient_bound below): the pipelined run adds the same
  per-micro-batch gradients in another order, which no tolerance tuned on one CPU stands in
  for;
- bitwise: the first step's weights equal the reference model's (same seeds), and every
  rank holding a copy of a tensor (tied layers, stage copies, replicas) holds the same bits.
DualPipe and the zero-bubble DualPipeV (2 ranks, tied embeddings) also train in the
production precision, bf16 with fp32 accumulation (DeepSpeed's BF16_Optimizer), against a
reference in bf16: the micro-batch gradients are the same bf16 numbers in both runs, so
the bounds follow from fp32's unit roundoff for the accumulation and the copy-sum (checked
on each rank's fp32 gradient before the reduction over replicas) and from bf16's, 2^-8,
only for DeepSpeed's bf16 reduction after it (_bf16_gradient_bound).
Multi-rank (2-4 gloo ranks); about 15 s per case on 2 cores.
"""

import math

import numpy as np
import pytest
import torch

from tests.distributed import run_ranks, compute_threads
from tests.numerics import BF16, UNIT_ROUNDOFF, assert_within, gamma

STEPS = 3
SEQ = 32
MICRO = 2
LR = 1e-3
SEED = 7
CLIP = 1.0
OPT = {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
U32 = UNIT_ROUNDOFF[np.dtype("float32")]


def _model_config(overrides):
    from recipes import deepseek_v3
    return deepseek_v3.make_config("tiny", {"num_hidden_layers": 4, **overrides})


def _data(*, dp, gas, vocab, document_token=None):
    g = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, vocab, (STEPS, dp, gas, MICRO, SEQ + 1), generator=g)
    if document_token is not None:          # documents of 3 to 9 tokens
        ends = torch.randint(3, 10, (STEPS, dp, gas, MICRO, SEQ + 1), generator=g)
        data[(torch.arange(SEQ + 1) % ends) == 0] = document_token
    return data


def _backward_first(forward, backward):
    """An overlapped_forward_backward hook that runs the F&B chunk's two halves in the
    other order; any order is correct, they belong to different micro-batches."""
    backward()
    forward()


def _capture_optimizer_gradients(engine):
    """Record, at each optimizer step, the (reduced, clipped) fp32 gradient of every
    parameter fragment this rank updates: {name: [(start in the flat parameter, values)]}.
    The link between a parameter and its slice of the fp32 partition (``_hp_mapping``) says
    which elements the rank holds: ZeRO-1's, or, under bf16 with fp32 accumulation,
    DeepSpeed's BF16_Optimizer's (captured as it hands its partitions to the inner AdamW)."""
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    captured = {}

    def capture(params, flat):
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is not None:
                hp = mapping.get_hp_fragment_address()
                captured.setdefault(names[id(p)], []).append(
                    (mapping.lp_fragment_address.start, flat.grad.narrow(0, hp.start, hp.numel).clone()))

    if hasattr(opt, "bf16_groups"):
        inner_step = opt.optimizer.step

        def capture_then_inner_step(*args, **kwargs):
            for params, flat in zip(opt.bf16_groups, opt.fp32_groups_flat_partition):
                capture(params, flat)
            return inner_step(*args, **kwargs)

        opt.optimizer.step = capture_then_inner_step
        return captured
    step = opt._optimizer_step

    def capture_then_step(group_no):
        capture(opt.bit16_groups[group_no], opt.single_partition_of_fp32_groups[group_no])
        step(group_no)

    opt._optimizer_step = capture_then_step
    return captured


def _capture_bf16_gradients_before_reduction(engine):
    """Record BF16_Optimizer's fp32 gradient of every parameter this rank holds as the
    ReduceGrads instruction hands it to DeepSpeed's reduction over replicas (after
    DualPipe's copy-sum): {name: values}."""
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    captured = {}
    reduce = engine._bf16_reduce_grads

    def capture_then_reduce():
        for params, grads in zip(opt.bf16_groups, opt.fp32_groups_gradients):
            for p, g in zip(params, grads):
                captured[names[id(p)]] = g.view(p.shape).clone()
        reduce()

    engine._bf16_reduce_grads = capture_then_reduce
    return captured


def _pipeline_rank(schedule, stages, gas, overrides, hook=False, document_token=None, precision="fp32"):
    import deepspeed  # noqa: F401  (the engine's imports)
    from deepspeed import comm as dist
    from recipes import deepseek_v3
    from ds_ext.pipe.engine import initialize
    config = _model_config(overrides)
    dp = dist.get_world_size() // stages
    model = deepseek_v3.build_pipeline(config, num_stages=stages, schedule=schedule, seed=SEED,
                                       document_token=document_token)
    if hook:
        model.overlapped_forward_backward = _backward_first
    ds_config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
                 "gradient_clipping": CLIP, "steps_per_print": 10**6,
                 "optimizer": {"type": "AdamW", "params": OPT},
                 "zero_optimization": {"stage": 1}}
    if precision == "bf16":     # DeepSpeed's BF16_Optimizer, as ds_configs/128node.json
        ds_config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    engine = initialize(model=model, config=ds_config, model_parameters=list(model.parameters()), schedule=schedule)
    captured = _capture_optimizer_gradients(engine)
    before_reduction = _capture_bf16_gradients_before_reduction(engine) if precision == "bf16" else {}
    data = _data(dp=dp, gas=gas, vocab=config.vocab_size, document_token=document_token)[
        :, model._grid.get_data_parallel_id()]
    it = ((data[step, m, :, :-1], data[step, m, :, 1:]) for step in range(STEPS) for m in range(gas))
    steps = []
    for _ in range(STEPS):
        # bf16 weights travel as fp32 (exact); "dtypes" says what they were
        weights = {k: v.to(torch.float32, copy=True) for k, v in engine.module.state_dict().items()}
        captured.clear()
        before_reduction.clear()
        loss = engine.train_batch(it).item()
        steps.append({"weights": weights, "dtypes": {k: str(v.dtype) for k, v in engine.module.state_dict().items()},
                      "loss": loss, "norm": float(engine.get_global_grad_norm()),
                      "grads": {k: list(v) for k, v in captured.items()},
                      "before_reduction": dict(before_reduction), "replica": model._grid.get_data_parallel_id()})
    return steps


class _PerOccurrence(torch.nn.Module):
    """The model of ``specs`` in one process, every occurrence of a tied layer its own
    module (loaded with the same weights), so the gradient each occurrence contributes
    stays apart; state-dict keys are a PipelineModule's."""

    def __init__(self, specs):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        self.prefixes, self.fns = [], []
        for idx, spec in enumerate(specs):
            key = getattr(spec, "key", None)
            self.layers.append(spec.build())
            self.prefixes.append(f"tied_modules.{key}." if key is not None else f"{idx}.")
            self.fns.append(getattr(spec, "forward_fn", None) if key is not None else None)

    def load(self, state):
        for prefix, module in zip(self.prefixes, self.layers):
            module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    def occurrences(self):
        """{pipeline parameter name: [the parameter in each occurrence]}."""
        out = {}
        for prefix, module in zip(self.prefixes, self.layers):
            for name, p in module.named_parameters():
                out.setdefault(prefix + name, []).append(p)
        return out

    def forward(self, x):
        for module, fn in zip(self.layers, self.fns):
            x = module(x) if fn is None else fn(module, x)
        return x


def _reference_step(model, loss_fn, weights, rows, *, dp, gas):
    """From ``weights``: every (replica, micro-batch, occurrence) gradient of the loss
    scaled by 1 / gas as DeepSpeed scales it, as float64 terms; and the micro-batch losses."""
    model.load(weights)
    occurrences = model.occurrences()
    terms = {name: [] for name in occurrences}
    losses = []
    for r in range(dp):
        for m in range(gas):
            model.zero_grad(set_to_none=True)
            batch = rows[r, m]
            loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
            (loss / gas).backward()
            losses.append(loss.item())
            for name, params in occurrences.items():
                terms[name] += [torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
                                for p in params]
    return terms, losses


def _assemble(results, step, shapes):
    """The full gradient of every parameter from every rank's fragments; ranks holding the
    same elements (tied layers, stage copies) must agree bitwise."""
    full = {k: np.zeros(math.prod(s), dtype=np.float32) for k, s in shapes.items()}
    seen = {k: np.zeros(math.prod(s), dtype=bool) for k, s in shapes.items()}
    for rank, r in enumerate(results):
        for name, pieces in r[step]["grads"].items():
            for start, values in pieces:
                sl = slice(start, start + values.size)
                both = seen[name][sl]
                assert np.array_equal(full[name][sl][both], values[both]), \
                    f"step {step + 1}: rank {rank}'s gradient of {name} differs from another holder's"
                full[name][sl], seen[name][sl] = values, True
    missing = [k for k, s in seen.items() if not s.all()]
    assert not missing, f"step {step + 1}: no rank updated all of {missing[:3]}"
    return {k: v.reshape(shapes[k]) for k, v in full.items()}


def _sum_and_its_bound(terms, *, dp):
    """The exact gradient (sum of the terms / dp) and e, the elementwise bound on how far
    an fp32 sum of the same terms in any order is from it; the largest term count."""
    exact, bound_e, count = {}, {}, 0
    for name, t in terms.items():
        stack = torch.stack(t)
        exact[name] = (stack.sum(0) / dp).numpy()
        abs_sum = (stack.abs().sum(0) / dp).numpy()
        # the reference's own float64 sum is off by at most k * 2^-53 of the absolute sum
        bound_e[name] = (gamma(len(t) - 1) + gamma(len(t), np.float64)) * abs_sum
        count = max(count, len(t))
    return exact, bound_e, count


def _norm(arrays):
    return math.sqrt(sum(float((v ** 2).sum()) for v in arrays.values()))


def _gradient_bound(terms, *, dp, pipe_norm, num_reducers):
    """The reference gradient (exact sum, clipped as DeepSpeed clips) and the elementwise
    bound on the pipelined run's difference from it.

    Each element of the pipelined gradient is fl(sum of its k terms) / dp, clipped by
    s = 1 / max(1, (norm + 1e-6) / CLIP); dp is a power of two (exact). Then:
    - the sum: |fl(sum) - sum| <= e = gamma(k - 1) * sum|terms| / dp, in any order;
    - the norm DeepSpeed computes from that gradient (fp64 sums of squares per partition,
      cast to fp32, summed over ``num_reducers`` ranks and groups in fp32, square root):
      |norm - norm_exact| <= ||e|| + (num_reducers + 4) u (norm_exact + ||e||), checked;
    - s is 1/CLIP-Lipschitz in the norm where it clips and 1 where not, and DeepSpeed's
      fp32 arithmetic for it (add, divide, reciprocal) adds 3u relative, the scaling of
      each element u: |s - s_exact| <= ds = |norm - norm_exact| / CLIP + 4u s_exact;
    - so |g - s_exact sum / dp| <= (s_exact + ds) e + ds |sum / dp| + u |g|."""
    exact, bound_e, count = _sum_and_its_bound(terms, dp=dp)
    norm_exact, e_norm = _norm(exact), _norm(bound_e)
    norm_bound = e_norm + (num_reducers + 4) * U32 * (norm_exact + e_norm)
    assert abs(pipe_norm - norm_exact) <= norm_bound, \
        f"gradient norm {pipe_norm!r} vs the reference's {norm_exact!r}: more than its bound {norm_bound:.3e} apart"
    s_exact = 1.0 / max(1.0, (norm_exact + 1e-6) / CLIP)
    ds = abs(pipe_norm - norm_exact) / CLIP + 4 * U32 * s_exact
    out = {}
    for name in exact:
        want = exact[name] * s_exact
        bound = (s_exact + ds) * bound_e[name] + ds * np.abs(exact[name]) + U32 * (np.abs(want) + ds * np.abs(exact[name]))
        out[name] = (want, bound)
    return out, count


def _bf16_gradient_bound(terms, *, dp, pipe_norm, pipe_ranks):
    """``_gradient_bound`` for DeepSpeed's BF16_Optimizer (bf16 weights and arithmetic,
    ``grad_accum_dtype: fp32``, DeepSpeed's default bf16 communication). Returns the
    reference for the optimizer's gradient, as ``_gradient_bound``, and for each replica
    r the reference for its gradient before DeepSpeed's reduction: {name: (want, bound)}.

    Each micro-batch's gradient is computed in bf16 by the same arithmetic as the
    reference's (the same weights, by teacher forcing; the same kernels on the same
    shapes), so the terms are the same bf16 numbers: bf16's rounding of the forward and
    backward enters both runs alike and no bound needs it. After the terms:
    - before the reduction, replica r's gradient P_r is an fp32 sum of its terms (the
      optimizer's fp32 buffer accumulates each backward and W slot; the stage copies are
      summed in fp32): |P_r - E_r| <= e_r = gamma(k_r - 1) sum|terms of r|, the fp32 bound.
      Checked on its own, because what follows rounds to bf16: copies summed in bf16 (off
      by up to 2^-9 of P_r) would hide under the final bound, not under e_r;
    - DeepSpeed's reduction over replicas (``communication_data_type`` defaults to bf16
      under bf16) rounds each P_r to bf16, adds the dp of them in bf16 (each P_r meets
      at most dp roundings of 2^-8) and divides by dp (a power of two, exact):
      |G~ - sum / dp| <= E = (gamma_bf16(dp) sum_r (|E_r| + e_r) + sum_r e_r) / dp; a
      dropped copy (a whole term) is still outside it;
    - the norm BF16_Optimizer computes from G~ (each parameter's torch norm in fp32: at
      most n squares and n - 1 additions, n the largest parameter's size, and a square
      root; squared; T parameters and ``pipe_ranks`` partial sums added in fp32; a square
      root): |norm - ||sum / dp||| <= ||E|| + gamma(n + T + pipe_ranks + 4) (||sum / dp|| +
      ||E||), checked; it also catches a copy counted twice or not at all;
    - the clip coefficient c = CLIP / fl(norm + 1e-6), recomputed here from the reported
      norm with DeepSpeed's fp32 arithmetic (bitwise); where c < 1 each element is
      multiplied by it, one rounding: |g - c sum / dp| <= c E + u c (|sum / dp| + E);
      elsewhere g = G~."""
    replicas = []
    for r in range(dp):
        per = {name: t[r * len(t) // dp:(r + 1) * len(t) // dp] for name, t in terms.items()}
        exact_r, e_r, _ = _sum_and_its_bound(per, dp=1)
        replicas.append({name: (exact_r[name], e_r[name]) for name in exact_r})
    exact, big_e = {}, {}
    for name in terms:
        parts = [rep[name] for rep in replicas]
        exact[name] = sum(want for want, _ in parts) / dp
        big_e[name] = (gamma(dp, BF16) * sum(np.abs(want) + e for want, e in parts) + sum(e for _, e in parts)) / dp
    norm_exact, e_norm = _norm(exact), _norm(big_e)
    n = max(v.size for v in exact.values())
    norm_bound = e_norm + gamma(n + len(exact) + pipe_ranks + 4) * (norm_exact + e_norm)
    assert abs(pipe_norm - norm_exact) <= norm_bound, \
        f"gradient norm {pipe_norm!r} vs the reference's {norm_exact!r}: more than its bound {norm_bound:.3e} apart"
    coef = float(CLIP / (torch.tensor(pipe_norm, dtype=torch.float32) + 1e-6))
    out = {}
    for name in exact:
        if coef < 1:
            out[name] = (coef * exact[name], coef * big_e[name] + U32 * coef * (np.abs(exact[name]) + big_e[name]))
        else:
            out[name] = (exact[name], big_e[name])
    return out, replicas

CASES = {
    "1f1b-pp2": dict(schedule="1f1b", world=2, stages=2, gas=4, overrides={}),
    "1f1b-pp2-dp2-tied": dict(schedule="1f1b", world=4, stages=2, gas=2, overrides={"tie_word_embeddings": True}),
    "dualpipev-pp2-tied": dict(schedule="dualpipev", world=2, stages=2, gas=4, overrides={"tie_word_embeddings": True}),
    "1f1b-pp2-moe": dict(schedule="1f1b", world=2, stages=2, gas=2, overrides={
        "first_k_dense_replace": 1, "n_routed_experts": 8, "moe_intermediate_size": 48, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}),
    "dualpipev-pp2-mtp": dict(schedule="dualpipev", world=2, stages=2, gas=4, overrides={"num_mtp_layers": 1}),
    "dualpipev-zb-pp2-tied-hook": dict(schedule="dualpipev-zb", world=2, stages=2, gas=4,
                                       overrides={"tie_word_embeddings": True}, hook=True),
    "dualpipev-zb-pp2-document": dict(schedule="dualpipev-zb", world=2, stages=2, gas=4, overrides={},
                                      document_token=256),
    "dualpipe-pp2-tied": dict(schedule="dualpipe", world=2, stages=2, gas=4, overrides={"tie_word_embeddings": True}),
    "dualpipe-pp4-dp1": dict(schedule="dualpipe", world=4, stages=4, gas=8, overrides={"num_hidden_layers": 8}),
    # the production precision (ds_configs/128node.json): bf16, fp32 accumulation (BF16_Optimizer)
    "dualpipe-pp2-tied-bf16": dict(schedule="dualpipe", world=2, stages=2, gas=4, overrides={"tie_word_embeddings": True},
                                   precision="bf16"),
    "dualpipev-zb-pp2-tied-bf16": dict(schedule="dualpipev-zb", world=2, stages=2, gas=4,
                                       overrides={"tie_word_embeddings": True}, precision="bf16"),
    "dualpipev-zb-pp4-moe": dict(schedule="dualpipev-zb", world=4, stages=4, gas=8, overrides={
        "num_hidden_layers": 8, "first_k_dense_replace": 1, "n_routed_experts": 8, "moe_intermediate_size": 48,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2}),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_matches_single_process(case):
    from recipes import deepseek_v3
    from recipes.layers.pipe import CausalLMLoss
    from recipes.layers.reference import SequentialReference
    c = CASES[case]
    bf16 = c.get("precision") == "bf16"
    results = run_ranks(_pipeline_rank, world_size=c["world"], args=(c["schedule"], c["stages"], c["gas"],
                                                                        c["overrides"], c.get("hook", False),
                                                                        c.get("document_token"),
                                                                        c.get("precision", "fp32")),
                        timeout=240)
    torch.set_num_threads(compute_threads())
    dp, gas = c["world"] // c["stages"], c["gas"]
    config = _model_config(c["overrides"])
    specs = deepseek_v3.layer_specs(config, seed=SEED, document_token=c.get("document_token"))
    model, loss_fn = _PerOccurrence(specs), CausalLMLoss(0.3, mtp=config.num_mtp_layers > 0)
    if bf16:        # as DeepSpeed casts the module: floating parameters to bf16, buffers as they are
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    rows = _data(dp=dp, gas=gas, vocab=config.vocab_size, document_token=c.get("document_token"))
    initial = SequentialReference(specs).state_dict()
    for step in range(STEPS):
        # every holder of a tensor has the same bits: tied layers, stage copies, replicas
        weights = {}
        for r in results:
            for k, v in r[step]["weights"].items():
                assert k not in weights or np.array_equal(weights[k], v), f"step {step + 1}: copies of {k} differ"
                weights[k] = v
        if step == 0:
            assert set(weights) == set(initial)
            dtypes = {k: getattr(torch, d.split(".")[-1]) for r in results for k, d in r[0]["dtypes"].items()}
            for k, v in initial.items():
                v = v.to(dtypes[k]).float()        # as DeepSpeed cast it (round to nearest); fp32 exact
                assert np.array_equal(weights[k], v.numpy()), f"{k}: the pipeline built other initial weights"
        terms, losses = _reference_step(model, loss_fn, {k: torch.from_numpy(v) for k, v in weights.items()},
                                        rows[step], dp=dp, gas=gas)
        # the loss: fp32 per micro-batch (the same arithmetic), summed and averaged in fp32
        want_loss = sum(losses) / len(losses)
        loss_bound = gamma(len(losses)) * sum(abs(x) for x in losses) / len(losses)
        for r in results:
            assert abs(r[step]["loss"] - want_loss) <= loss_bound, (step + 1, r[step]["loss"], want_loss, loss_bound)
        if bf16:
            reference, replicas = _bf16_gradient_bound(terms, dp=dp, pipe_norm=results[0][step]["norm"],
                                                       pipe_ranks=c["stages"])
            for rank, r in enumerate(results):
                for name, values in r[step]["before_reduction"].items():
                    want, bound = replicas[r[step]["replica"]][name]
                    assert_within(values, want, bound, what=f"step {step + 1}: rank {rank}'s fp32 gradient of {name} "
                                                            f"before the reduction over replicas")
        else:   # ranks and groups whose partial norms DeepSpeed adds in fp32: all ranks, MoE and dense groups
            reference, _ = _gradient_bound(terms, dp=dp, pipe_norm=results[0][step]["norm"],
                                           num_reducers=c["world"] + 4)
        got = _assemble(results, step, {k: v[0].shape for k, v in reference.items()})
        for name, (want, bound) in reference.items():
            assert_within(got[name], want, bound, what=f"step {step + 1}: gradient of {name}")
    last = {k: v for r in results for k, v in r[-1]["weights"].items()}
    assert not np.array_equal(last["2.self_attn.o_proj.weight"], initial["2.self_attn.o_proj.weight"].numpy())
