"""The data-parallel gradient reduction overlapped with the pipeline drain
(``seekspeed.overlap_grad_reduce``, Megatron's name for it).

DeepSpeed reduces a rank's gradients over its data-parallel group at ReduceGrads,
after the rank's whole schedule has run. Here each *chunk* (virtual stage: the phase
of DualPipeV/DualPipe, the one stage of 1F1B) is reduced as soon as the rank has run
its last backward of the step and, under zero-bubble schedules, the last W slot that
adds deferred weight gradients to it: ``last_instructions`` finds that instruction in
the rank's instruction stream before the step, the engine issues the chunk's
collectives asynchronously right after it, and ReduceGrads waits for all of them
(``wait_s``: the part of the reduction left exposed). What no chunk owns (tied
modules, reduced over their tie group at ReduceTiedGrads first) is reduced at
ReduceGrads.

Each chunk's reduction reproduces, restricted to its parameters, what DeepSpeed 0.19.8
does at ReduceGrads, so the result is the same arithmetic on the same numbers:

- ZeRO 0 (``engine.buffered_allreduce_fallback``): ``param.grad`` (zeros where a
  parameter got none), grouped by dtype, flattened in buckets of DeepSpeed's element
  limit, cast to ``communication_data_type``, scaled before and after the sum exactly
  as ``DeepSpeedEngine.allreduce_bucket`` (prescale, predivide factor, postscale),
  copied back; expert parameters over their expert-data-parallel group, divided by
  the data-parallel size.
- DeepSpeed's BF16_Optimizer (bf16 with ZeRO 0, or ZeRO 1 with ``grad_accum_dtype``
  fp32): the same, on the chunk's views of its fp32 accumulation buffers.
- ZeRO 1 (DeepSpeedZeroOptimizer): ``get_gradient_for_reduction`` of each parameter,
  cast to the parameter's communication dtype, divided before the sum (its
  ``average_tensor`` with reduce_scatter) or scaled as ``gradient_reduction_w_predivide``
  (without), summed, written back; at ReduceGrads the optimizer's own
  ``reduce_gradients`` then runs with its collectives replaced by local copies and its
  averaging off, so it buckets, partitions and copies out as it always does.
- a compressor (``seekspeed.comm``): the same ``GradientReducer`` per chunk (its
  ``reduce_steps``), keyed per chunk; under ZeRO 1 summed, then divided by the
  optimizer's local pass as install.CompressedReduction does.
- DualPipe: the two copies of a model stage live on ranks r and R-1-r; a chunk's
  gradients are first summed with the partner's copy (dualpipe.sum_copy_gradients, per
  stage), then reduced as above. Both ranks issue the stage sums in one order (the lower
  rank's readiness order), each no earlier than its own copy is done.

Why the sums are bitwise DeepSpeed's: an all-reduce is element-wise, so cutting the
flat buffer into chunks or buckets changes which collective an element travels in,
not what is added to it. With 2 ranks in the group each element is a + b, and
floating-point addition is commutative, so the algorithm's order does not matter
either (with more ranks a ring's order depends on the element's segment: equal in
value only up to rounding; the test uses 2).

Collectives on one group must be issued in the same order on every rank: chunks are
issued in the order the schedule finishes them (the same on every rank of a
data-parallel group, which run the same stage's schedule), and a job with further
collectives to issue (a compressor's second phase, DualPipe's stage sum before the
reduction) holds back the jobs after it, so a poll's timing never reorders them.
"""

import time
from collections import deque

import torch
from deepspeed import comm as dist
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
from deepspeed.runtime.pipe import schedule as ds_schedule

from ds_ext.errors import ConfigError

FINAL = "final"     # the chunk of what no virtual stage owns, reduced at ReduceGrads


def _phase(kwargs, key="phase"):
    return kwargs.get(key, 0)


