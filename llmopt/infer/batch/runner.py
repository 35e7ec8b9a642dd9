"""Model runners: one engine step's tokens in, the wanted rows' logits out.

The engine keeps block allocation and builds the step's metadata (`StepBatch`); a runner only
computes. Two runners serve the same `PagedKVCache`:

- `EagerRunner`: the model's own forward with the `PagedAttention` backend. Every registered
  architecture, any device (CUDA included), any module the model holds (FP8, experts...).
- the fused CPU step (`llmopt.infer.fast`): one C++ call per step over packed weights, chosen
  by `make_runner` when its kernels build and the model's weights are kernel kinds,
- on CUDA, decode steps replayed from CUDA graphs (`llmopt.infer.batch.cuda_graphs`).

The engine picks one (`llmopt.infer.batch.engine.make_runner`).

All tokens of a step go through the linear layers as one packed matrix: that is where
batching pays, since decode is bound by reading the weights once per pass.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from llmopt.models.attention.paged import PagedAttention, PagedKVCache, StepBatch
from llmopt.models.spec import spec_for


class Runner(Protocol):
    name: str

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """fp32 logits [R, vocab] of `batch.logits_rows`, keys/values written to the cache."""


class EagerRunner:
    """The model's forward over the paged cache."""

    name = "eager"

    def __init__(self, model: nn.Module, cache: PagedKVCache) -> None:
        spec = spec_for(model)
        self.model, self.cache = model, cache
        self.final_norm = spec.top_module(model, "final_norm")
        self.head = spec.top_module(model, "head")
        self.device = cache.k.device

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        attn = PagedAttention(self.cache, batch)
        hidden = self.model.hidden_states(batch.tokens[None], attn, normed=False)[0]
        if batch.logits_rows.numel() == 0:
            return hidden.new_zeros(0, self.model.config.vocab_size, dtype=torch.float32)
        # the final norm and the head only on the rows whose logits are wanted
        return self.head(self.final_norm(hidden[batch.logits_rows])).float()
