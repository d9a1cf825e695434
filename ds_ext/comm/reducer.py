"""The compressed gradient reduction: chunking, pipelining, hierarchy, counters.

``GradientReducer.reduce(grads, group=..., divide_by=..., key=...)`` replaces one
data-parallel all-reduce of a list of gradients (averaging them in place):

- tensors under ``min_numel`` elements, those the compressor declines (vectors for
  PowerSGD) and those named dense by the caller go dense in one fp32 all-reduce;
- the rest is flattened and cut into chunks of ``chunk_mb`` (PowerSGD, which needs
  whole matrices: whole tensors grouped up to that size; top-k selects per tensor, or
  per piece of a tensor cut at a chunk boundary); each chunk is a compressor generator, and up to
  ``pipeline_depth`` chunks are on the wire while the next one is compressed
  (asynchronous collectives, waited for oldest first);
- hierarchical (``node_groups`` given and the group spans several nodes): a chunk is
  summed densely inside the node, one local rank per chunk (round robin, so every
  rail carries its share) exchanges it compressed with the same local rank of the
  other nodes, and broadcasts the result inside the node;
- for the first ``warmup_steps`` optimizer steps everything goes dense through the
  same path;
- ``target: "momentum"``: what is averaged is each rank's Adam momentum instead of its
  gradient. The reducer keeps the momentum M of every element it reduces (in the
  units of what it returns, which DeepSpeed may still divide). In the warm-up it follows
  the dense average G: M = b1 M + (1 - b1) G. After it each rank forms its own
  m_i = b1 M + (1 - b1) n s g_i (n ranks, s = 1 / divide_by: the mean of the m_i is the
  momentum a dense average would give), the m_i are averaged through the compressor
  (error feedback inside it) and the mean becomes M on every rank, and is what the
  gradients are overwritten with. install.FrozenVarianceAdam then steps with it and the
  variance frozen at the warm-up's end. Through a two-phase compressor (sign, int4)
  without the hierarchy, m_i is formed in the encoding's pass (TwoPhase.exchange's
  ``momentum``; on CPU in sign's C++ kernel) and the compressor's own check of the
  decoded scales stands for the reducer's finiteness pass.

Every rank issues the same collectives in the same order per group (ranks that skip
a chunk's inter-node phase issue placeholders), so the FIFO driver cannot deadlock.
"""

import functools
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as tdist

from .compressors import Collective, Dense, ScratchPool, make_compressor
from .norm_sketch import count_sketch, segment_norms, sketch_seed, tensor_sketches


def _unflatten(flat, tensors):
    """Copy consecutive pieces of ``flat`` into ``tensors``."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


@dataclass
class ReduceStats:
    """One optimizer step's counters (all gradient groups together)."""
    collectives: int = 0
    payload_bytes: int = 0       # what this rank handed to collectives
    wire_bytes: float = 0.0      # estimated bytes this rank sends (ring all-reduce / all-gather)
    inter_node_bytes: float = 0.0  # the part of wire_bytes on groups that span nodes
    compress_s: float = 0.0
    decompress_s: float = 0.0
    wait_s: float = 0.0          # blocked waiting for collectives
    total_s: float = 0.0
    dense_numel: int = 0
    compressed_numel: int = 0
    calls: list = field(default_factory=list)   # (key, micro_step, at_boundary) per reduce()
    dense: str = ""              # why this step went dense: "warm-up", or ""
    clip_coef: float = 1.0       # target momentum under clipping: the coefficient the step's gradient took
    clipped: int = 0             # 1: a momentum step whose clip coefficient was below 1 (M in fp32 unless clipped ahead)
    momentum_codes: int = 0      # 1: M kept as the compressor's codes after this step
    variance_scale: float = 1.0  # var_rescale: the factor the frozen variance took this step

    def line(self, name):
        return (f"comm {name}: {self.wire_bytes / 1e6:.2f} MB sent, compress {self.compress_s * 1e3:.0f} ms, "
                f"decompress {self.decompress_s * 1e3:.0f} ms, wait {self.wait_s * 1e3:.0f} ms, "
                f"total {self.total_s * 1e3:.0f} ms")

    def figures(self):
        return {k: v for k, v in asdict(self).items() if k not in ("calls", "dense")}


def _wire_bytes(req, world):
    size = req.tensor.numel() * req.tensor.element_size()
    if req.kind == "all_reduce":
        return 2 * (world - 1) / world * size
    if req.kind == "all_gather":
        return (world - 1) * size
    return (world - 1) / world * size     # all-to-all, broadcast: each rank sends (or forwards) all but its share