def last_instructions(cmds):
    """{chunk (phase): index in ``cmds`` of the last instruction that adds to that
    chunk's gradients}: backward passes (also the backward half of an F&B pass) and W
    slots, which run the deferred weight gradients of the oldest zero-bubble backward
    not yet run (WeightGradStore's first-in first-out queue)."""
    from . import schedules
    last, deferred = {}, deque()
    for i, cmd in enumerate(cmds):
        if isinstance(cmd, ds_schedule.BackwardPass):
            phase = _phase(cmd.kwargs)
            last[phase] = i
            if cmd.kwargs.get("zb"):
                deferred.append(phase)
        elif isinstance(cmd, schedules.ForwardBackwardPass):
            last[_phase(cmd.kwargs, "bwd_phase")] = i
        elif isinstance(cmd, schedules.WeightPass):
            if not deferred:
                raise RuntimeError(f"instruction {i} (WeightPass) has no deferred backward to run")
            last[deferred.popleft()] = i
    return last


# -- jobs ------------------------------------------------------------------------------
# A job is a generator: it issues collectives and yields (works, more): the handles it
# needs complete before it goes on, and whether it will issue collectives after them.

class _Job:
    def __init__(self, name, gen, timeline):
        self.name, self.gen, self.timeline = name, gen, timeline
        self.works, self.more, self.started, self.done = (), True, False, False
        self.issued = None

    def resume(self):
        try:
            if not self.started:
                self.started, self.issued = True, time.perf_counter()
                self.works, self.more = next(self.gen)
            else:
                self.works, self.more = self.gen.send(None)
        except StopIteration:
            self.done, self.works, self.more = True, (), False
            if self.timeline is not None:
                self.timeline.record("GradReduce", {"chunk": self.name}, self.issued, time.perf_counter())

    def ready(self):
        return all(w.is_completed() for w in self.works)

    def wait(self):
        for w in self.works:
            w.wait()


class JobQueue:
    """Jobs in issue order; ``pump`` advances what can go on without blocking (or, with
    ``block``, everything), never letting a job issue ahead of one still issuing."""

    def __init__(self):
        self.jobs = deque()
        self.wait_s = 0.0

    def add(self, job):
        self.jobs.append(job)
        self.pump()

    def pump(self, block=False):
        t0 = time.perf_counter()
        for job in list(self.jobs):
            if not job.started:
                job.resume()
            while not job.done and (block or job.ready()):
                if block:
                    job.wait()
                job.resume()
            if not job.done and job.more:
                break          # later jobs may not issue collectives before this one's next
        while self.jobs and self.jobs[0].done:
            self.jobs.popleft()
        if block:
            self.wait_s += time.perf_counter() - t0
            assert not self.jobs, "gradient reduction jobs left after a blocking pump"


# -- the per-path reductions --------------------------------------------------------------

def _allreduce(tensor, group):
    return dist.all_reduce(tensor, group=group, async_op=True)


def engine_buckets(engine, grads, group, dp_world_size, *, limit=MEMORY_OPT_ALLREDUCE_SIZE):
    """DeepSpeedEngine.allreduce_no_retain + allreduce_bucket on ``grads``, issued
    asynchronously: yields ([works], False), then copies the averages back."""
    by_dtype = {}
    for g in grads:
        if g.is_sparse:
            raise ConfigError("seekspeed.overlap_grad_reduce does not reduce sparse gradients (DeepSpeed's "
                              "sparse all-reduce): set it to false or make the embedding dense")
        by_dtype.setdefault(g.dtype, []).append(g)
    comm_dtype = engine.communication_data_type
    pending = []
    for dtype in sorted(by_dtype, key=str):
        bucket, numel = [], 0
        buckets = []
        for g in by_dtype[dtype]:           # allreduce_no_retain: a bucket closes once it exceeds the limit
            bucket.append(g)
            numel += g.numel()
            if numel > limit:
                buckets.append(bucket)
                bucket, numel = [], 0
        if bucket:
            buckets.append(bucket)
        for bucket in buckets:
            # a copy even of a one-tensor bucket (flatten would alias it): later backward
            # passes may still touch the tensor (BF16_Optimizer adds zeros to every buffer)
            flat = torch.cat([g.reshape(-1) for g in bucket])
            wire = flat if comm_dtype == flat.dtype else flat.to(comm_dtype)
            post = None
            if not engine.gradient_average:
                pass
            elif engine.postscale_gradients():
                factor = engine.gradient_predivide_factor()
                if factor != 1.0:
                    wire.mul_(1.0 / factor)
                if factor != dp_world_size:
                    post = factor / dp_world_size
            else:
                wire.mul_(1. / dp_world_size)
            pending.append((bucket, flat, wire, post, _allreduce(wire, group)))
    yield [p[-1] for p in pending], False
    for bucket, flat, wire, post, _ in pending:
        if post is not None:
            wire.mul_(post)
        if wire is not flat:
            flat.copy_(wire)
        for buf, synced in zip(bucket, engine.unflatten(flat, bucket)):
            buf.copy_(synced)


