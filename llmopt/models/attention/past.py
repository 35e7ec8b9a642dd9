"""Past/present key-value tensors: the attention backend of an exported graph (ONNX).

optimum's decoder contract: the graph takes `past_key_values.{i}.key/value` [B, Hkv, P, D]
(P may be 0 for the prefill), `attention_mask` [B, P + T] (0 marks padding) and
`position_ids` [B, T], and returns each layer's present = past + the new keys/values. Nothing
branches on sizes, so one traced graph holds every past length and batch.

Visibility is causal by cache index and excludes padded keys; a padded query still sees
itself, so no row is all-masked (an all-masked row would turn into NaN values that later
layers read through zero probabilities).
"""

from __future__ import annotations

import torch

from llmopt.models.attention.core import AttentionCore


class PastKeyValues:
    def __init__(
        self,
        past: list[torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> None:
        """`past`: key, value, key, value... per layer, each [B, Hkv, P, D]."""
        if len(past) % 2:
            raise ValueError(f"past holds keys and values in pairs, got {len(past)} tensors")
        self.past = past
        self.attention_mask = attention_mask
        self.position_ids = position_ids
        self.presents: list[torch.Tensor] = [past[i] for i in range(len(past))]
        self._allowed: torch.Tensor | None = None

    def positions(self, batch: int, t: int) -> torch.Tensor:
        if self.position_ids is not None:
            return self.position_ids
        past_len = self.past[0].shape[2]
        return (torch.arange(t, device=self.past[0].device) + past_len)[None]

    def attend(
        self, core: AttentionCore, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_all = torch.cat([self.past[2 * layer], k.to(self.past[2 * layer].dtype)], dim=2)
        v_all = torch.cat([self.past[2 * layer + 1], v.to(self.past[2 * layer + 1].dtype)], dim=2)
        self.presents[2 * layer], self.presents[2 * layer + 1] = k_all, v_all
        t, s = q.shape[2], k_all.shape[2]
        key_idx = torch.arange(s, device=q.device)
        query_idx = key_idx[s - t :]
        allowed = None
        if self.attention_mask is not None:
            if self._allowed is None:
                keep = self.attention_mask.bool()[:, None, :]  # [B, 1, S]
                self._allowed = keep | (key_idx[None, None, :] == query_idx[None, :, None])
            allowed = self._allowed
        return core(
            q, k_all.to(q.dtype), v_all.to(q.dtype), query_idx[None], key_idx[None], allowed
        )

    def finish(self, t: int) -> None:
        pass
