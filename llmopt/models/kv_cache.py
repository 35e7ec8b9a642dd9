"""The preallocated, rollback-able KV cache that `llmopt.models.llama.Transformer` fills."""

from __future__ import annotations

import torch
from torch import nn


class KVCache:
    """Preallocated keys/values for every layer, with a rollback-able fill level.

    Shapes are [layers, batch, kv_heads, max_len, head_dim]. `length` counts the valid
    positions; `rollback(n)` forgets everything after position n (speculative decoding
    uses it to drop rejected draft tokens) without touching memory.
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
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
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
        attn = next(iter(model.held_blocks())).self_attn
        param = next(model.parameters())
        dtype = param.dtype if param.is_floating_point() else torch.float32
        return cls(  # indexed by each block's layer_idx: a stage's blocks keep theirs
            cfg.num_layers,
            batch_size,
            attn.num_kv_heads,
            max_len,
            attn.head_dim,
            device=param.device,
            dtype=dtype,
        )

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