def zero1_buckets(opt, pairs):
    """DeepSpeedZeroOptimizer's arithmetic on (param, gradient) pairs, issued
    asynchronously: the gradient in the parameter's communication dtype, divided as
    ``average_tensor`` (reduce_scatter) or ``gradient_reduction_w_predivide`` would,
    summed over the parameter's group, written back into the gradient."""
    from deepspeed.moe.utils import is_moe_param
    world = dist.get_world_size(group=opt.dp_process_group)
    sp = float(opt.sequence_parallel_size)
    groups = {}
    for param, grad in pairs:
        group = (opt.expert_dp_process_group[param.group_name] if is_moe_param(param) and
                 getattr(opt, "has_moe_layers", False) else opt.dp_process_group)
        groups.setdefault((opt.get_param_comm_dtype(param), id(group)), (group, []))[1].append(grad)
    pending = []
    for (comm_dtype, _), (group, grads) in groups.items():
        flat = torch.cat([g.reshape(-1).to(comm_dtype) for g in grads])
        post = None
        if not opt.gradient_average:
            pass
        elif opt.reduce_scatter:
            flat.div_(world / sp)
        elif opt.postscale_gradients:
            if opt.gradient_predivide_factor != 1.0:
                flat.mul_(1. / opt.gradient_predivide_factor)
            if opt.gradient_predivide_factor != world:
                post = opt.gradient_predivide_factor / (world / sp)
        else:
            flat.div_(world / sp)
        pending.append((grads, flat, post, _allreduce(flat, group)))
    yield [p[-1] for p in pending], False
    for grads, flat, post, _ in pending:
        if post is not None:
            flat.mul_(post)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def copy_sum(grads, group):
    """dualpipe.sum_copy_gradients's all-reduce (fp32, in its buckets) of one stage's
    gradients with the partner's copy, issued asynchronously."""
    from .dualpipe import copy_sum_buckets
    pending = [(bucket, flat, _allreduce(flat, group)) for bucket, flat in copy_sum_buckets(grads)]
    yield [p[-1] for p in pending], True
    for bucket, flat, _ in pending:
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _wrap_reducer(steps):
    """GradientReducer.reduce_steps as a job: every wait may be followed by more collectives."""
    for works in steps:
        yield works, True


