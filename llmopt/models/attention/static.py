"""The preallocated, rollback-able static KV cache: one contiguous cache per batch row.

The attention backend of eager batch-1 and fixed-batch decoding (the reference the serving
engine is checked against, and the drafts' own caches): every row has the same fill level, so
positions are one shared start offset and each query sees the cached prefix plus the causal
part of what it brings.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.models.attention.core import AttentionCore


def kv_layout(model: nn.Module) -> tuple[int, int, int]:
    """(kv heads, key head dim, value head dim) of a model's (or pipeline stage's) attention.

    Read from the first held block's attention module, so tensor parallelism's divided head
    counts and attentions whose value heads differ from their key heads (MLA) size caches right.
    """
    from llmopt.models.spec import spec_for

    spec = spec_for(model)
    _, block = spec.named_blocks(model)[0]
    attn = spec.block_module(block, spec.attention)
    head_dim = attn.head_dim
    return attn.num_kv_heads, head_dim, getattr(attn, "v_head_dim", head_dim)


class KVCache:
    """Preallocated keys/values for every layer, with a rollback-able fill level.

    Shapes are [layers, batch, kv_heads, max_len, head_dim]. `length` counts the valid
    positions; `rollback(n)` forgets everything after position n (speculative decoding
    drops rejected draft tokens) without touching memory.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        v_head_dim: int | None = None,
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len)
        self.k = torch.zeros((*shape, head_dim), device=device, dtype=dtype)
        self.v = torch.zeros((*shape, v_head_dim or head_dim), device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(
        cls, model: nn.Module, batch_size: int = 1, max_len: int | None = None
    ) -> KVCache:
        cfg = model.config
        max_len = max_len or cfg.max_seq_len
        if max_len > cfg.max_seq_len:
            raise ValueError(
                f"cache length {max_len} exceeds the model context max_seq_len={cfg.max_seq_len}"
            )
        kv_heads, k_dim, v_dim = kv_layout(model)
        param = next(model.parameters())
        dtype = param.dtype if param.is_floating_point() else torch.float32
        return cls(  # indexed by each block's layer_idx: a stage's blocks keep theirs
            cfg.num_layers,
            batch_size,
            kv_heads,
            max_len,
            k_dim,
            device=param.device,
            dtype=dtype,
            v_head_dim=v_dim,
        )

    # ---- the AttentionBackend protocol ----
    def positions(self, batch: int, t: int) -> int:
        if batch != self.k.shape[1]:
            raise ValueError(f"batch of {batch} rows fed to a cache of {self.k.shape[1]} rows")
        if self.length + t > self.max_len:
            raise ValueError(
                f"KV cache overflow: position {self.length + t} > cache length {self.max_len}"
            )
        return self.length

    def attend(
        self, core: AttentionCore, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_all, v_all = self.store(layer, k, v, self.length)
        return core(q, k_all, v_all)

    def finish(self, t: int) -> None:
        self.length += t

    # ---- direct use ----
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write new keys/values at `start` and return views over all valid positions."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: position {end} > cache length {self.max_len}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}; cache holds {self.length} positions")
        self.length = length
