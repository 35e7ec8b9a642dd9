"""The layers of the decoder family: RMSNorm, RoPE, grouped-query attention and the MLP.

`llmopt.models.llama` assembles them into blocks and the model; `llmopt.models.gemma2`
reuses them in Gemma 2's sandwich block. Architecture differences are read from the config
and its `ModelSpec` here (Qwen3's per-head q/k norms, Gemma 2's soft-capped scores, query
scale, per-layer windows and GeGLU) so every block kind shares one attention and one MLP.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.models.attention.core import AttentionCore
from llmopt.models.config import ModelConfig
from llmopt.models.spec import get_spec

if TYPE_CHECKING:
    from llmopt.models.attention.backend import AttentionBackend


class SoftcappedLinear(nn.Linear):
    """The LM head with final-logit soft-capping (Gemma 2): cap * tanh(logits / cap).

    The cap lives in the head module so every caller of the head (the loss from hidden
    states, perplexity, tensor parallelism's sharded head) applies it.
    """

    def __init__(self, in_features: int, out_features: int, cap: float) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x) / self.cap) * self.cap


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, then cast back before the weight: HF's order, needed for bf16 parity.
        # F.rms_norm is one fused op instead of five: decode is bound by per-op overhead.
        dtype = x.dtype
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(dtype)


def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, including Llama 3.1's long-context rescaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
        inv_freq = scaled
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in fp32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_frequencies(config)
        positions = torch.arange(config.max_seq_len, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, start: int, length: int, dtype: torch.dtype):
        return self.cos[start : start + length].to(dtype), self.sin[start : start + length].to(
            dtype
        )

    def at(self, positions: torch.Tensor, dtype: torch.dtype):
        """Tables at explicit positions [B|1, T] -> [B|1, 1, T, D] (broadcast over heads)."""
        return self.cos[positions][:, None].to(dtype), self.sin[positions][:, None].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def layer_window(config: ModelConfig, layer_idx: int) -> int | None:
    """The sliding window of one layer (None: all keys), honouring `full_attention_every`."""
    every = config.full_attention_every
    if every is not None and (layer_idx + 1) % every == 0:
        return None
    return config.sliding_window


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads  # local counts: tensor parallelism divides them
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, config.q_size, bias=bias)
        self.k_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(h, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, h, bias=False)
        if get_spec(config.architecture).qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        scalar = config.query_pre_attn_scalar
        self.core = AttentionCore(
            layer_window(config, layer_idx),
            scale=None if scalar is None else scalar**-0.5,
            softcap=config.attn_softcap,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend | None = None,
    ) -> torch.Tensor:
        batch, t, _ = x.shape
        q = self.q_proj(x).view(batch, t, -1, self.head_dim)
        k = self.k_proj(x).view(batch, t, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(batch, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if attn is None:
            out = self.core(q, k, v)
        else:
            out = attn.attend(self.core, self.layer_idx, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, t, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.kind = config.mlp
        self.gelu_gate = get_spec(config.architecture).gate_activation == "gelu_tanh"
        if self.kind == "swiglu":
            self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu" and self.gelu_gate:  # GeGLU (Gemma)
            gate = F.gelu(self.gate_proj(x), approximate="tanh")
            return self.down_proj(gate * self.up_proj(x))
        if self.kind == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))
