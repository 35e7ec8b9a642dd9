"""The GPU seam: decode steps replayed from CUDA graphs, everything else eager.

A decode step of a small model on a GPU is bound by launch overhead: hundreds of small
kernels whose launches cost more than their work. vLLM's answer, followed here: capture the
model's forward for single-token decode batches of a few fixed sizes once, with the paged
attention written as `DecodeAttention` (fixed shapes, no host reads), then replay the graph
each step after copying the step's metadata into its static buffers. Batches are padded up to
the next captured size with rows that write a scratch slot. Prefill chunks, verify runs and
batches larger than the largest capture run the eager `PagedAttention` path.

On CPU the same buffers and function run without a graph (`use_graphs=False`), which is how
the padding and buffer logic is tested on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from llmopt.infer.batch.runner import EagerRunner
from llmopt.models.attention.paged import DecodeAttention, PagedKVCache, StepBatch

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64)


class _Captured:
    """Static buffers of one batch size and the graph (or plain call) over them."""

    def __init__(self, runner: GraphRunner, size: int) -> None:
        dev, width = runner.device, runner.max_blocks
        self.size = size
        self.tokens = torch.zeros(size, dtype=torch.long, device=dev)
        self.slots = torch.full((size,), runner.scratch_slot, dtype=torch.long, device=dev)
        self.positions = torch.zeros(size, dtype=torch.long, device=dev)
        self.tables = torch.full((size, width), runner.scratch_block, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(size, dtype=torch.long, device=dev)
        self.runner = runner
        self.graph = None
        self.logits: torch.Tensor | None = None
        if runner.use_graphs:
            self._capture()

    def run_eager(self) -> torch.Tensor:
        r = self.runner
        attn = DecodeAttention(r.cache, self.slots, self.positions, self.tables, self.seq_lens)
        hidden = r.model.hidden_states(self.tokens[None], attn, normed=False)[0]
        return r.head(r.final_norm(hidden)).float()

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up: allocator and kernel selection before capture
                self.run_eager()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.runner.pool), torch.inference_mode():
            self.logits = self.run_eager()
        self.runner.pool = self.graph.pool()

    def replay(self, batch: StepBatch) -> torch.Tensor:
        n = batch.num_seqs
        self.tokens[:n].copy_(batch.tokens)
        self.slots[:n].copy_(batch.slots)
        self.positions[:n].copy_(batch.positions)
        width = batch.block_tables.shape[1]
        self.tables[:n, :width].copy_(batch.block_tables)
        self.seq_lens[:n].copy_(batch.seq_lens)
        # rows of a smaller earlier batch are reset to the scratch slot
        self.tokens[n:].zero_()
        self.slots[n:].fill_(self.runner.scratch_slot)
        self.positions[n:].zero_()
        self.tables[n:].fill_(self.runner.scratch_block)
        self.seq_lens[n:].fill_(1)
        if self.graph is None:
            with torch.inference_mode():
                return self.run_eager()[:n]
        self.graph.replay()
        return self.logits[:n]


class GraphRunner:
    """Decode batches from captured graphs (CUDA) or the same static buffers (CPU tests)."""

    name = "cuda-graph"

    def __init__(
        self,
        model: nn.Module,
        cache: PagedKVCache,
        *,
        scratch_block: int,
        sizes: Sequence[int] = CAPTURE_SIZES,
        use_graphs: bool | None = None,
    ) -> None:
        """`scratch_block`: a cache block no request ever holds (padded rows write there)."""
        self.model, self.cache = model, cache
        self.eager = EagerRunner(model, cache)
        self.final_norm, self.head = self.eager.final_norm, self.eager.head
        self.device = cache.k.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and cache on a CUDA device")
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * cache.block_size
        self.max_blocks = cache.num_blocks
        self.pool = None
        self.captured = {size: _Captured(self, size) for size in sorted(sizes)}

    def _size_for(self, n: int) -> _Captured | None:
        return next((c for size, c in self.captured.items() if size >= n), None)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        n = batch.num_seqs
        decode_only = batch.tokens.numel() == n == batch.logits_rows.numel()
        captured = self._size_for(n) if decode_only else None
        if captured is None or batch.block_tables.shape[1] > self.max_blocks:
            return self.eager.forward(batch)
        return captured.replay(batch)
