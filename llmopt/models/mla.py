"""Multi-head latent attention (DeepSeek-V2/V3), the attention of `config.mla` models.

Queries go through a rank-`q_lora_rank` bottleneck (q_a_proj, RMSNorm, q_b_proj; or one
q_proj), keys and values through one shared latent: kv_a_proj_with_mqa gives the
`kv_lora_rank` latent (RMSNorm'd, then kv_b_proj expands it to every head's key part without
position, `qk_nope_head_dim`, and its value, `v_head_dim`) plus one `qk_rope_head_dim` key part
that carries RoPE and is shared by all heads. A head's query/key is [nope, rope]: the two are
decoupled so the latent itself never rotates. DeepSeek's checkpoints store the rope part's
pairs interleaved (`rope_interleave`): its evens and odds are split before the usual
rotate-half RoPE, which is HF's `apply_rotary_pos_emb_interleave` exactly.

The backend gets per-head keys [B, H, T, nope + rope] and values [B, H, T, v_head_dim]: key and
value head dims differ, which every `AttentionCore` path and cache accepts (`num_kv_heads`,
`head_dim`, `v_head_dim` size the caches). Caching the expanded keys rather than the latent
costs memory, not correctness; the latent cache (absorbing kv_b_proj into the query and the
output) is a serving optimisation for later. Parameter names are HF's (`self_attn.q_a_proj`,
`kv_a_layernorm`, ...), so DeepSeek checkpoints load one-to-one.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.models.attention.backend import AttentionBackend
from llmopt.models.attention.core import AttentionCore
from llmopt.models.config import ConfigError, ModelConfig
from llmopt.models.layers import Attention, RMSNorm, apply_rope, layer_window
from llmopt.models.spec import get_spec

LATENT_NORM_EPS = 1e-6  # HF DeepseekV3RMSNorm's default: the latent norms ignore rms_norm_eps


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        mla = config.mla
        self.layer_idx = layer_idx
        self.mla = mla
        self.num_heads = config.num_heads  # local counts: tensor parallelism would divide them
        self.num_kv_heads = config.num_heads  # every head gets its own expanded key and value
        self.head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim  # the key (and query) dim
        self.v_head_dim = mla.v_head_dim
        h, bias, heads = config.hidden_size, config.attention_bias, config.num_heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * self.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * self.head_dim, bias=False)
        rope, latent = mla.qk_rope_head_dim, mla.kv_lora_rank
        self.kv_a_proj_with_mqa = nn.Linear(h, latent + rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(latent, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            latent, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, h, bias=bias)
        self.core = AttentionCore(layer_window(config, layer_idx))  # scale 1/sqrt(nope + rope)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.mla.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend | None = None,
    ) -> torch.Tensor:
        batch, t, _ = x.shape
        nope, rope = self.mla.qk_nope_head_dim, self.mla.qk_rope_head_dim
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, t, -1, self.head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.mla.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(batch, t, -1, nope + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([nope, self.v_head_dim], dim=-1)
        k_rope = self._rope(k_rope.view(batch, 1, t, rope), cos, sin)
        q = torch.cat([q_nope, self._rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        out = (
            self.core(q, k, v) if attn is None else attn.attend(self.core, self.layer_idx, q, k, v)
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, t, -1))


def attention(config: ModelConfig, layer_idx: int) -> nn.Module:
    """A block's attention: latent attention for an MLA config, else grouped-query."""
    if config.mla is None:
        return Attention(config, layer_idx)
    if not get_spec(config.architecture).latent_attention:
        raise ConfigError(
            f"{config.name}: architecture {config.architecture!r} has no latent attention; an "
            "MLA config needs one that has (deepseek_v3)"
        )
    return LatentAttention(config, layer_idx)
