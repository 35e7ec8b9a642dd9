"""A plain PyTorch decoder for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2).

RMSNorm, RoPE (HF "rotate half" layout), grouped-query attention through
`scaled_dot_product_attention`, SwiGLU (or GELU) MLP, tied or untied embeddings, optional
q/k/v biases (Qwen2), optional sliding-window attention (Mistral). Parameter names follow
HF's (minus the `model.` prefix) so checkpoints map one-to-one; the `ModelSpec`s of
`llmopt.models.spec` name them for everything outside this package.

The forward tolerates stage-deleted modules (torchtitan's pipeline convention): without an
embedding the input is already hidden states, without a final norm / head the output is the
hidden states, and `layers` may hold a subset of the blocks (a ModuleDict keyed by index).

Nothing here knows about parallelism, precision or quantization: those are applied to this
model by functions elsewhere that swap or wrap submodules. To make that possible:
- every linear layer is a plain `nn.Linear` attribute (swappable),
- the attention core (softmax(QK^T)V) is its own submodule `self_attn.core` (selective
  recompute wraps exactly that),
- attention reads its local head counts from its own attributes, which tensor parallelism
  divides.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.models.config import ConfigError, ModelConfig

# `enable_gqa` (torch >= 2.5) avoids materialising repeated KV heads.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class KVCache:
    """Preallocated keys/values for every layer, with a rollback-able fill level.

    Shapes are [layers, batch, kv_heads, max_len, head_dim]. `length` counts the valid
    positions; `rollback(n)` forgets everything after position n (speculative decoding
    uses it to drop rejected draft tokens) without touching memory.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(
        cls, model: Transformer, batch_size: int = 1, max_len: int | None = None
    ) -> KVCache:
        cfg = model.config
        max_len = max_len or cfg.max_seq_len
        if max_len > cfg.max_seq_len:
            raise ValueError(
                f"cache length {max_len} exceeds the model context max_seq_len={cfg.max_seq_len}"
            )
        attn = next(iter(model.held_blocks())).self_attn
        param = next(model.parameters())
        dtype = param.dtype if param.is_floating_point() else torch.float32
        return cls(  # indexed by each block's layer_idx: a stage's blocks keep theirs
            cfg.num_layers,
            batch_size,
            attn.num_kv_heads,
            max_len,
            attn.head_dim,
            device=param.device,
            dtype=dtype,
        )

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write new keys/values at `start` and return views over all valid positions."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: position {end} > cache length {self.max_len}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}; cache holds {self.length} positions")
        self.length = length


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class AttentionCore(nn.Module):
    """softmax(QK^T/sqrt(d) + causal mask) V for grouped-query attention.

    q: [B, H, T, D]; k, v: [B, Hkv, S, D] where the T queries sit at the last T of the S
    positions. Kept separate so selective activation recomputation can wrap exactly it.
    With a sliding `window`, query i sees keys (i - window, i] (HF Mistral's convention).
    """

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, heads, t, d = q.shape
        kv_heads, s = k.shape[1], k.shape[2]
        groups = heads // kv_heads
        windowed = self.window is not None and s > self.window
        if t == s and not windowed:  # plain causal attention (flash/efficient kernels)
            if groups == 1:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if _SDPA_HAS_GQA:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # Cached decode/verify: fold each KV head's query group into the query rows so the
        # cached keys are read once, never copied per query head.
        qf = q.reshape(batch, kv_heads, groups * t, d)
        mask = None
        if t > 1 or windowed:
            query_pos = torch.arange(s - t, s, device=q.device)[:, None]
            key_pos = torch.arange(s, device=q.device)[None, :]
            visible = key_pos <= query_pos
            if windowed:
                visible = visible & (key_pos > query_pos - self.window)
            mask = visible.repeat(groups, 1)
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)
        return out.reshape(batch, heads, t, d)


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
        self.core = AttentionCore(config.sliding_window)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        batch, t, _ = x.shape
        q = self.q_proj(x).view(batch, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.store(self.layer_idx, k, v, start)
        out = self.core(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, t, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.kind = config.mlp
        if self.kind == "swiglu":
            self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache: KVCache | None = None, start: int = 0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Decoder-only LM: tokens [B, T] -> logits [B, T, vocab]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.moe is not None or config.mla is not None:  # planner-only shapes
            raise ConfigError(f"{config.name}: experts/latent attention are planned, not built; "
                              "llmopt's model is dense")  # fmt: skip
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> Transformer:
        """Random init (normal(0, std) weights, zero biases, unit norms), reproducible by seed."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        return self

    def held_blocks(self) -> list[Block]:
        """The blocks this (possibly stage-deleted) model holds, in order."""
        layers = self.layers
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)

    def hidden_states(
        self, tokens: torch.Tensor, cache: KVCache | None = None, seq_len: int | None = None
    ) -> torch.Tensor:
        """Hidden states [B, T, hidden] after the blocks (and the final norm, if held).

        `tokens` are ids [B, T], or hidden states [B, T, hidden] when the embedding was
        deleted (a later pipeline stage). `seq_len`: the full sequence length when the input
        is a sequence shard (sequence parallelism), for the RoPE tables. Advances `cache` by
        T positions.
        """
        if self.embed_tokens is not None and tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if self.embed_tokens is None and tokens.dim() != 3:
            raise ValueError(
                "a model without its embedding takes hidden states [batch, seq, hidden], got "
                f"shape {tuple(tokens.shape)}"
            )
        start = cache.length if cache is not None else 0
        t = tokens.shape[1]
        full = seq_len if seq_len is not None else t
        if start + full > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {start + full} tokens exceeds the model context "
                f"max_seq_len={self.config.max_seq_len}"
            )
        x = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens
        cos, sin = self.rotary(start, full, x.dtype)
        for layer in self.held_blocks():
            x = layer(x, cos, sin, cache, start)
        if cache is not None:
            cache.length = start + t
        return self.norm(x) if self.norm is not None else x

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        last_only: bool = False,
        seq_len: int | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] (or [B, 1, vocab] with last_only); hidden states without a head."""
        h = self.hidden_states(tokens, cache, seq_len)
        if self.lm_head is None:
            return h
        if last_only:
            h = h[:, -1:]
        return self.lm_head(h)


def build_model(
    config: ModelConfig,
    seed: int | None = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """A randomly initialised model (seed=None leaves weights uninitialised for loading)."""
    with torch.device(device):
        model = Transformer(config)
    if seed is not None:
        model.init_weights(seed)
    return model.to(dtype)
