"""AttentionBackend: what one forward's attention reads and writes besides q, k and v.

The model computes projections, q/k norms and RoPE itself, for every architecture, and hands
the new keys/values to a backend (vLLM v1's split): the backend stores them where its cache
lives and calls the layer's `AttentionCore` over the keys each query may see. Backends:

- none (`attn=None`): plain causal self-attention over the T tokens (training, calibration),
- `llmopt.models.attention.static.KVCache`: a preallocated cache per batch row (`generate`'s
  eager reference, drafts),
- `llmopt.models.attention.paged.PagedAttention`: the serving engine's paged cache, many
  sequences packed into one row,
- `llmopt.models.attention.past.PastKeyValues`: ONNX export's past/present tensors,
- ring attention over a context-parallel group (`llmopt.parallel`).

A backend also says where the fed tokens sit (`positions`), since only it knows the cache
fill or the packing; the model turns positions into RoPE angles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from llmopt.models.attention.core import AttentionCore


class AttentionBackend(Protocol):
    def positions(self, batch: int, t: int) -> int | torch.Tensor:
        """The fed tokens' positions: an int (row-shared first position, the rest follow) or
        a LongTensor [B|1, T]."""

    def attend(
        self,
        core: AttentionCore,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """Store this layer's new keys/values (k, v: [B, Hkv, T, D]) if the backend caches,
        then attend: q [B, H, T, Dk] -> [B, H, T, Dv]."""

    def finish(self, t: int) -> None:
        """Called once after the forward over T tokens (a static cache advances its fill)."""
