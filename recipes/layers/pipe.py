"""Pipeline wrappers: each class is one entry of a PipelineModule's layer list and
maps one tensor to the next (token ids -> hidden states -> ... -> logits).

Every layer initialises its own weights from ``(seed, position)``, so the model is the
same however DeepSpeed partitions it over stages: a pipelined run and a
single-process reference start from bitwise-equal weights.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ds_ext.pipe.zero_bubble import Linear

from .mla import MLAttention
from .mlp import SwiGLU
from .moe import DeepSeekMoE, TopkRouter
from .norm import RMSNorm

IGNORE_INDEX = -100


def _init_weights(module, std, seed):
    """transformers' DeepseekV3 initialisation: N(0, std) weights, zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
        elif isinstance(m, TopkRouter):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            nn.init.zeros_(m.e_score_correction_bias)
        elif isinstance(m, DeepSeekMoE):
            m.init_experts(seed=seed, std=std)


def seeded_init(module, *, seed, std):
    """Initialise ``module`` from its own RNG stream, leaving the global RNG untouched.
    Routed experts get one stream each (by global index), so expert parallelism does
    not change the model."""
    if any(p.is_meta for p in module.parameters()):
        return   # built on the meta device to count or plan: nothing to fill
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _init_weights(module, std, seed)


def layer_seed(base_seed, position):
    return (base_seed * 1_000_003 + position) % (2**63 - 1)


def _split(x):
    """Layers pass one tensor, or (hidden, extra) when a second tensor travels along:
    the token ids (MTP before its module, or document-bounded attention) or MTP's
    hidden states after it."""
    return (x, None) if torch.is_tensor(x) else x


def _hidden_only(extra):
    """The carried tensor if it is hidden states (MTP), None if it is token ids."""
    return extra if extra is not None and extra.is_floating_point() else None


def document_mask(input_ids, document_token):
    """bool [batch, 1, seq, seq]: position i attends to positions j <= i of its own
    document; a document ends with (and includes) ``document_token``. Packed rows may
    start or end inside a document."""
    ends = (input_ids == document_token).to(torch.int32)
    doc = torch.cumsum(ends, dim=1) - ends
    seq = input_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).tril()
    return ((doc.unsqueeze(2) == doc.unsqueeze(1)) & causal).unsqueeze(1)


def _join(hidden, extra):
    return hidden if extra is None else (hidden, extra)


