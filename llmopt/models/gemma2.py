"""Gemma 2's block: RMSNorm before and after both attention and the MLP ("sandwich" norms).

The rest of Gemma 2 is configuration of the shared layers (`llmopt.models.layers`): GeGLU,
soft-capped attention scores, `query_pre_attn_scalar`, alternating sliding windows, and in
the model the sqrt(hidden) embedding scale and the soft-capped head. HF stores Gemma's norm
weights as w with the norm multiplying by (1 + w); the loaders add the spec's
`norm_weight_offset` so every RMSNorm here multiplies by its weight, as Llama's does, and
folds (AWQ) and kernels treat the norms alike.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.models.attention.backend import AttentionBackend
from llmopt.models.config import ModelConfig
from llmopt.models.layers import MLP, Attention, RMSNorm


class SandwichBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, eps)  # on the attention branch's output
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(
        self, x: torch.Tensor, cos, sin, attn: AttentionBackend | None = None
    ) -> torch.Tensor:
        out = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        x = x + self.post_attention_layernorm(out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
