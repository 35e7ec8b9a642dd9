"""A plain PyTorch decoder for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3,
Phi-3) and Gemma 2.

RMSNorm, RoPE (HF "rotate half" layout), grouped-query attention through
`scaled_dot_product_attention`, SwiGLU (or GELU) MLP, tied or untied embeddings, optional
q/k/v biases (Qwen2), optional sliding-window attention (Mistral). The layers live in
`llmopt.models.layers`, Gemma 2's block in `llmopt.models.gemma2`; this module assembles
blocks and the model.

This is the one forward of every path: training, evaluation, calibration, export and serving
run it, and differ only in the attention backend they pass (`llmopt.models.attention`): none
(causal self-attention), a static cache, the serving engine's paged cache, ONNX's past/present
tensors. The backend says where the fed tokens sit and stores keys/values; the model computes
everything else, so each architecture's features hold on every path. Parameter names follow
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

import torch
from torch import nn

from llmopt.models.attention.backend import AttentionBackend
from llmopt.models.attention.static import KVCache, kv_layout
from llmopt.models.config import ModelConfig
from llmopt.models.experts import feed_forward
from llmopt.models.gemma2 import SandwichBlock
from llmopt.models.layers import (
    MLP,
    Attention,
    AttentionCore,
    RMSNorm,
    RotaryEmbedding,
    SoftcappedLinear,
    apply_rope,
    rope_frequencies,
)
from llmopt.models.mla import attention
from llmopt.models.spec import get_spec

__all__ = [  # the layers are re-exported: callers import them from here
    "MLP",
    "Attention",
    "AttentionCore",
    "Block",
    "KVCache",
    "RMSNorm",
    "RotaryEmbedding",
    "Transformer",
    "apply_rope",
    "build_model",
    "rope_frequencies",
]


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention(config, layer_idx)  # grouped-query, or latent (MLA)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = feed_forward(config, layer_idx)  # MLP, or MoE where the config has experts

    def forward(self, x, cos, sin, attn: AttentionBackend | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Decoder-only LM: tokens [B, T] -> logits [B, T, vocab]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        spec = get_spec(config.architecture)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        block = SandwichBlock if spec.block_kind == "sandwich" else Block
        self.layers = nn.ModuleList(block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        h, vocab, cap = config.hidden_size, config.vocab_size, config.final_softcap
        self.lm_head = (
            nn.Linear(h, vocab, bias=False) if cap is None else SoftcappedLinear(h, vocab, cap)
        )
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

    def held_blocks(self) -> list[nn.Module]:
        """The blocks this (possibly stage-deleted) model holds, in order."""
        layers = self.layers
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)

    def kv_layout(self) -> tuple[int, int, int]:
        """(kv heads, key head dim, value head dim) that a cache for this model holds."""
        return kv_layout(self)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        attn: AttentionBackend | None = None,
        seq_len: int | None = None,
        normed: bool = True,
    ) -> torch.Tensor:
        """Hidden states [B, T, hidden] after the blocks (and the final norm, if held).

        `tokens` are ids [B, T], or hidden states [B, T, hidden] when the embedding was
        deleted (a later pipeline stage). `attn`: the attention backend (None: causal
        self-attention over the T tokens). `seq_len`: the full sequence length when the input
        is a sequence shard (sequence parallelism), for the RoPE tables. `normed=False` leaves
        the final norm to the caller (a server normalises only the rows it samples from).
        """
        if self.embed_tokens is not None and tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if self.embed_tokens is None and tokens.dim() != 3:
            raise ValueError(
                "a model without its embedding takes hidden states [batch, seq, hidden], got "
                f"shape {tuple(tokens.shape)}"
            )
        batch, t = tokens.shape[:2]
        full = seq_len if seq_len is not None else t
        positions = 0 if attn is None else attn.positions(batch, full)
        # explicit positions come from a backend that checked them against the context
        if isinstance(positions, int) and positions + full > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {positions + full} tokens exceeds the model context "
                f"max_seq_len={self.config.max_seq_len}"
            )
        if self.embed_tokens is not None:
            x = self.embed_tokens(tokens)
            if get_spec(self.config.architecture).scaled_embedding:  # HF rounds it to x's dtype
                x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        else:
            x = tokens
        if isinstance(positions, int):
            cos, sin = self.rotary(positions, full, x.dtype)
        else:
            cos, sin = self.rotary.at(positions, x.dtype)
        for layer in self.held_blocks():
            x = layer(x, cos, sin, attn)
        if attn is not None:
            attn.finish(t)
        return self.norm(x) if self.norm is not None and normed else x

    def forward(
        self,
        tokens: torch.Tensor,
        attn: AttentionBackend | None = None,
        last_only: bool = False,
        seq_len: int | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] (or [B, 1, vocab] with last_only); hidden states without a head."""
        h = self.hidden_states(tokens, attn, seq_len)
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