class EmbeddingPipe(nn.Module):
    """Token ids -> hidden states; with ``carry_ids`` (MTP) the ids travel along, so the
    MTP module on the last stage can embed each position's next token."""

    @staticmethod
    def hf_prefix(config, **module_kwargs):
        """transformers' name prefix of this layer's tensors (recipes/layers/hf.py)."""
        return "model."

    def __init__(self, config, *, seed, carry_ids=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.carry_ids = carry_ids
        seeded_init(self, seed=layer_seed(seed, 0), std=config.initializer_range)

    def forward(self, input_ids):
        hidden = self.embed_tokens(input_ids)
        return (hidden, input_ids) if self.carry_ids else hidden


class DecoderLayerPipe(nn.Module):
    """Pre-norm block: x + MLA(norm(x)), then + MLP-or-MoE(norm(x))."""

    attention_class = MLAttention     # a subclass may swap the attention (recipes/layers/dsa.py)

    @staticmethod
    def hf_prefix(config, *, layer_idx, **module_kwargs):
        return f"model.layers.{layer_idx}."

    def __init__(self, config, *, layer_idx, seed, ep_size=1, ep_rank=0, document_token=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.document_token = document_token      # attention stays inside documents (the ids travel along)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = self.attention_class(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.mlp = DeepSeekMoE(config, ep_size=ep_size, ep_rank=ep_rank)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.hidden_act)
        seeded_init(self, seed=layer_seed(seed, 1 + layer_idx), std=config.initializer_range)

    def block(self, hidden, mask=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), mask=mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, x):
        hidden, extra = _split(x)
        mask = document_mask(extra, self.document_token) if self.document_token is not None else None
        return _join(self.block(hidden, mask), extra)


def mtp_next_embedding(embedding, x):
    """TiedLayerSpec forward_fn (the shared embedding, on the last stage): (hidden, ids)
    -> (hidden, embedding of each position's next input token). The last position has
    no next input token; it gets the first one, and its MTP target is ignored."""
    hidden, input_ids = x
    return hidden, embedding.embed_tokens(torch.roll(input_ids, shifts=-1, dims=1))


class MTPLayerPipe(DecoderLayerPipe):
    """DeepSeek-V3's multi-token prediction module of depth 1: RMSNorm the main
    model's last hidden state (hnorm) and the next token's embedding (enorm),
    concatenate [enorm, hnorm], project (eh_proj), run one transformer block (of the
    kind of the model's last layer), then its own output norm (shared_head.norm).
    Names follow DeepSeek's checkpoints (model.layers.<L>.enorm ...)."""

    @staticmethod
    def hf_prefix(config, **module_kwargs):
        return f"model.layers.{config.num_hidden_layers}."

    def __init__(self, config, *, seed, ep_size=1, ep_rank=0):
        super().__init__(config, layer_idx=config.num_hidden_layers, seed=seed, ep_size=ep_size, ep_rank=ep_rank)
        h = config.hidden_size
        self.enorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps=config.rms_norm_eps)
        seeded_init(self, seed=layer_seed(seed, 2 + config.num_hidden_layers), std=config.initializer_range)

    def forward(self, x):
        hidden, next_embedding = x
        mtp = self.eh_proj(torch.cat([self.enorm(next_embedding), self.hnorm(hidden)], dim=-1))
        return hidden, self.shared_head.norm(self.block(mtp))


class FinalNormPipe(nn.Module):

    @staticmethod
    def hf_prefix(config, **module_kwargs):
        return "model."

    def __init__(self, config):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x):
        hidden, extra = _split(x)
        return _join(self.norm(hidden), extra)


class LMHeadPipe(nn.Module):
    """The output projection; with MTP it projects both the main and the MTP states."""

    @staticmethod
    def hf_prefix(config, **module_kwargs):
        return ""

    def __init__(self, config, *, seed):
        super().__init__()
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        seeded_init(self, seed=layer_seed(seed, 1 + config.num_hidden_layers), std=config.initializer_range)

    def forward(self, x):
        hidden, extra = _split(x)
        extra = _hidden_only(extra)
        return _join(self.lm_head(hidden), None if extra is None else self.lm_head(extra))


def tied_lm_head(embedding, x):
    """TiedLayerSpec forward_fn: the head reuses the embedding matrix."""
    hidden, extra = _split(x)
    extra = _hidden_only(extra)
    weight = embedding.embed_tokens.weight
    return _join(F.linear(hidden, weight), None if extra is None else F.linear(extra, weight))


