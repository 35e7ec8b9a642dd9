"""The fused CPU step: fused layout + one C++ call per engine step (see decoder.py, layout.py).

Contract with the serving engine (`llmopt.infer.batch.runner.make_runner`):
- `fused_unavailable(model, int8_head=False) -> str | None`: None when the fused step can run
  this model, else the reason (one line);
- `FusedRunner(model, cache, threads=None, int8_head=False)` with `name = "fused"` and
  `forward(batch: StepBatch) -> fp32 logits [R, vocab]`, reading and writing the engine's
  `PagedKVCache` (the same tensors the eager `PagedAttention` backend uses).
"""

from __future__ import annotations

from torch import nn

from llmopt.infer.fast.decoder import FastDecoder, KernelsUnavailableError, prepare_layout
from llmopt.infer.fast.layout import UnsupportedModelError

__all__ = [
    "FastDecoder",
    "KernelsUnavailableError",
    "UnsupportedModelError",
    "fast_decode_unavailable",
    "fused_unavailable",
]


def fast_decode_unavailable(model: nn.Module, int8_head: bool = False) -> str | None:
    """None when `model` can use the batch-1 fast decoder, else the reason it cannot (one line)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        return "the fast decode kernels run on CPU only"
    try:
        prepare_layout(model, int8_head)
    except (KernelsUnavailableError, UnsupportedModelError) as exc:
        return str(exc)
    return None


def fused_unavailable(model: nn.Module, int8_head: bool = False) -> str | None:
    """None when the fused batched step can run `model` over a paged cache, else why not."""
    return "the fused batched step over the paged cache is not built yet"
