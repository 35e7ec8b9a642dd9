"""Fused CPU forward: all layers of one engine step in one C++ call (see model.py, layout.py).

`FusedModel` runs a step (decode tokens, prefill chunks, verify runs of several sequences)
over the paged KV cache; `FastDecoder` is its batch-1 use.

Contract with the serving engine (`llmopt.infer.batch.runner.make_runner`):
- `fused_unavailable(model, int8_head=False) -> str | None`: None when the fused step can run
  this model, else the reason (one line);
- `FusedRunner(model, cache, threads=None, int8_head=False)` with `name = "fused"` and
  `forward(batch: StepBatch) -> fp32 logits [R, vocab]`, reading and writing the engine's
  `PagedKVCache` (the same tensors the eager `PagedAttention` backend uses).
"""

from __future__ import annotations

from torch import nn

from llmopt.infer.fast.decoder import FastDecoder
from llmopt.infer.fast.layout import UnsupportedModelError
from llmopt.infer.fast.model import FusedModel, FusedRunner, KernelsUnavailableError, compiled

__all__ = [
    "FastDecoder",
    "FusedModel",
    "FusedRunner",
    "KernelsUnavailableError",
    "UnsupportedModelError",
    "fused_unavailable",
    "weight_bytes_for",
]


def fused_unavailable(model: nn.Module, int8_head: bool = False) -> str | None:
    """None when `model` can use the fused kernels, else the reason it cannot (one line)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        return "the fused kernels run on CPU only"
    try:
        compiled(model, int8_head)
    except (KernelsUnavailableError, UnsupportedModelError) as exc:
        return str(exc)
    return None


def weight_bytes_for(model: nn.Module, int8_head: bool = False) -> int:
    """Weight bytes one token reads through the fused kernels (every projection, norms, the
    head, one embedding row), in the layout they read."""
    layout, _ = compiled(model, int8_head)
    return layout.nbytes_per_token()