def causal_lm_loss(logits, labels):
    """Mean next-token cross-entropy in fp32; ``labels`` are already shifted and use
    -100 for positions without a target."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX)


class CausalLMLoss:
    """The pipeline's loss_fn. With MTP the outputs are (logits, mtp_logits) and the
    loss is CE(logits) + weight * CE(mtp_logits at i vs the token at i + 2); both
    parts are kept for ``additional_losses`` (reported apart by DeepSpeed's engine)."""

    def __init__(self, mtp_weight=0.0, *, mtp=False):
        self.mtp_weight = mtp_weight
        self.mtp = mtp
        self.last = None

    def __call__(self, outputs, labels):
        if torch.is_tensor(outputs):
            return causal_lm_loss(outputs, labels)
        logits, mtp_logits = outputs
        main = causal_lm_loss(logits, labels)
        mtp_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
        mtp = causal_lm_loss(mtp_logits, mtp_labels)
        self.last = {"lm": main.detach(), "mtp": mtp.detach()}
        return main + self.mtp_weight * mtp

    def additional_losses(self):
        """The last micro-batch's parts, for DeepSpeed's get_additional_losses (every
        stage must name the same losses; stages without the loss report zeros)."""
        if not self.mtp:
            return None
        return self.last if self.last is not None else {"lm": torch.zeros(()), "mtp": torch.zeros(())}


# ---- partitioning and references (no process group needed) ----------------------

def _spec_name(spec):
    return spec.typename.__name__


def partition(specs, *, num_parts, method):
    """Layer boundaries exactly as DeepSpeed's PipelineModule computes them; ``method``
    may also be a cut already made (a list of ``num_parts + 1`` boundaries, e.g.
    ``pipeline.partition: "balanced"`` resolved by ds_ext.profile.plan)."""
    import re
    from deepspeed.runtime import utils as ds_utils
    if not isinstance(method, str):
        bounds = [int(b) for b in method]
        if len(bounds) != num_parts + 1 or bounds[0] != 0 or bounds[-1] != len(specs) or bounds != sorted(bounds):
            raise ValueError(f"a cut of {len(specs)} layers into {num_parts} parts needs {num_parts + 1} "
                             f"non-decreasing boundaries from 0 to {len(specs)}, got {bounds}")
        return bounds
    method = method.lower()
    if method == "uniform":
        return ds_utils.partition_uniform(num_items=len(specs), num_parts=num_parts)
    if method == "parameters":
        return ds_utils.partition_balanced(weights=[count_parameters(s) for s in specs], num_parts=num_parts)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if pattern.search(_spec_name(s)) else 0 for s in specs]
        if not any(weights):
            raise ValueError(f"partition method {method!r} matches no layer")
        return ds_utils.partition_balanced(weights=weights, num_parts=num_parts)
    raise ValueError(f"unknown partition method {method!r}: use 'uniform', 'parameters', 'type:REGEX' or 'balanced'")


