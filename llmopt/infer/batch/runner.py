"""Model runners: one engine step's tokens in, the wanted rows' logits out.

The engine keeps block allocation and builds the step's metadata (`StepBatch`); a runner only
computes. Two runners serve the same `PagedKVCache`:

- `EagerRunner`: the model's own forward with the `PagedAttention` backend. Every registered
  architecture, any device (CUDA included), any module the model holds (FP8, experts...).
- the fused CPU step (`llmopt.infer.fast`): one C++ call per step over packed weights, chosen
  by `make_runner` when its kernels build and the model's weights are kernel kinds,
- on CUDA, decode steps replayed from CUDA graphs (`llmopt.infer.batch.cuda_graphs`).

All tokens of a step go through the linear layers as one packed matrix: that is where
batching pays, since decode is bound by reading the weights once per pass.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from llmopt.models.attention.paged import PagedAttention, PagedKVCache, StepBatch
from llmopt.models.spec import spec_for

RUNNERS = ("auto", "fused", "eager", "cuda-graph")


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


def make_runner(
    model: nn.Module,
    cache: PagedKVCache,
    runner: str = "auto",
    *,
    threads: int | None = None,
    int8_head: bool = False,
    scratch_block: int | None = None,
) -> tuple[Runner, str | None]:
    """(runner, why the fused step is not used or None). "auto": CUDA graphs on a GPU, the
    fused CPU step when available, else eager. `scratch_block`: a cache block no request
    holds (CUDA graphs pad their batches with it)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r} is not valid; choose one of {', '.join(RUNNERS)}")
    if int8_head and runner in ("eager", "cuda-graph"):
        raise ValueError(f"int8_head applies to the fused runner, not to runner={runner!r}")
    on_gpu = cache.k.device.type == "cuda"
    if runner == "cuda-graph" or (runner == "auto" and on_gpu and not int8_head):
        from llmopt.infer.batch.cuda_graphs import GraphRunner

        if scratch_block is None:
            raise ValueError("the CUDA-graph runner needs a scratch block in the cache")
        return GraphRunner(model, cache, scratch_block=scratch_block), "CUDA graphs"
    if runner == "eager":
        return EagerRunner(model, cache), "eager requested"
    from llmopt.infer.fast import fused_unavailable

    reason = fused_unavailable(model, int8_head)
    if reason is None:
        from llmopt.infer.fast import FusedRunner

        return FusedRunner(model, cache, threads=threads, int8_head=int8_head), None
    if runner == "fused" or int8_head:
        raise ValueError(f"the fused runner was requested but is unavailable: {reason}")
    return EagerRunner(model, cache), reason