class GradOverlap:
    """One engine's overlapped reduction: which parameters each chunk holds, the path
    DeepSpeed's ReduceGrads takes for them, the queue of jobs in flight."""

    def __init__(self, engine):
        self.engine = engine
        self.queue = JobQueue()
        self.path = self._path()
        self.chunks = self._chunks()
        self.triggers = {}
        self.launched = set()
        self.step_started = False
        self.last_wait_s = self.last_total_s = self.last_lead_s = 0.0
        self._first_issue = None
        self._check()

    # -- set-up ----------------------------------------------------------------------
    def _path(self):
        e, opt = self.engine, self.engine.optimizer
        if e.using_bf16_optimizer:
            return "bf16"
        if e.zero_optimization_stage() == 1 and hasattr(opt, "reduce_gradients") and hasattr(opt, "bit16_groups"):
            return "zero1"
        if e.zero_optimization_stage() == 0:
            return "engine"
        raise ConfigError(f"seekspeed.overlap_grad_reduce with ZeRO stage {e.zero_optimization_stage()}: pipelines "
                          f"take stage 0 or 1")

    def _check(self):
        opt = self.engine.optimizer
        if self.path != "zero1":
            return
        if opt.overlap_comm:
            raise ConfigError("seekspeed.overlap_grad_reduce with zero_optimization.overlap_comm true: set "
                              "zero_optimization.overlap_comm false (seekspeed overlaps the reduction itself)")
        for group in opt.bit16_groups:
            for p in group:
                comm = opt.get_param_comm_dtype(p)
                grad_dtype = opt._gradient_reduction_buffer_dtype()
                if torch.promote_types(comm, grad_dtype) != grad_dtype:
                    raise ConfigError(f"seekspeed.overlap_grad_reduce under ZeRO 1 with communication_data_type "
                                      f"{comm} wider than the {grad_dtype} gradients (the overlapped sum is kept in "
                                      f"the gradient): remove communication_data_type or set overlap_grad_reduce "
                                      f"false")

    def _chunks(self):
        """{chunk: parameters}, in module.parameters() order: the phase whose layers hold
        them (DualPipeV/DualPipe modules' ``phase_bounds``; 1F1B: all in chunk 0), FINAL
        for tied modules and whatever no phase's layers own."""
        module = self.engine.module
        tied = {id(p) for m in getattr(module, "tied_modules", {}).values() for p in m.parameters()}
        bounds = getattr(module, "phase_bounds", None)
        owner = {}
        for phase, (start, stop) in enumerate(bounds or ()):
            for idx in range(start, stop):
                layer = getattr(module, str(idx), None)
                for p in (layer.parameters() if isinstance(layer, torch.nn.Module) else ()):
                    owner.setdefault(id(p), phase)
        chunks = {}
        for p in module.parameters():
            if not p.requires_grad or not p.numel():
                continue
            chunk = FINAL if id(p) in tied else owner.get(id(p), FINAL) if bounds else 0
            chunks.setdefault(chunk, []).append(p)
        return chunks

    def describe(self):
        """The start-up log line."""
        path = {"engine": "ZeRO 0 (DeepSpeed's buffered all-reduce)", "bf16": "DeepSpeed's BF16_Optimizer",
                "zero1": "ZeRO 1 (DeepSpeedZeroOptimizer)"}[self.path]
        chunks = sorted((c for c in self.chunks if c != FINAL), key=str)
        return (f"overlap_grad_reduce: data-parallel reduction of {len(chunks)} chunk(s) per rank issued after each "
                f"one's last backward/W, waited for at ReduceGrads; {path}"
                + (f", through {self.engine.grad_reducer.name}" if self.engine.grad_reducer is not None else "")
                + ("; tied/unassigned parameters at ReduceGrads" if FINAL in self.chunks else ""))

    # -- per step ----------------------------------------------------------------------
    def begin(self, cmds):
        """Before a training step's instructions run: which instruction ends each chunk."""
        if not any(isinstance(c, ds_schedule.ReduceGrads) for c in cmds) or \
                not self.engine.pipeline_enable_backward_allreduce:
            self.triggers = {}
            return
        last = last_instructions(cmds)
        self.triggers = {}
        for index, chunk in self._issue_points(last):
            self.triggers.setdefault(index, []).append(chunk)
        self.launched = set()
        self.step_started = False
        self._first_issue = None
        self.queue.wait_s = 0.0

    def _issue_points(self, last):
        """[(instruction index, chunk)]: each chunk right after its last instruction; for
        DualPipe, in the pair's shared order (``dualpipe_issue_points``)."""
        e = self.engine
        if getattr(e, "_pair_group", None) is None:
            return sorted(((i, c) for c, i in last.items() if c in self.chunks), key=lambda t: t[0])
        from .dualpipe import DualPipeSchedule
        partner = e.num_stages - 1 - e.stage_id
        partner_cmds = [c for st in DualPipeSchedule(micro_batches=e.micro_batches, stages=e.num_stages,
                                                      stage_id=partner).steps() for c in st]
        return [(i, c) for i, c in dualpipe_issue_points(e.stage_id, e.num_stages, last,
                                                        last_instructions(partner_cmds)) if c in self.chunks]

    def after(self, index):
        """After instruction ``index`` ran: issue the chunks it ended, advance the rest."""
        for chunk in self.triggers.get(index, ()):
            self.launch(chunk)
        if self.queue.jobs:
            self.queue.pump()

    def launch(self, chunk):
        if chunk in self.launched:
            return
        self.launched.add(chunk)
        if self._first_issue is None:
            self._first_issue = time.perf_counter()
        for name, gen in self._jobs(chunk):
            self.queue.add(_Job(name, gen, self.engine.timeline))

    def finish(self):
        """At ReduceGrads: what is left issued, everything waited for, DeepSpeed's own
        post-processing (ZeRO 1) run. Returns the seconds blocked."""
        for chunk in self.chunks:
            self.launch(chunk)
        start = time.perf_counter()
        self.queue.pump(block=True)
        end = time.perf_counter()
        self.last_wait_s = end - start
        self.last_total_s = end - self._first_issue if self._first_issue is not None else 0.0
        # how long before ReduceGrads the first chunk went out: the most the reduction could hide
        self.last_lead_s = start - self._first_issue if self._first_issue is not None else 0.0
        if self.engine.timeline is not None:
            self.engine.timeline.record("WaitGradReduce", {}, start, end)
        e = self.engine
        if e.grad_reducer is not None:     # before ZeRO 1 divides: it may still change what was reduced
            e.grad_reducer.end_step()
        if self.path == "zero1":
            e._zero1_local_reduce(divide=e.grad_reducer is not None)
        self.triggers = {}
        return self.last_wait_s

    # -- jobs of one chunk ------------------------------------------------------------
    def _grads(self, params):
        """(param, the tensor DeepSpeed reduces for it) for ``params``."""
        opt = self.engine.optimizer
        if self.path == "bf16":
            where = {id(lp): (i, j) for i, group in enumerate(opt.bf16_groups) for j, lp in enumerate(group)}
            return [(p, opt.fp32_groups_gradients[where[id(p)][0]][where[id(p)][1]].view(p.shape))
                    for p in params if id(p) in where]
        if self.path == "zero1":
            return [(p, opt.get_gradient_for_reduction(p)) for p in params
                    if opt.get_gradient_for_reduction(p) is not None]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)
        return [(p, p.grad.data) for p in params]

    def _jobs(self, chunk):
        e = self.engine
        params = self.chunks.get(chunk, [])
        if not params:
            return []
        if getattr(e, "_pair_group", None) is not None:
            return [(f"{chunk}", self._dualpipe_job(chunk, params))]
        return self._reduce_jobs(chunk, self._grads(params))

    def _dualpipe_job(self, chunk, params):
        from .dualpipe import optimizer_gradients
        module = self.engine.module
        order = {id(p): i for i, p in enumerate(module.copy_parameters())}
        mine = sorted((p for p in params if id(p) in order), key=lambda p: order[id(p)])
        yield from copy_sum(optimizer_gradients(self.engine.optimizer, mine), self.engine._pair_group)
        for _, gen in self._reduce_jobs(chunk, self._grads(params)):
            yield from gen

    def _reduce_jobs(self, chunk, pairs):
        from deepspeed.moe.utils import is_moe_param
        from deepspeed.utils import groups
        e = self.engine
        dp_group = e.mpu.get_data_parallel_group()
        non_expert = [(p, g) for p, g in pairs if not is_moe_param(p)]
        expert = {}
        for p, g in pairs:
            if is_moe_param(p):
                expert.setdefault(p.group_name, []).append((p, g))
        if e.grad_reducer is not None:
            return [(f"{chunk}", self._compressed_job(chunk, non_expert, expert))]
        if self.path == "zero1":
            return [(f"{chunk}", zero1_buckets(e.optimizer, pairs))]
        jobs = [(f"{chunk}", engine_buckets(e, [g for _, g in non_expert], dp_group, dist.get_world_size(dp_group)))]
        if expert:
            dp_world = dist.get_world_size(groups._get_data_parallel_group())
            for name, items in sorted(expert.items()):
                jobs.append((f"{chunk} {name}", engine_buckets(e, [g for _, g in items],
                                                               groups._get_expert_data_parallel_group(name),
                                                               dp_world)))
        return jobs

    def _compressed_job(self, chunk, non_expert, expert):
        from deepspeed.utils import groups

        from ds_ext.comm.install import divided_later_by
        e = self.engine
        reducer = e.grad_reducer
        if not self.step_started:
            reducer.begin_step()
            self.step_started = True
        average = self.path != "zero1"
        dense = {id(g) for p, g in [*non_expert, *(x for items in expert.values() for x in items)]
                 if id(p) in e.comm_dense_params}
        at = {"micro_step": e.micro_steps, "boundary": True, "dense": dense}
        dp_group = e.mpu.get_data_parallel_group()
        # chunk 0 keeps the key of the reduction without overlap (1F1B's only chunk: the same
        # compressor state and PowerSGD start as without it)
        yield from _wrap_reducer(reducer.reduce_steps([g for _, g in non_expert], group=dp_group,
                                                      key="dense" if chunk == 0 else ("dense", chunk),
                                                      divide_by=dist.get_world_size(dp_group) if average else 1,
                                                      divided_later_by=divided_later_by(e.optimizer, dp_group,
                                                                                        average), **at))
        if expert:
            dp_world = dist.get_world_size(groups._get_data_parallel_group())
            for name, items in sorted(expert.items()):
                group = groups._get_expert_data_parallel_group(name)
                yield from _wrap_reducer(reducer.reduce_steps(
                    [g for _, g in items], group=group,
                    key=("expert", name) if chunk == 0 else (("expert", name), chunk), hierarchical=False,
                    divide_by=dp_world if average else 1,
                    divided_later_by=divided_later_by(e.optimizer, group, average), **at))


