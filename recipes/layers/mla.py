"""Multi-head Latent Attention (DeepSeek-V2/V3).

Queries go through a low-rank bottleneck (q_a_proj -> RMSNorm -> q_b_proj) or a plain
q_proj when ``q_lora_rank`` is None. Keys and values share one compressed latent
(kv_a_proj_with_mqa -> RMSNorm on the latent part -> kv_b_proj) plus one rotary key
of ``qk_rope_head_dim`` shared by all heads (decoupled RoPE). Parameter names follow
transformers' DeepseekV3Attention so weights map one to one.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ds_ext.pipe.zero_bubble import Linear

from .norm import RMSNorm
from . import rope


class MLAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.v_head_dim = c.v_head_dim
        self.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.rope_interleave = c.rope_interleave

        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = Linear(c.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                            bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = Linear(c.kv_lora_rank, self.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = Linear(self.num_heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias)

        inv_freq, self.rope_attention_factor = rope.inv_freq_and_attention_factor(
            c.rope_parameters, dim=c.qk_rope_head_dim, max_position_embeddings=c.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = rope.softmax_scale(self.qk_head_dim, c.rope_parameters,
                                          max_position_embeddings=c.max_position_embeddings)

    def project(self, x):
        """(q, k, v, q_resid) for ``x`` [B, S, H]: per-head queries and keys [B, heads,
        S, qk_head_dim] with RoPE applied, values [B, heads, S, v_head_dim], and the
        normalised query latent [B, S, q_lora_rank] (None without q_lora_rank)."""
        batch, seq, _ = x.shape
        if self.q_lora_rank is None:
            q_resid = None
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(batch, seq, self.num_heads, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rot = k_rot.view(batch, 1, seq, self.qk_rope_head_dim)

        cos, sin = rope.cos_sin(self.inv_freq, self.rope_attention_factor, seq_len=seq, dtype=x.dtype,
                                device=x.device)
        q_rot, k_rot = rope.apply_rope(q_rot, k_rot, cos, sin, interleave=self.rope_interleave)

        kv = self.kv_b_proj(latent).view(batch, seq, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv.transpose(1, 2), [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rot), dim=-1)
        return q, k, v, q_resid

    def output(self, out):
        """o_proj of the attention output [B, heads, S, v_head_dim]."""
        batch, _, seq, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.v_head_dim))

    def forward(self, x, mask=None):
        """``mask`` (bool [batch, 1, seq, seq], True where a query may attend a key)
        replaces the causal mask: document-bounded attention."""
        q, k, v, _ = self.project(x)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        return self.output(out)
