"""Fast batch-1 decoding: fused layout + one C++ call per token (see decoder.py, layout.py)."""

from __future__ import annotations

from torch import nn

from llmopt.infer.fast.decoder import FastDecoder, KernelsUnavailableError, prepare_layout
from llmopt.infer.fast.layout import UnsupportedModelError

__all__ = [
    "FastDecoder",
    "KernelsUnavailableError",
    "UnsupportedModelError",
    "fast_decode_unavailable",
]


def fast_decode_unavailable(model: nn.Module, int8_head: bool = False) -> str | None:
    """None when `model` can use the fast path, else the reason it cannot (one line)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        return "the fast decode kernels run on CPU only"
    try:
        prepare_layout(model, int8_head)
    except (KernelsUnavailableError, UnsupportedModelError) as exc:
        return str(exc)
    return None
