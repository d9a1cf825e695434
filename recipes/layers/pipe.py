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

from .dispatch import DEFAULT_DISPATCH, Dispatch
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

    def __init__(self, config, *, layer_idx, seed, ep_size=1, ep_rank=0, document_token=None,
                 moe_dispatch=DEFAULT_DISPATCH):
        super().__init__()
        self.layer_idx = layer_idx
        self.document_token = document_token      # attention stays inside documents (the ids travel along)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = self.attention_class(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.mlp = DeepSeekMoE(config, ep_size=ep_size, ep_rank=ep_rank, dispatch=moe_dispatch)
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

    def __init__(self, config, *, seed, ep_size=1, ep_rank=0, moe_dispatch=DEFAULT_DISPATCH):
        super().__init__(config, layer_idx=config.num_hidden_layers, seed=seed, ep_size=ep_size, ep_rank=ep_rank,
                         moe_dispatch=moe_dispatch)
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


def build_options(section):
    """build_pipeline's arguments read from the seekspeed section (RecipeSpec.build_options):
    the MTP loss weight (seekspeed.mtp), the expert-parallel degree and the MoE layers'
    token dispatcher (seekspeed.moe; a layer option, passed on to layer_specs)."""
    return {"mtp_loss_weight": section.mtp.loss_weight, "expert_parallel_size": section.moe.expert_parallel_size,
            # dispatch_dtype is "fp8" or names the activation dtype (ds_ext.precision.check_dispatch_dtype)
            "moe_dispatch": Dispatch(section.moe.dispatcher, "fp8" if section.moe.dispatch_dtype == "fp8" else None)}


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
