"""Round-to-nearest: each group's min/max sets its grid. The baseline the others must beat."""

from __future__ import annotations

import torch

from llmopt.models.packed.quant.format import PackedWeight, pack_weight


@torch.no_grad()
def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool) -> PackedWeight:
    return pack_weight(weight.detach().float(), bits, group_size, sym)
