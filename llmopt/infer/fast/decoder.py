"""`FastDecoder`: batch-1 generation through the fused step, over a one-sequence paged cache.

A thin wrapper over `FusedModel`: the prompt goes through the same C++ forward as the decode
steps (one call per `chunk` prompt tokens), then each decoded token is one call. The cache is
paged like the engine's (blocks of `block_size` rows, the block table 0, 1, 2, ...), so this
is the engine's step at batch 1.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from llmopt.errors import UsageError
from llmopt.infer.fast.model import FusedModel


class FastDecoder:
    """Batch-1 decoder over `model` for up to `max_len` positions."""

    def __init__(
        self,
        model: nn.Module,
        max_len: int,
        *,
        int8_head: bool = False,
        threads: int | None = None,
        block_size: int = 16,
        chunk: int = 256,
    ) -> None:
        cfg = model.config
        if not 0 < max_len <= cfg.max_seq_len:
            raise UsageError(f"max_len={max_len} must be in [1, max_seq_len={cfg.max_seq_len}]")
        self.runner = FusedModel(model, threads=threads, int8_head=int8_head)
        self.bytes_per_token = self.runner.bytes_per_token
        self.kinds = self.runner.kinds
        self.max_len = max_len
        self.block_size = block_size
        self.chunk = chunk
        blocks = -(-max_len // block_size)
        shape = self.runner.kv_shape(blocks * block_size)
        self.k_cache = torch.zeros(shape)
        self.v_cache = torch.zeros(shape)
        self.block_table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
        self.length = 0
        # the one-token step's metadata, updated in place
        self._tok = torch.zeros(1, dtype=torch.long)
        self._pos = torch.zeros(1, dtype=torch.long)
        self._len = torch.ones(1, dtype=torch.long)
        self._qs = torch.tensor([0, 1])
        self._last = torch.zeros(1, dtype=torch.long)

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, seq_len: torch.Tensor,
             query_start: torch.Tensor, last: torch.Tensor) -> torch.Tensor:  # fmt: skip
        logits = self.runner.forward_tensors(
            tokens,
            positions,
            positions,  # block table 0, 1, 2, ...: position p lives in row p
            query_start,
            seq_len,
            self.block_table,
            last,
            self.k_cache,
            self.v_cache,
            self.block_size,
        )
        return logits[0]

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits [vocab] after the prompt, its keys/values cached."""
        n = len(prompt_ids)
        if not 0 < n < self.max_len:
            raise UsageError(f"prompt of {n} tokens must be in [1, {self.max_len - 1}]")
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        logits = None
        for start in range(0, n, self.chunk):
            end = min(n, start + self.chunk)
            logits = self._run(
                ids[start:end],
                torch.arange(start, end),
                torch.tensor([end]),
                torch.tensor([0, end - start]),
                torch.tensor([end - start - 1]),
            )
        self.length = n
        return logits

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], n: int) -> tuple[list[int], float]:
        """`n` greedy tokens after the prompt (a fresh cache), and the seconds they took after
        the prefill: plain decoding, the baseline speculative decoding is measured against."""
        logits = self.prefill(prompt_ids)
        t0 = time.perf_counter()
        out: list[int] = []
        while len(out) < n:
            out.append(int(logits.argmax()))
            if len(out) < n:
                logits = self.step(out[-1])
        return out, time.perf_counter() - t0

    def step(self, token: int) -> torch.Tensor:
        """Logits [vocab] after `token` (fp32, a new tensor)."""
        if self.length >= self.max_len:
            raise UsageError(f"decoder cache full: {self.length} of {self.max_len} positions")
        self._tok[0] = int(token)
        self._pos[0] = self.length
        self._len[0] = self.length + 1
        logits = self._run(self._tok, self._pos, self._len, self._qs, self._last)
        self.length += 1
        return logits