def balanced_cut(costs, *, schedule, stages):
    """Boundaries of the layer list into the schedule's virtual stages that minimise the
    busiest pipeline rank's compute, from a cost per layer (seconds per micro-batch,
    forward + backward + W; ds_ext.profile.plan). The cut is handed to DeepSpeed's
    PipelineModule as its ``parts`` (ds_ext.pipe's "balanced" method).

    DeepSpeed's ``partition_balanced`` evens out contiguous parts, but a rank may hold
    two of them: the V schedules give rank r parts r and 2P-1-r, dualpipe r and a copy
    of P-1-r, so their ranks pair parts from both ends of the list. Exact dynamic
    programmes: 1f1b over prefixes; the paired schedules over (left, right) boundaries
    folded from the ends inwards, one pair at a time. Ties on the busiest rank are then
    broken by moving single boundaries while the sorted loads fall. Every part keeps at
    least one layer."""
    import numpy as np
    from ds_ext.pipe import rank_chunks, virtual_stages
    parts, n = virtual_stages(schedule, stages), len(costs)
    if parts > n:
        raise ValueError(f"{parts} parts of {n} layers: every part needs a layer")
    owners = [rank_chunks(schedule, rank=r, stages=stages) for r in range(stages)]
    pre = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    if all(len(o) == 1 for o in owners):
        bounds = _cut_contiguous(pre, parts)
    elif all(sorted(o) == sorted({o[0], parts - 1 - o[0]}) for o in owners) and parts % 2 == 0:
        bounds = _cut_folded(pre, parts // 2)
    else:
        raise ValueError(f"no balanced cut for schedule {schedule!r}: ranks hold parts {owners}")

    def loads(b):
        chunk = [pre[b[p + 1]] - pre[b[p]] for p in range(parts)]
        return tuple(sorted((sum(chunk[p] for p in set(own)) for own in owners), reverse=True))

    best, improved = loads(bounds), True
    while improved:
        improved = False
        for p in range(1, parts):
            for step in (-1, 1):
                trial = list(bounds)
                trial[p] += step
                if bounds[p - 1] < trial[p] < bounds[p + 1] and loads(trial) < best:
                    bounds, best, improved = trial, loads(trial), True
    return [int(b) for b in bounds]


def _cut_contiguous(pre, parts):
    """Min-max cut of the prefix sums ``pre`` into ``parts`` non-empty contiguous parts."""
    import numpy as np
    n = len(pre) - 1
    best = np.full((parts + 1, n + 1), np.inf)
    back = np.zeros((parts + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for p in range(1, parts + 1):
        for i in range(p, n - (parts - p) + 1):
            k = np.arange(p - 1, i)
            value = np.maximum(best[p - 1, k], pre[i] - pre[k])
            j = int(np.argmin(value))
            best[p, i], back[p, i] = value[j], k[j]
    bounds = [n]
    for p in range(parts, 0, -1):
        bounds.append(int(back[p, bounds[-1]]))
    return bounds[::-1]


def _cut_folded(pre, pairs):
    """Min-max cut into 2 x ``pairs`` non-empty parts where pair q is part q and part
    2 x pairs - 1 - q: states (i, j) = the left parts end at i, the right ones start at
    j; pair q adds [i, i') and [j', j)."""
    import numpy as np
    n = len(pre) - 1
    inf = np.inf
    value = np.full((n + 1, n + 1), inf)
    value[0, n] = 0.0
    history = []
    for q in range(pairs):
        last = q == pairs - 1
        new = np.full((n + 1, n + 1), inf)
        back = np.zeros((n + 1, n + 1, 2), dtype=int)
        rows = np.arange(n + 1)
        for i2 in range(1, n):
            left = pre[i2] - pre[:i2]                      # over i < i2
            sub = value[:i2]                               # (i, j)
            # right part [j2, j) for every j2 >= i2 (the middle pair meets: j2 == i2)
            for j2 in ([i2] if last else range(i2, n)):
                cols = rows[j2 + 1:]
                if not len(cols):
                    continue
                cand = np.maximum(sub[:, j2 + 1:], left[:, None] + (pre[j2 + 1:] - pre[j2])[None, :])
                flat = int(np.argmin(cand))
                i, jj = divmod(flat, cand.shape[1])
                if cand[i, jj] < new[i2, j2]:
                    new[i2, j2], back[i2, j2] = cand[i, jj], (i, cols[jj])
        value = new
        history.append(back)
    i2 = int(np.argmin(np.diagonal(value)))
    left, right, state = [i2], [i2], (i2, i2)
    for back in reversed(history[1:]):
        state = tuple(int(x) for x in back[state])
        left.append(state[0])
        right.append(state[1])
    left.append(0)
    right.append(n)
    return left[::-1] + right[1:]


def count_parameters(spec):
    """Parameters of one layer spec, built on the meta device (no memory)."""
    with torch.device("meta"):
        module = spec.build()
    return sum(p.numel() for p in module.parameters())


def activated_parameters(specs):
    """Parameters one token passes through: everything but the routed experts it is
    not sent to and the input embedding table (a lookup, not a matmul; the convention
    behind DeepSeek-V3's "37B activated"). Built on the meta device."""
    total = 0
    for spec in specs:
        with torch.device("meta"):
            module = spec.build()
        if isinstance(module, EmbeddingPipe) and getattr(spec, "forward_fn", None) is None:
            continue
        for sub in module.modules():
            if isinstance(sub, DeepSeekMoE):
                routed = sum(p.numel() for p in sub.experts.parameters())
                k, e = sub.gate.top_k, sub.gate.num_experts
                total -= routed - routed * k // e
        total += sum(p.numel() for p in module.parameters())
    return total


def held_once(specs, indices):
    """``indices`` of ``specs`` with each tied layer (a TiedLayerSpec key) kept at its
    first occurrence only: DeepSpeed holds one copy of a tied matrix per rank."""
    seen, out = set(), []
    for idx in indices:
        key = getattr(specs[idx], "key", None)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        out.append(idx)
    return out


def rank_layers(specs, *, bounds, schedule, stages):
    """Per pipeline rank: the indices of the layer specs it holds (its chunks of the
    cut at ``bounds``, a tied layer once)."""
    from ds_ext.pipe import rank_chunks
    return [held_once(specs, [i for p in rank_chunks(schedule, rank=rank, stages=stages)
                              for i in range(bounds[p], bounds[p + 1])]) for rank in range(stages)]


def stage_parameter_counts(specs, *, stages, schedule, partition_method):
    """Per pipeline rank: its layer ranges and parameter count, without allocating."""
    from ds_ext.pipe import rank_chunks, virtual_stages
    bounds = partition(specs, num_parts=virtual_stages(schedule, stages), method=partition_method)
    counts = [count_parameters(s) for s in specs]
    unique_total = sum(counts[i] for i in held_once(specs, range(len(specs))))
    return [{"rank": rank, "layer_ranges": [(bounds[p], bounds[p + 1]) for p in rank_chunks(schedule, rank=rank,
                                                                                           stages=stages)],
             "params": sum(counts[i] for i in held), "unique_total": unique_total}
            for rank, held in enumerate(rank_layers(specs, bounds=bounds, schedule=schedule, stages=stages))]


class SequentialReference(nn.Module):
    """All layers of a spec list in one process: the single-rank reference a
    pipelined run is checked against. Tied specs share one module, as in DeepSpeed,
    and state-dict keys are a PipelineModule's ("3.self_attn.o_proj.weight",
    "tied_modules.embed.embed_tokens.weight"), so weights compare key by key."""

    def __init__(self, specs, loss_fn=None):
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self._funcs = []
        for idx, spec in enumerate(specs):
            key = getattr(spec, "key", None)
            if key is None:
                module = spec.build()
                self.add_module(str(idx), module)
                self._funcs.append(module)
                continue
            if key not in self.tied_modules:
                self.tied_modules[key] = spec.build()
            module = self.tied_modules[key]
            fn = spec.forward_fn
            self._funcs.append(module if fn is None else (lambda x, m=module, f=fn: f(m, x)))
        self.loss_fn = loss_fn or CausalLMLoss()
        self._modules_in_order = []
        for idx, spec in enumerate(specs):
            key = getattr(spec, "key", None)
            module = self.tied_modules[key] if key is not None else getattr(self, str(idx))
            if all(module is not m for m in self._modules_in_order):
                self._modules_in_order.append(module)

    def layer_modules(self):
        """Each layer's module once, in the layer list's order (a tied module at its first use)."""
        return iter(self._modules_in_order)

    def forward(self, input_ids):
        x = input_ids
        for fn in self._funcs:
            x = fn(x)
        return x


# ---- a recipe's pipeline (recipes.spec.RecipeSpec.build_pipeline) ------------------

def decoder_stack_specs(config, *, seed, decoder=None, mtp_layer=None, ep_size=1, ep_rank=0, document_token=None,
                        **layer_kwargs):
    """A DeepSeek-style model as DeepSpeed layer specs: embedding, ``decoder`` layers
    (``config.num_hidden_layers`` of them; DecoderLayerPipe by default), [``mtp_layer``:
    DeepSeek-V3's MTP module, when num_mtp_layers is 1], final norm, head.
    ``layer_kwargs`` go to every decoder and MTP layer.

    With tie_word_embeddings the embedding and the head are one TiedLayerSpec key, so
    DeepSpeed keeps the matrix on both end stages and sums their gradients. The MTP
    module shares the embedding the same way (and the head, which it calls after the
    main head's input on the last stage).
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    from ds_ext.errors import ConfigError
    decoder, mtp_layer = decoder or DecoderLayerPipe, mtp_layer or MTPLayerPipe
    mtp = config.num_mtp_layers > 0
    if mtp and document_token is not None:
        raise ConfigError("document-bounded attention (seekspeed.data.attention \"document\") does not support "
                          "multi-token prediction yet: set num_mtp_layers to 0 or attention to \"causal\"")
    carry = mtp or document_token is not None

    def embed(**kw):
        return TiedLayerSpec("embed", EmbeddingPipe, config, seed=seed, carry_ids=carry,
                             tied_weight_attr=["embed_tokens.weight"], **kw)

    specs = [embed() if config.tie_word_embeddings or mtp else
             LayerSpec(EmbeddingPipe, config, seed=seed, carry_ids=carry)]
    layer = dict(ep_size=ep_size, ep_rank=ep_rank, **layer_kwargs)
    specs += [LayerSpec(decoder, config, layer_idx=i, seed=seed, document_token=document_token, **layer)
              for i in range(config.num_hidden_layers)]
    if mtp:
        specs += [embed(forward_fn=mtp_next_embedding), LayerSpec(mtp_layer, config, seed=seed, **layer)]
    specs.append(LayerSpec(FinalNormPipe, config))
    specs.append(embed(forward_fn=tied_lm_head) if config.tie_word_embeddings else LayerSpec(LMHeadPipe, config, seed=seed))
    return specs


def build_pipeline(spec, config, *, num_stages=None, topology=None, schedule="1f1b", partition_method=None,
                   activation_checkpoint_interval=0, seed=1234, mtp_loss_weight=0.3, expert_parallel_size=1,
                   document_token=None, module_kwargs=None, **options):
    """Recipe ``spec``'s model as a DeepSpeed PipelineModule for ``schedule``
    (ds_ext.pipe's module class: DualPipeVModule for the V schedules).

    Only the layers of this rank's stage(s) are built. Call after
    ``deepspeed.init_distributed()``. With ``document_token`` (the tokenizer's
    end-of-document id) attention does not cross the documents packed into a row.
    ``partition_method`` (default: the spec's) may be a cut already made (boundaries,
    as "balanced" resolves to); ``options`` are the recipe's own (RecipeSpec.options),
    ``module_kwargs`` more arguments of the PipelineModule (a recipe's ``build``).
    """
    from ds_ext.pipe import pipeline_module_class
    partition_method = partition_method or spec.default_partition
    bounds = None
    if not isinstance(partition_method, str):
        bounds, partition_method = [int(b) for b in partition_method], "balanced"
    stages = num_stages if num_stages is not None else topology.get_dim("pipe")
    check_stages(config, stages=stages, schedule=schedule)
    ep_rank = expert_parallel_rank(stages=stages, ep_size=expert_parallel_size)
    specs = spec.layer_specs(config, seed=seed, ep_size=expert_parallel_size, ep_rank=ep_rank,
                             document_token=document_token, **options)
    check_checkpointing(spec, specs, interval=activation_checkpoint_interval)
    return pipeline_module_class(schedule)(
        layers=specs, num_stages=num_stages, topology=topology,
        loss_fn=spec.loss_fn(config, mtp_loss_weight=mtp_loss_weight), partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        checkpointable_layers=list(spec.checkpointable_layers), partition_bounds=bounds, **(module_kwargs or {}))


def expert_parallel_rank(*, stages, ep_size):
    """This rank's place in its expert-parallel group. DeepSpeed lays ranks out as
    pipe x data and carves expert-parallel groups of consecutive data-parallel ranks
    out of each stage (deepspeed.utils.groups), so it is the data-parallel index
    modulo the group size; the MoE layer checks it against DeepSpeed's groups."""
    from deepspeed import comm as dist

    from ds_ext.errors import ConfigError
    data_parallel = dist.get_world_size() // stages
    if data_parallel % ep_size:
        raise ConfigError(f"seekspeed.moe.expert_parallel_size {ep_size} does not divide the data-parallel size "
                          f"{data_parallel}: choose a divisor of {data_parallel}")
    return (dist.get_rank() % data_parallel) % ep_size


def check_stages(config, *, stages, schedule):
    from ds_ext.errors import ConfigError
    from ds_ext.pipe import virtual_stages
    parts = virtual_stages(schedule, stages)
    if parts > config.num_hidden_layers:
        extra = f" ({stages} ranks x 2 for {schedule})" if parts != stages else ""
        raise ConfigError(f"pipeline stages {parts}{extra} exceed decoder layers ({config.num_hidden_layers}): "
                          f"lower pipeline.stages or add layers (num_hidden_layers)")


def _own_layers(specs):
    """The specs that build a module of their own (a tied layer's forward_fn reuses one)."""
    return [s for s in specs if getattr(s, "forward_fn", None) is None]


def check_checkpointing(spec, specs, *, interval):
    """DeepSpeed checkpoints only layers whose class name is in checkpointable_layers,
    matched exactly: with ``interval`` > 0, a list that matches no layer of the model
    would silently checkpoint nothing, so it is an error naming the classes."""
    from ds_ext.errors import ConfigError
    if interval <= 0:
        return
    names = sorted({s.typename.__name__ for s in specs})
    if not set(spec.checkpointable_layers) & set(names):
        raise ConfigError(f"pipeline.activation_checkpoint_interval {interval}, and recipe {spec.name}'s "
                          f"checkpointable_layers {list(spec.checkpointable_layers)} name no layer class of the model "
                          f"({names}): DeepSpeed matches class names exactly, so list the decoder layer class there")


def layer_warnings(spec, specs, *, schedule, checkpoint_interval):
    """What would silently cost memory or speed, one line each naming the class:
    a repeated layer class that activation checkpointing (``checkpoint_interval`` > 0)
    skips because checkpointable_layers does not name it; and under a zero-bubble schedule, a ``torch.nn.Linear`` that
    is not ds_ext.pipe.zero_bubble's, whose weight gradient then cannot be deferred to
    the W slots. Layers are built on the meta device, one per class."""
    import collections

    from ds_ext.pipe.registry import schedule_spec
    from ds_ext.pipe.zero_bubble import Linear
    out = []
    own = _own_layers(specs)
    counts = collections.Counter(s.typename.__name__ for s in own)
    listed = set(spec.checkpointable_layers)
    if checkpoint_interval > 0:
        for name, n in sorted(counts.items()):
            if n > 1 and name not in listed:
                out.append(f"recipe {spec.name}: {n} layers of class {name} are not checkpointed "
                           f"(pipeline.activation_checkpoint_interval {checkpoint_interval}): DeepSpeed checkpoints "
                           f"only checkpointable_layers {sorted(listed)}; add {name} there")
    if schedule_spec(schedule).zero_bubble:
        seen = set()
        for layer in own:
            cls = layer.typename
            if cls in seen:
                continue
            seen.add(cls)
            with torch.device("meta"):
                module = layer.build()
            plain = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, Linear)]
            if plain:
                out.append(f"recipe {spec.name}: {cls.__name__}.{plain[0]} is a torch.nn.Linear"
                           f"{f' (and {len(plain) - 1} more)' if len(plain) > 1 else ''}: under {schedule} its weight "
                           f"gradient is computed in B, not deferred to a W slot; use ds_ext.pipe.zero_bubble.Linear")
    return out


def print_stage_parameters(spec, *, default_preset, argv=None):
    """``python -m recipes.<name>``: the parameters each pipeline rank holds and the
    parameters one token passes through, built on the meta device."""
    import argparse

    from ds_ext.pipe import SCHEDULES
    parser = argparse.ArgumentParser(description="Parameters per pipeline rank, built on the meta device.")
    parser.add_argument("--preset", default=default_preset, choices=sorted(spec.presets))
    parser.add_argument("--stages", type=int, default=16)
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--partition", default=spec.default_partition)
    args = parser.parse_args(argv)
    config = spec.make_config(args.preset)
    spec.check_stages(config, stages=args.stages, schedule=args.schedule)
    specs = spec.layer_specs(config, seed=0)
    rows = stage_parameter_counts(specs, stages=args.stages, schedule=args.schedule, partition_method=args.partition)
    print(f"{'rank':>4}  {'layers':<24} {'params':>16}  {'bf16 weights':>12}")
    for row in rows:
        ranges = ", ".join(f"[{a},{b})" for a, b in row["layer_ranges"])
        print(f"{row['rank']:>4}  {ranges:<24} {row['params']:>16,}  {row['params'] * 2 / 2**30:>9.2f} GiB")
    unique, activated = rows[0]["unique_total"], activated_parameters(specs)
    print(f"total (unique): {unique:,} parameters ({unique / 1e9:.2f} B); activated per token: {activated:,} "
          f"({activated / 1e9:.2f} B)")
