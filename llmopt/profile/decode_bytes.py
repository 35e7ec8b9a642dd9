"""Bytes one eager batch-1 decode step reads: the traffic side of a decode roofline.

A batch-1 decode step multiplies one token's activations by every weight, so it reads every
weight once and little else; tokens/s <= read bandwidth (`llmopt.peaks.read_bytes_per_s`) /
these bytes. The one definition benchmarks/decode.py and benchmarks/quant_speed.py report
against (the fused path's own layout is `llmopt.infer.fast.weight_bytes_for`).
"""

from __future__ import annotations

from torch import nn

from llmopt.models.packed.block import BlockQuantEmbedding, BlockQuantLinear
from llmopt.models.packed.quant.linear import QuantLinear
from llmopt.models.packed.sparse.format import SparseLinear

PACKED = (QuantLinear, BlockQuantLinear, BlockQuantEmbedding, SparseLinear)


def eager_decode_bytes(model: nn.Module) -> int:
    """Every parameter once and the buffers of every packed module once (codes, scales,
    zeros/mins, N:M values and indices), so a tied embedding counts once (the head reads it);
    no other buffers (rotary tables are not weights, derived kernel layouts not buffers)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        if isinstance(module, PACKED):
            tensors += list(module.buffers(recurse=False))
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total