@functools.lru_cache(maxsize=64)
def refresh_steps(kappa, until, last, cap=None):
    """0/1 Adam's variance refresh steps (1-based optimizer steps) up to ``last``: a
    refresh at every multiple of the interval, which starts at 1 and doubles after every
    ``kappa`` refreshes, up to ``cap`` (var_update_max_interval; None: no cap); none after
    ``until`` (var_freeze_step)."""
    out, interval, count = [], 1, 0
    step = 1
    while step <= min(last, until):
        if step % interval == 0:
            out.append(step)
            count += 1
            if count == kappa:
                count, interval = 0, interval * 2 if cap is None else min(interval * 2, max(cap, interval))
        step += 1
    return frozenset(out)


def is_refresh_step(step, *, kappa, until, cap=None):
    """Whether optimizer step ``step`` (1-based) refreshes the variance."""
    if step > until:
        return False
    horizon = 1 << max(step - 1, 1).bit_length()          # refresh sets cached per power of two
    return step in refresh_steps(kappa, until, horizon, cap)


class GradientReducer:
    # dict attributes saved with the momentum in the compression state (state.py)
    STATE_ATTRS = ("variance_level",)

    def __init__(self, section, *, node_groups=None, spans_nodes=None, node_of=None, seed=0):
        self.section = section
        self.name = section.compressor
        self.compressor = make_compressor(section, seed=seed)
        self.dense = Dense()
        # 0/1 Adam's variance refreshes after the warm-up (refresh_compressor): fp32, or a
        # compressor without error feedback (a refresh is tens of steps from the next)
        if section.refresh_compressor == "fp32":
            self.refresh_compressor = self.dense
        else:
            self.refresh_compressor = make_compressor(
                replace(section, compressor=section.refresh_compressor, error_feedback=False, block_size=None,
                        residual_dtype="fp32", target="gradient"), seed=seed)
        self.node_groups = node_groups
        # group -> whether it crosses nodes (for the inter-node byte count), else from node_of
        self.spans_nodes = dict(spans_nodes or {})
        self.node_of = node_of
        self.chunk_numel = max(1, int(section.chunk_mb * 2 ** 20 / 4))
        self.steps = 0
        self._buffers = {}
        # chunk-sized regions: the chunks on the wire and the one being compressed, of the
        # chunk length and a few tail lengths
        self._scratch = ScratchPool(per_size=max(1, section.pipeline_depth) + 1, sizes=4)
        self.stats = ReduceStats()
        self.last = None
        # target "momentum": Adam's beta1 (set by install), M per (key, part), whether the
        # last step reduced sent momentum, and whether it was non-finite (then skipped)
        self.beta1 = None
        self.momentum = {}
        self.sent_momentum = False
        self.refreshed = False
        self.skipped = False
        # target "momentum" under gradient clipping (set by install): the clip norm, how many
        # ranks beyond the data-parallel ones hold each gradient (DualPipe's pairs: 2), and
        # this step's squared-norm terms and momentum updates, settled at end_step
        self.clip = 0.0
        self.copies = 1
        self._norm_terms = []
        self._pending = []
        self._ahead = None      # the step's clip coefficient when known before its exchange (clip_ahead)
        # var_rescale: Adam's beta2 (set by install); the averaged clipped gradient's squared
        # norm tracked as Adam tracks v (its sum over the elements), {"level", "count", "ref"}
        # (float64 scalars: the moving average, its updates, its bias-corrected value when the
        # variance was last updated), and what FrozenVarianceAdam scales the variance by this
        # step: on a momentum step variance_scale, on a refresh scale_before (before this
        # step's gradient entered the level)
        self.beta2 = None
        self.variance_level = {}
        self.variance_scale = 1.0
        self.scale_before = 1.0
        self._norm_sq = None
        # var_rescale "tensor": the same per tensor of the step (the calls' gradients in call
        # order): this step's squared norms before the clip (float64, one vector a call) and
        # where each gradient lives, (storage address, element offset, numel, element size);
        # after end_step, tensor_slots and tensor_factors (a momentum step's factors, a
        # refresh's before-factors) for FrozenVarianceAdam
        self._tensor_sq, self._slots = [], []
        self.tensor_slots, self.tensor_factors = [], None

    # -- step bookkeeping -------------------------------------------------------------
    def begin_step(self):
        self.stats = ReduceStats(dense="warm-up" if self.warming_up else "refresh" if self.refreshing else "")
        self.skipped = False
        self._tensor_sq, self._slots = [], []

    def end_step(self):
        if self._pending:
            self._settle_momentum()
        self._ahead = None
        self.sent_momentum = self.momentum_step      # what the optimizer step after it is to do
        if self.section.var_rescale and self.section.target == "momentum":
            self._track_level()
        # a dense step after momentum steps: 0/1 Adam's variance refresh, which the
        # optimizer step takes with the momentum's step count (install.FrozenVarianceAdam)
        self.refreshed = (self.section.target == "momentum" and not self.sent_momentum
                          and self.steps + 1 > self.first_momentum_step)
        self.steps += 1
        self.last = self.stats
        return self.stats

    def _track_level(self):
        """``var_rescale``: the sum over elements of dense Adam's v is a moving average
        (beta2) of the averaged clipped gradient's squared norm, c^2 |G|^2; tracked here from
        the step's norm (the clip's: exact on dense steps, ``clip_norm``'s estimate on
        momentum steps), bias-corrected as Adam corrects v. A dense step (the warm-up, a
        refresh) updates the variance itself and becomes the reference; a momentum step's
        variance_scale is the tracked level now over the reference, the factor by which
        dense Adam's v would have moved since, taken as one factor for every element."""
        lv, b2 = self.variance_level, self.beta2
        if not lv:
            lv.update(level=torch.zeros((), dtype=torch.float64), count=torch.zeros((), dtype=torch.float64),
                      ref=torch.zeros((), dtype=torch.float64))
        x, self._norm_sq = self._norm_sq, None
        if self.skipped or x is None or not math.isfinite(x):      # a skipped step leaves v as it was
            self.variance_scale = self.scale_before = 1.0
            self.tensor_factors, self.tensor_slots = None, []
            return
        n, ref = int(lv["count"]), float(lv["ref"])
        before = float(lv["level"]) / (1.0 - b2 ** n) if n else 0.0
        lv["level"].mul_(b2).add_((1.0 - b2) * x)
        lv["count"].add_(1.0)
        now = float(lv["level"]) / (1.0 - b2 ** (n + 1))
        self.scale_before = before / ref if ref > 0 and before > 0 else 1.0
        if self.sent_momentum:
            self.variance_scale = now / ref if ref > 0 else 1.0
        else:
            self.variance_scale = 1.0
            lv["ref"].fill_(now)
        self.stats.variance_scale = self.variance_scale if self.sent_momentum else self.scale_before
        if self.section.var_rescale == "tensor":
            self._track_tensor_levels(n)

    def _track_tensor_levels(self, n):
        """``var_rescale: "tensor"``: ``_track_level`` per parameter tensor. The sum of
        dense Adam's v over a tensor's elements is a beta2 moving average of c^2 |G_t|^2,
        G_t the tensor's averaged gradient: on dense steps its exact squared norm, on
        momentum steps the squared norm of its all-reduced sketch (unbiased; its noise is
        averaged by the moving average as v averages the gradient's). ``n``: the levels'
        updates before this one (``variance_level["count"]`` before ``_track_level``'s)."""
        lv, b2 = self.variance_level, self.beta2
        if not self._tensor_sq:      # this rank reduced no gradients this step
            self.tensor_factors, self.tensor_slots = None, []
            return
        x = torch.cat(self._tensor_sq) * self.stats.clip_coef ** 2
        if "tensor_level" not in lv:
            lv.update(tensor_level=torch.zeros_like(x), tensor_ref=torch.zeros_like(x))
        elif lv["tensor_level"].numel() != x.numel():
            raise RuntimeError(f"comm var_rescale 'tensor': this step reduced {x.numel()} gradient tensors and the "
                               f"tracked levels hold {lv['tensor_level'].numel()}; the reduce calls must name the same "
                               f"tensors every step")
        level, ref = lv["tensor_level"], lv["tensor_ref"]
        before = level / (1.0 - b2 ** n) if n else torch.zeros_like(level)
        level.mul_(b2).add_(x, alpha=1.0 - b2)
        now = level / (1.0 - b2 ** (n + 1))
        live = ref > 0
        if self.sent_momentum:
            factors = torch.where(live, now / ref.where(live, 1.0), 1.0)
        else:
            factors = torch.where(live & (before > 0), before / ref.where(live, 1.0), 1.0)
            ref.copy_(now)
        self.tensor_factors, self.tensor_slots = factors, self._slots

    @property
    def warming_up(self):
        return self.steps < self.section.warmup_steps

    @property
    def refreshing(self):
        """This step is one of 0/1 Adam's variance refreshes (``var_update_scaler``): dense."""
        return self._refreshes_at(self.steps + 1)

    def _refreshes_at(self, step):
        """Whether 0/1 Adam's schedule (``var_update_scaler``, ``var_freeze_step``,
        ``var_update_max_interval``) refreshes the variance at optimizer step ``step``."""
        kappa = self.section.var_update_scaler
        return kappa is not None and is_refresh_step(step, kappa=kappa, until=self.section.var_freeze_step,
                                                     cap=self.section.var_update_max_interval)

    @functools.cached_property
    def first_momentum_step(self):
        """The first (1-based) step that sends momentum: after the warm-up and the
        refreshes that follow it without a gap."""
        step = self.section.warmup_steps + 1
        while self._refreshes_at(step):
            step += 1
        return step

    def refresh_gap(self):
        """Steps from the dense step before the last one reduced (``steps``, 1-based) to
        it: what var_refresh_decay "elapsed" decays the variance by (b2 per step)."""
        step = self.steps - 1
        while step > self.section.warmup_steps and not self._refreshes_at(step):
            step -= 1
        return self.steps - max(step, 0)

    @property
    def dense_now(self):
        """This step reduces dense: the warm-up, or a variance refresh."""
        return self.warming_up or self.refreshing

    @property
    def momentum_step(self):
        """This step sends momentum (target momentum, outside the warm-up and the refreshes)."""
        return self.section.target == "momentum" and not self.dense_now

    # -- the reduction ------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, grads, *, group, divide_by, key, hierarchical=True, micro_step=None, boundary=True,
               dense=(), divided_later_by=1):
        """Average ``grads`` (a list of tensors) over ``group`` in place: the sum over
        its ranks times 1 / ``divide_by``. ``dense``: ids of tensors in ``grads`` to send
        uncompressed (``seekspeed.comm.dense_params``). ``divided_later_by``: what
        DeepSpeed divides the result by before its optimizer sees it (ZeRO 1's own
        averaging), for the clipping norm of target momentum."""
        steps = self.reduce_steps(grads, group=group, divide_by=divide_by, key=key, hierarchical=hierarchical,
                                  micro_step=micro_step, boundary=boundary, dense=dense,
                                  divided_later_by=divided_later_by)
        for works in steps:
            t0 = time.perf_counter()
            for work in works:
                work.wait()
            self.stats.wait_s += time.perf_counter() - t0

    @torch.no_grad()
    def reduce_steps(self, grads, *, group, divide_by, key, hierarchical=True, micro_step=None, boundary=True,
                     dense=(), divided_later_by=1):
        """``reduce`` as a generator: it yields the collectives' work handles it would
        wait for next and carries on once they are done (the caller waits, or polls and
        resumes it later: ds_ext/pipe/grad_overlap.py), ending with ``grads`` averaged.
        Each chunk reads its share of ``grads`` when it starts and writes the average
        back when it ends, so a caller may resume it after more backward work has run
        as long as that work leaves ``grads`` alone."""
        start = time.perf_counter()
        self.stats.calls.append((key, micro_step, boundary))
        comp = self.compressor if not self.dense_now else self.dense if self.warming_up else self.refresh_compressor
        grads = [g for g in grads if g.numel()]
        big = [g for g in grads
               if id(g) not in dense and g.numel() >= self.section.min_numel and comp.wants(tuple(g.shape))]
        chosen = {id(g) for g in big}
        small = [g for g in grads if id(g) not in chosen]
        tasks, buffers = [], []
        scale = 1.0 / divide_by
        sending = self.momentum_step
        members = tdist.get_world_size(group)
        # the optimizer sees what this returns / divided_later_by, f x the group's mean of
        # the g_i: sending, each of the n ranks adds f^2 |g_i|^2 / n for its own gradient
        # before the exchange; dense, |result / divided_later_by|^2 / n after it. The
        # world's sum is, per tensor, the mean over its holders of the local squared
        # norms, or the average's squared norm
        norming = self.needs_norm
        ahead = self._ahead is not None      # set by clip_ahead on a clipped momentum step only
        if norming and sending and not ahead:
            self._add_sent_norm_terms(grads, group, key, divide_by, divided_later_by)
        if sending:     # the ranks' momenta, averaged below; clipped as they are formed when c is known
            local, scale = (1.0 - self.beta1) * members * scale * (self._ahead if ahead else 1.0), 1.0 / members
        if small:
            buf = self._flat((key, "dense"), small)
            if sending:
                self._local_momentum((key, "dense"), buf, local)
            buffers.append((small, buf, (key, "dense")))
            tasks.append(self.dense.exchange((key, "dense"), buf, [buf], group, scale))
            self.stats.dense_numel += buf.numel()
        fused, checked = [], None    # chunk keys whose momentum the compressor forms (and checks) itself
        if big:
            part = (key, "compressed")
            numel = sum(g.numel() for g in big)
            groups = self.node_groups if hierarchical else None
            # without the hierarchy (whose in-node sum comes first) the compressor forms the
            # momentum in its encoding's pass: b1 M rides along with each chunk
            fuse = sending and groups is None and getattr(comp, "fuses_momentum", False)
            # fused, M is kept as the compressor's all-gather delivered it (scales and codes per
            # chunk, which decode to exactly the fp32 mean); else in fp32: read back from the
            # gradients when they are fp32, or each chunk's region copied into an fp32 buffer
            m = self._momentum_of(part, numel, packed_ok=fuse) if sending else None
            result = None
            if sending and not fuse and any(g.dtype != torch.float32 for g in big):
                result = self._buffers.get((part, "next"))
                if result is None or result.numel() != numel:
                    result = self._buffers[(part, "next")] = torch.empty(numel, dtype=torch.float32,
                                                                        device=big[0].device)
            if comp is self.dense:
                self.stats.dense_numel += numel
            else:
                self.stats.compressed_numel += numel
            for c, (at, pieces) in enumerate(self._chunks(comp, big)):
                mom = None
                if sending:
                    span = slice(at, at + sum(n for _, _, n in pieces))
                    mine = m["chunks"][c] if isinstance(m, dict) else m[span]
                    mom = (mine, local, self.beta1, fuse, None if result is None else result[span])
                tasks.append(self._chunk_task(comp, (key, c), pieces, group, groups, c, scale, momentum=mom))
                if fuse:
                    fused.append((key, c))
        yield from self._drive(tasks)
        packed = None
        if fused:
            checked = all(comp.finite[k] for k in fused)
            gathered = [comp.gathered.pop(k, None) for k in fused]
            if checked:
                packed = {"chunks": gathered, "numel": [sum(n for _, _, n in pieces)
                                                        for _, pieces in self._chunks(comp, big)]}
        if self.section.target == "momentum":
            if big:
                buffers.append((big, result, (key, "compressed")))
            if norming and not ahead:      # M's update waits for the step's clip coefficient (end_step)
                self._pending.append((buffers, checked, packed))
            else:
                self._update_momentum(buffers, checked=checked, packed=packed)
        for tensors, buf, part in buffers:
            if buf is None or part[1] == "compressed":      # the chunks wrote their averages back
                continue
            _unflatten(buf, tensors)
        if norming and not sending:
            squares = self._add_norm_terms(grads, 1.0 / (divided_later_by ** 2 * members))
            if self.section.var_rescale == "tensor":       # each member holds the average: its own norms
                self._note_tensors(grads, squares.cpu().to(torch.float64) / divided_later_by ** 2)
        self.stats.total_s += time.perf_counter() - start

    @staticmethod
    def _norm_weight(members, divide_by, divided_later_by):
        return (members / (divide_by * divided_later_by)) ** 2 / members

    @torch.no_grad()
    def clip_ahead(self, calls):
        """Target momentum under clipping, on a momentum step whose every gradient is at
        hand before the first exchange (the reduction at the step's end, not overlapped
        with the backward): ``calls``, the step's ``reduce`` calls to come as (grads, the
        call's keyword arguments: group, divide_by, divided_later_by, key). The
        coefficient c (as ``_settle_momentum`` computes it, from the norm ``clip_norm``
        names) is found first, and each rank's momentum is formed as b1 M + (1 - b1) c
        g_i: the mean is the same c-clipped momentum the exchange-then-mix path gives,
        but what the compressor encodes, and what its error feedback carries into the
        next step, is the clipped momentum itself, and the mean is kept as the compressor delivered it.
        One scalar all-reduce ahead of the exchange instead of after it."""
        if not (self.needs_norm and self.momentum_step):
            return
        for grads, kw in calls:      # the gradients reduce_steps would add, empty ones left out as there
            self._add_sent_norm_terms([g for g in grads if g.numel()], kw["group"], kw.get("key"), kw["divide_by"],
                                      kw.get("divided_later_by", 1))
        self._ahead = self._clip_coefficient()

    def _add_sent_norm_terms(self, grads, group, key, divide_by, divided_later_by):
        """A momentum step's share of the clip norm, before the exchange (``clip_norm``):
        "rms", f^2 |g_i|^2 / n for this rank's own gradient (the world's sum: the mean of
        the ranks' squared norms, an upper bound of the average's); "sketch", the group's
        all-reduced count sketch of the f g_i / n, whose squared norm estimates the
        average's (norm_sketch.py), added as 1 / n of it by each of the n members."""
        members = tdist.get_world_size(group)
        if self.section.clip_norm != "sketch":
            self._add_norm_terms(grads, self._norm_weight(members, divide_by, divided_later_by))
            return
        t0 = time.perf_counter()
        k, seed, scale = self.section.clip_sketch_buckets, sketch_seed(self.steps, key), 1.0 / (divide_by * divided_later_by)
        sketch = count_sketch(grads, k, seed, scale=scale)
        if self.section.var_rescale == "tensor":      # each tensor's own sketch, in the same all-reduce
            parts, sizes = tensor_sketches(grads, self.section.var_rescale_buckets, seed, scale=scale)
            sketch = torch.cat([sketch, parts.to(sketch.device, sketch.dtype)])
        self.stats.compress_s += time.perf_counter() - t0
        work = self._launch(Collective("all_reduce", sketch, group))
        t0 = time.perf_counter()
        work.wait()
        self.stats.wait_s += time.perf_counter() - t0
        self._norm_terms.append(sketch[:k].square().sum() / members)
        if self.section.var_rescale == "tensor":
            self._note_tensors(grads, segment_norms(sketch[k:], sizes).cpu())

    @property
    def needs_norm(self):
        """Target momentum under clipping or ``var_rescale``: each step finds the norm
        of its averaged gradient (with no clip, c = 1)."""
        return self.section.target == "momentum" and (self.clip > 0 or self.section.var_rescale)

    def _clip_coefficient(self):
        """DeepSpeed's min(1, clip / (norm + 1e-6)) from this step's squared-norm terms,
        summed over the world (one scalar all-reduce); recorded in the step's stats."""
        terms, self._norm_terms = self._norm_terms, []
        if terms:
            total = torch.stack(terms).sum().reshape(1)
        else:       # this rank reduced no gradients this step; the all-reduce is the world's
            from deepspeed.accelerator import get_accelerator
            total = torch.zeros(1, device=get_accelerator().current_device_name())
        tdist.all_reduce(total)
        squared = float(total) / self.copies
        norm = math.sqrt(squared) if math.isfinite(squared) else math.inf
        c = min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0
        self._norm_sq = squared * c * c
        self.stats.clip_coef = c
        self.stats.clipped = int(c < 1.0 and self.momentum_step)
        return c

    def _add_norm_terms(self, tensors, weight):
        """weight x the squared norm of ``tensors``, one fp32 sum a tensor; returns the
        tensors' squared norms (where they were computed: no host sync unless read)."""
        sq = [torch.linalg.vector_norm(t.reshape(-1), dtype=torch.float32) ** 2 for t in tensors]
        if not sq:
            return torch.zeros(0)
        sq = torch.stack(sq)
        self._norm_terms.append(sq.sum() * weight)
        return sq

    def _note_tensors(self, grads, squares):
        """var_rescale "tensor": this call's per-tensor squared norms (before the clip),
        and where each gradient lives, for FrozenVarianceAdam to find its elements."""
        self._tensor_sq.append(squares)
        self._slots += [(g.untyped_storage().data_ptr(), g.storage_offset(), g.numel(), g.element_size())
                        for g in grads]

    @torch.no_grad()
    def _settle_momentum(self):
        """Gradient clipping for target momentum. DeepSpeed clips what reaches its
        optimizer, the averaged momentum M after the warm-up; Adam clips each gradient
        before it enters the moments. So that M is made of clipped gradients as dense
        Adam's momentum is, the step's gradient is scaled by c = min(1, clip / (norm +
        1e-6)) (DeepSpeed's coefficient) before it enters M: on a dense step (warm-up,
        refresh) the norm is the average's, DeepSpeed's own, and M <- b1 M + (1 - b1) c G
        while DeepSpeed clips G for its optimizer itself; on a momentum step each rank's
        gradient is only known locally, so the norm is the root mean square of the
        ranks' local norms, an upper bound of the average's (|mean g_i|^2 <= mean
        |g_i|^2), or with ``clip_norm: "sketch"`` an unbiased estimate of the average's
        from the group's all-reduced count sketch (norm_sketch.py), and since M_t = b1 M
        + (1 - b1) G is linear in G the clipped momentum is c M_t + (1 - c) b1 M, formed
        after the exchange, returned to the optimizer and kept. One scalar all-reduce over the world a step."""
        pending, self._pending = self._pending, []
        c = self._clip_coefficient()
        for buffers, checked, packed in pending:
            self._update_momentum(buffers, checked=checked, clip_coef=c, packed=packed)

    def _chunk_task(self, comp, key, pieces, group, groups, index, scale, momentum=None):
        """One chunk: its pieces of the gradients copied into a chunk-sized scratch region
        (from a pool: about ``pipeline_depth`` of them are in use at once, not a copy of
        the whole gradient), with target momentum the rank's momentum formed there (or,
        ``fuse``, by the compressor), exchanged, and the average copied back. A chunk that
        lies inside one contiguous fp32 gradient is its own region: no copies."""
        numel = sum(n for _, _, n in pieces)
        g, lo, n = pieces[0]
        # a chunk inside one contiguous fp32 gradient is exchanged in the gradient's own memory
        direct = len(pieces) == 1 and g.dtype == torch.float32 and g.is_contiguous()
        if direct:
            region = g.view(-1)[lo:lo + n]
            views = [region if comp.splittable or n != g.numel() else region.view(g.shape)]
        else:
            region = self._scratch.take(numel, g.device)
            views, offset = [], 0
            for g, lo, n in pieces:
                if n == g.numel():
                    region[offset:offset + n].copy_(g.reshape(-1))
                    views.append(region[offset:offset + n] if comp.splittable
                                 else region[offset:offset + n].view(g.shape))
                else:
                    region[offset:offset + n].copy_(g.view(-1)[lo:lo + n])
                    views.append(region[offset:offset + n])
                offset += n
        mom, result = None, None
        if momentum is not None:
            m, local, beta1, fuse, result = momentum
            if fuse:
                mom = (m, local, beta1)
            else:
                region.mul_(local).add_(m, alpha=beta1)
        yield from self._chunk(comp, key, region, views, group, groups, index, scale, momentum=mom)
        if result is not None:
            result.copy_(region)
        if direct:
            return
        offset = 0
        for g, lo, n in pieces:
            if n == g.numel():
                g.copy_(region[offset:offset + n].view_as(g))
            else:
                g.view(-1)[lo:lo + n].copy_(region[offset:offset + n])
            offset += n
        self._scratch.give(region)

    def _momentum_of(self, part, numel, packed_ok=False):
        """M of ``part``, which must hold ``numel`` entries (this rank's gradients): an
        fp32 tensor, or with ``packed_ok`` as it may be kept after a fused momentum step
        ({"chunks": the compressor's (scales, codes) a chunk, "numel": entries a chunk})."""
        m = self.momentum.get(part)
        held = None if m is None else sum(m["numel"]) if isinstance(m, dict) else m.numel()
        if held != numel:
            raise RuntimeError(f"comm target momentum: no warm-up momentum for {part!r} (the gradients reduced "
                               f"changed after the warm-up)")
        if isinstance(m, dict) and not packed_ok:
            m = self.momentum[part] = self._decode_momentum(m)
        return m

    def _decode_momentum(self, packed):
        """A kept {"chunks", "numel"} M as one fp32 tensor (bitwise the mean the step returned)."""
        sizes = packed["numel"]
        chunks = packed["chunks"]
        out = torch.empty(sum(sizes), dtype=torch.float32, device=chunks[0][0].device)
        at = 0
        for chunk, n in zip(chunks, sizes):
            self.compressor.decode_gathered(chunk, out[at:at + n])
            at += n
        return out

    def momentum_tensor(self, part):
        """M of ``part`` in fp32, however it is kept."""
        m = self.momentum[part]
        return self._decode_momentum(m) if isinstance(m, dict) else m

    def _local_momentum(self, part, buf, local):
        """buf (this rank's gradient) becomes its momentum b1 M + local x gradient."""
        buf.mul_(local).add_(self._momentum_of(part, buf.numel()), alpha=self.beta1)

    def _update_momentum(self, buffers, checked=None, clip_coef=1.0, packed=None):
        """After the exchange: the warm-up's M follows the dense average; after it the
        mean momentum is M; a non-finite step leaves M as it was (the optimizer skips it:
        DeepSpeed in the warm-up where it checks for overflow, FrozenVarianceAdam after).
        ``buffers``: (tensors, their flat buffer or None: read the tensors, part);
        ``checked``: the compressed part's finiteness as its compressor saw it (the
        decoded scales), or None to check it here; ``packed``: the compressed part's
        mean as the compressor delivered it (a fused momentum step), kept as M as it is,
        or under a clip coefficient below 1 decoded and mixed with the M before it."""
        sums = [t.sum(dtype=torch.float32) for tensors, buf, part in buffers
                if checked is None or part[1] != "compressed" for t in ([buf] if buf is not None else tensors)]
        # one sum a tensor, one host sync for them all (an overflowing sum is a step worth skipping)
        finite = checked is not False and (not sums or bool(torch.isfinite(torch.stack(sums)).all()))
        if not finite:
            self.skipped = True
            return
        c, b1 = clip_coef, self.beta1
        for tensors, buf, part in buffers:
            numel = buf.numel() if buf is not None else sum(t.numel() for t in tensors)
            if packed is not None and part[1] == "compressed":
                if c < 1.0:     # c M_t + (1 - c) b1 M, the fp32 path's arithmetic, the mean decoded a chunk at a time
                    m = self._momentum_of(part, numel).mul_((1.0 - c) * b1)
                    at = 0
                    for chunk, n in zip(packed["chunks"], packed["numel"]):
                        mean = self.compressor.decode_gathered(chunk, self._scratch.take(n, m.device))
                        m[at:at + n].add_(mean, alpha=c)
                        self._scratch.give(mean)
                        at += n
                    _unflatten(m, tensors)
                else:
                    self.momentum[part] = packed
                    self.stats.momentum_codes = 1
                self._buffers.pop((part, "next"), None)
                continue
            if isinstance(self.momentum.get(part), dict):      # a dense step after fused ones: M in fp32 again
                self._momentum_of(part, numel)
            m = self.momentum.get(part)
            if buf is not None and self.momentum_step:   # the mean becomes M; last step's M the next buffer
                if c < 1.0:
                    buf.mul_(c).add_(m, alpha=(1.0 - c) * b1)
                    _unflatten(buf, tensors)
                self.momentum[part] = buf
                self._buffers[part if part[1] == "dense" else (part, "next")] = m
                continue
            fresh = m is None or m.numel() != numel
            if fresh:
                m = self.momentum[part] = torch.empty(numel, dtype=torch.float32, device=tensors[0].device)
            offset = 0
            for t in ([buf] if buf is not None else tensors):
                mine, flat = m[offset:offset + t.numel()], t.reshape(-1)
                offset += t.numel()
                if self.momentum_step and c < 1.0:
                    mine.mul_((1.0 - c) * b1).add_(flat, alpha=c)
                    t.copy_(mine.view_as(t))
                elif self.momentum_step:
                    mine.copy_(flat)
                elif fresh:
                    torch.mul(flat, (1.0 - b1) * c, out=mine)           # Adam's zero start
                else:
                    mine.mul_(b1).add_(flat, alpha=(1.0 - b1) * c)

    def _flat(self, key, tensors):
        """The tensors concatenated in fp32, in a buffer kept from the last step (a
        fresh gradient-sized allocation costs more than the copy: page faults)."""
        numel = sum(g.numel() for g in tensors)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel or buf.device != tensors[0].device:
            buf = torch.empty(numel, dtype=torch.float32, device=tensors[0].device)
            self._buffers[key] = buf
        offset = 0
        for g in tensors:
            buf[offset:offset + g.numel()].copy_(g.reshape(-1))
            offset += g.numel()
        return buf

    def _chunks(self, comp, tensors):
        """(offset, pieces): each chunk's start in the tensors laid end to end and its
        pieces (tensor, first entry, entries); a splittable compressor's chunks are
        ``chunk_numel`` entries cut anywhere, another's whole tensors up to about that."""
        if comp.splittable:
            start = offset = 0
            pieces = []
            for g in tensors:
                done = 0
                while done < g.numel():
                    take = min(g.numel() - done, self.chunk_numel - (offset - start))
                    pieces.append((g, done, take))
                    offset, done = offset + take, done + take
                    if offset - start >= self.chunk_numel:
                        yield start, pieces
                        start, pieces = offset, []
            if pieces:
                yield start, pieces
            return
        start, offset, pieces = 0, 0, []
        for g in tensors:
            if pieces and offset + g.numel() - start > self.chunk_numel:
                yield start, pieces
                start, pieces = offset, []
            pieces.append((g, 0, g.numel()))
            offset += g.numel()
        if pieces:
            yield start, pieces

    def _chunk(self, comp, key, region, views, group, groups, index, scale, momentum=None):
        if groups is None or (groups.num_nodes == 1 and groups.local_size == 1):
            yield from (comp.exchange(key, region, views, group, scale, momentum=momentum) if momentum is not None
                        else comp.exchange(key, region, views, group, scale))
            return
        assert momentum is None, "the hierarchy sums the node's momenta before the compressor"
        if groups.num_nodes == 1:        # one node: the links are fast, nothing to gain from compression
            yield from self.dense.exchange(key, region, [region], groups.intra_group, scale)
            return
        if groups.local_size > 1:
            yield Collective("all_reduce", region, groups.intra_group)
        owner = index % groups.local_size
        if groups.local_rank == owner:
            yield from comp.exchange(key, region, views, groups.rail_group, scale)
        else:
            for _ in range(comp.phases):
                yield Collective("noop")
        if groups.local_size > 1:
            yield Collective("broadcast", region, groups.intra_group, src=groups.node_ranks[owner])

    def _launch(self, req):
        if req.kind == "noop":
            return None
        group = req.group
        world = tdist.get_world_size(group)
        wire = _wire_bytes(req, world)
        self.stats.collectives += 1
        self.stats.payload_bytes += req.tensor.numel() * req.tensor.element_size()
        self.stats.wire_bytes += wire
        if group not in self.spans_nodes:
            ranks = tdist.get_process_group_ranks(group)
            self.spans_nodes[group] = self.node_of is None or len({self.node_of[r] for r in ranks}) > 1
        if self.spans_nodes[group]:
            self.stats.inter_node_bytes += wire
        if req.kind == "all_reduce":
            return tdist.all_reduce(req.tensor, group=group, async_op=True)
        if req.kind == "all_gather":
            return tdist.all_gather(req.out, req.tensor, group=group, async_op=True)
        if req.kind == "all_to_all":
            return tdist.all_to_all_single(req.out[0], req.tensor, group=group, async_op=True)
        if req.kind == "broadcast":
            return tdist.broadcast(req.tensor, src=req.src, group=group, async_op=True)
        raise ValueError(f"unknown collective {req.kind!r}")

    def _step(self, gen, first, inflight):
        t0 = time.perf_counter()
        try:
            req = next(gen) if first else gen.send(None)
        except StopIteration:
            self.stats.decompress_s += time.perf_counter() - t0
            return
        self.stats.compress_s += time.perf_counter() - t0
        inflight.append((gen, self._launch(req)))

    def _drive(self, tasks):
        """Run the chunks' generators, up to ``pipeline_depth`` collectives in flight;
        yields [work] for the oldest one whenever it must be complete to go on."""
        depth = max(1, self.section.pipeline_depth)
        inflight = deque()

        def finish_oldest():
            gen, work = inflight.popleft()
            if work is not None:
                yield [work]
            self._step(gen, False, inflight)

        for gen in tasks:
            self._step(gen, True, inflight)
            while len(inflight) >= depth:
                yield from finish_oldest()
        while inflight:
            yield from finish_oldest()