def dualpipe_issue_points(rank, stages, mine, partners):
    """DualPipe: rank r's chunk (phase) p holds model stage r (p 0) or R-1-r (p 1), its
    partner R-1-r the other copy of each under the other phase. Both ranks sum a
    stage's copies in one collective, so they must issue those sums in one order: the
    order in which the lower rank of the two finishes its chunks; each rank issues a
    stage's sum once its own copy is done and the stage before it in that order is
    issued. ``mine``/``partners``: last_instructions of the two ranks. Returns
    [(index in this rank's stream, chunk)]."""
    lower = mine if rank <= stages - 1 - rank else partners

    def stage_of(r, phase):
        return r if phase == 0 else stages - 1 - r

    lower_rank = min(rank, stages - 1 - rank)
    order = [stage_of(lower_rank, p) for p in sorted(lower, key=lambda p: lower[p])]
    my_chunk = {stage_of(rank, p): p for p in mine}
    points, at = [], -1
    for stage in order:
        chunk = my_chunk[stage]
        at = max(at, mine[chunk])
        points.append((at, chunk))
    return points


class OverlappedReduction:
    """Engine mixin: ``overlap_grad_reduce`` on, the instructions run through
    ``_grad_overlap_run`` (which issues each chunk's reduction after its last
    instruction) and ReduceGrads waits for them. Off (``grad_overlap`` None), every
    call falls through to the engine's own ReduceGrads."""

    grad_overlap = None

    def enable_grad_overlap(self):
        self.grad_overlap = GradOverlap(self)
        return self.grad_overlap

    def _exec_overlapped_reduce_grads(self):
        if self.grad_overlap is None or not self.pipeline_enable_backward_allreduce:
            return self._base_reduce_grads()
        self._force_grad_boundary = True
        try:
            self.grad_overlap.finish()
        finally:
            self._force_grad_boundary = False

    def _zero1_local_reduce(self, *, divide):
        """DeepSpeed's ZeRO-1 reduce_gradients on gradients already summed over their
        groups: its collectives replaced by local copies, its averaging on only if
        ``divide`` (the dense path has divided as it would before the sum)."""
        import functools

        from deepspeed.runtime.engine import DeepSpeedEngine

        from ds_ext.comm.install import _local_allreduce_bucket, _local_predivide
        opt = self.optimizer
        average = opt.gradient_average
        opt.allreduce_bucket = functools.partial(_local_allreduce_bucket, opt)
        opt.gradient_reduction_w_predivide = functools.partial(_local_predivide, opt)
        opt.gradient_average = average and divide
        try:
            DeepSpeedEngine.allreduce_gradients(self, bucket_size=MEMORY_OPT_ALLREDUCE_SIZE)
        finally:
            del opt.allreduce_bucket, opt.gradient_reduction_w_predivide
            opt.gradient_average = average


def with_overlap_map(cls):
    """``cls`` (an engine class with OverlappedReduction in its bases) with ReduceGrads
    mapped to the overlapped version, the engine's own kept as ``_base_reduce_grads``."""
    base = cls._INSTRUCTION_MAP[ds_schedule.ReduceGrads]
    cls._base_reduce_grads = base
    cls._INSTRUCTION_MAP = {**cls._INSTRUCTION_MAP,
                            ds_schedule.ReduceGrads: OverlappedReduction._exec_overlapped_reduce_grads}
    return cls
