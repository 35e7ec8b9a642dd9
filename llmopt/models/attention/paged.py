"""The paged KV cache, one engine step's metadata, and the eager paged attention backend.

A sequence's keys/values live in fixed-size blocks listed in its block table (vLLM's paged
attention), so memory grows one block at a time and blocks can be shared between sequences
(prefix caching). One engine step feeds the tokens of several sequences (prefill chunks,
single decode tokens, speculative verify runs) packed into one row; `StepBatch` says which
token belongs where. The same cache tensors and metadata drive the eager model (through
`PagedAttention`) and the fused CPU step (`llmopt.infer.fast`), so both serve one cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from llmopt.models.attention.core import AttentionCore
from llmopt.models.attention.static import kv_layout

# query runs up to this length are batched into one padded attention call; longer prefill
# chunks get one call each, so a 512-token chunk does not pad the decodes
SHORT_RUN = 16


class PagedKVCache:
    """k [layers, num_blocks * block_size, kv_heads, head_dim] and v alike: a flat slot per
    (block, offset), so one index tensor addresses any set of positions of any sequences."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        v_head_dim: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        slots = num_blocks * block_size
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = torch.zeros(num_layers, slots, num_kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(
            num_layers, slots, num_kv_heads, v_head_dim or head_dim, device=device, dtype=dtype
        )

    @classmethod
    def for_model(cls, model: nn.Module, num_blocks: int, block_size: int) -> PagedKVCache:
        kv_heads, k_dim, v_dim = kv_layout(model)
        param = next(model.parameters())
        dtype = param.dtype if param.is_floating_point() else torch.float32
        return cls(
            model.config.num_layers,
            num_blocks,
            block_size,
            kv_heads,
            k_dim,
            v_head_dim=v_dim,
            device=param.device,
            dtype=dtype,
        )

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass(frozen=True)
class SeqChunk:
    """Tokens of one sequence fed at positions start.., its block table, and the index (into
    `tokens`) from which logits are wanted (None: none, a prefill chunk not at its end)."""

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]
    logits_from: int | None = None


@dataclass
class StepBatch:
    """vLLM-style metadata of one step: N tokens of S sequences, packed sequence by sequence.

    tokens, positions, slots: [N] (slot = block * block_size + offset, where the token's key
    and value are written); query_start [S + 1]: token offsets per sequence; seq_lens [S]:
    keys visible to each sequence's last query (its start + its token count); block_tables
    [S, max_blocks] int32 (padded with 0); logits_rows [R]: rows whose logits are wanted, in
    sequence order (`logits_spans` maps them back: (first row, count) per sequence or None).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_rows: torch.Tensor
    logits_spans: list[tuple[int, int] | None]
    block_size: int

    @classmethod
    def build(
        cls, chunks: Sequence[SeqChunk], block_size: int, device: torch.device | str = "cpu"
    ) -> StepBatch:
        tokens, positions, starts, lens, rows, spans = [], [], [0], [], [], []
        for c in chunks:
            n = len(c.tokens)
            end = c.start + n
            if n == 0 or c.start < 0 or -(-end // block_size) > len(c.block_table):
                raise ValueError(
                    f"chunk of {n} tokens at {c.start} does not fit its {len(c.block_table)} "
                    f"blocks of {block_size}"
                )
            offset = starts[-1]
            tokens.extend(c.tokens)
            positions.extend(range(c.start, end))
            starts.append(offset + n)
            lens.append(end)
            if c.logits_from is None:
                spans.append(None)
            else:
                if not 0 <= c.logits_from < n:
                    raise ValueError(f"logits_from={c.logits_from} outside a chunk of {n} tokens")
                spans.append((len(rows), n - c.logits_from))
                rows.extend(range(offset + c.logits_from, offset + n))
        width = max(len(c.block_table) for c in chunks)
        tables = torch.tensor(
            [[*c.block_table, *[0] * (width - len(c.block_table))] for c in chunks],
            dtype=torch.int32,
        )
        pos = torch.tensor(positions, dtype=torch.long)
        counts = torch.tensor(starts, dtype=torch.long).diff()
        owner = torch.repeat_interleave(torch.arange(len(chunks)), counts)
        slots = tables[owner, pos // block_size].long() * block_size + pos % block_size

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            longs(tokens),
            pos.to(device),
            slots.to(device),
            longs(starts),
            longs(lens),
            tables.to(device),
            longs(rows),
            spans,
            block_size,
        )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()

    def key_slots(self, seq: int) -> torch.Tensor:
        """Cache slots of positions [0, seq_lens[seq]) of sequence `seq`."""
        end = int(self.seq_lens[seq])
        pos = torch.arange(end, device=self.block_tables.device)
        table = self.block_tables[seq].long()
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


class PagedAttention:
    """The attention backend of one engine step over a `PagedKVCache` (eager torch ops, so it
    runs wherever the model's tensors live, CUDA included).

    The model is fed the step's tokens as one row [1, N]. Each layer writes its new keys and
    values at their slots, then attends per sequence: short runs (decodes, verify runs) of all
    sequences in one padded call, long prefill chunks one call each. Index tensors are built
    at the first layer and reused by the others.
    """

    def __init__(self, cache: PagedKVCache, batch: StepBatch) -> None:
        self.cache, self.batch = cache, batch
        self._plan: _Plan | None = None

    def positions(self, batch: int, t: int) -> torch.Tensor:
        if batch != 1 or t != self.batch.tokens.numel():
            raise ValueError(
                f"a paged step feeds its {self.batch.tokens.numel()} tokens as one row, got [{batch}, {t}]"
            )
        return self.batch.positions[None]

    def attend(
        self, core: AttentionCore, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        slots = self.batch.slots
        k_cache.index_copy_(0, slots, k[0].transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v[0].transpose(0, 1).to(v_cache.dtype))
        if self._plan is None:
            self._plan = _Plan(self.batch)
        return self._plan.attend(core, q, k_cache, v_cache)

    def finish(self, t: int) -> None:
        pass


class _Plan:
    """Index tensors of one step's attention, shared by every layer."""

    def __init__(self, batch: StepBatch) -> None:
        dev = batch.tokens.device
        starts = batch.query_start.tolist()
        lens = batch.seq_lens.tolist()
        runs = [(i, starts[i], starts[i + 1] - starts[i], lens[i]) for i in range(len(lens))]
        self.long = []
        for i, first, t, _ in runs:
            if t > SHORT_RUN:
                rows = torch.arange(first, first + t, device=dev)
                self.long.append((rows, batch.key_slots(i)))
        short = [i for i, _, t, _ in runs if t <= SHORT_RUN]
        self.short = None
        if short:  # one padded [sequences, queries] x [sequences, keys] layout, no per-row loop
            ids = torch.tensor(short, device=dev)
            first, ends = batch.query_start[ids], batch.seq_lens[ids]
            counts = batch.query_start[ids + 1] - first
            t_max, s_max = int(counts.max()), int(ends.max())
            q_ar = torch.arange(t_max, device=dev)
            valid = q_ar < counts[:, None]
            q_idx = torch.where(valid, first[:, None] + q_ar, 0)
            # padded query rows sit at position 0 and see key 0 (never NaN); they are dropped
            q_pos = torch.where(valid, (ends - counts)[:, None] + q_ar, 0)
            k_ar = torch.arange(s_max, device=dev)
            bs = batch.block_size
            blocks = batch.block_tables[ids].long().gather(1, (k_ar // bs).expand(len(short), -1))
            k_pos = torch.where(k_ar < ends[:, None], k_ar, -1)
            k_idx = torch.where(k_pos >= 0, blocks * bs + k_ar % bs, 0)
            self.short = (q_idx, q_pos, valid, k_idx, k_pos)

    def attend(self, core: AttentionCore, q, k_cache, v_cache) -> torch.Tensor:
        """q [1, H, N, Dk] -> [1, H, N, Dv] over the cached keys of each query's sequence."""
        heads, n = q.shape[1], q.shape[2]
        out = q.new_zeros(1, heads, n, v_cache.shape[-1])
        for rows, keys in self.long:  # keys 0..end in order: the queries are the last t
            k = k_cache[keys].permute(1, 0, 2)[None]
            v = v_cache[keys].permute(1, 0, 2)[None]
            out[:, :, rows] = core(q[:, :, rows], k.to(q.dtype), v.to(q.dtype))
        if self.short is not None:
            q_idx, q_pos, valid, k_idx, k_pos = self.short
            qs = q[0][:, q_idx].transpose(0, 1)  # [B, H, T, Dk]
            k = k_cache[k_idx].permute(0, 2, 1, 3).to(q.dtype)  # [B, Hkv, S, Dk]
            v = v_cache[k_idx].permute(0, 2, 1, 3).to(q.dtype)
            o = core(qs, k, v, q_pos, k_pos)  # [B, H, T, Dv]
            out[0][:, q_idx[valid]] = o.transpose(0, 1)[:, valid]
        return out


class DecodeAttention:
    """Paged attention for a step of single-token decodes, written without host-side logic.

    Every tensor has a fixed shape (B sequences, W blocks each) and nothing reads a value on
    the host, so a CUDA graph can capture the whole forward once per batch size and replay
    it with new metadata copied into the same buffers (`llmopt.infer.batch.cuda_graphs`).
    Padded rows point at a scratch slot and see only their own key.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        slots: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> None:
        """slots, positions, seq_lens: [B]; block_tables [B, W] (long)."""
        self.cache = cache
        self.slots, self.pos, self.tables, self.seq_lens = slots, positions, block_tables, seq_lens
        width = block_tables.shape[1] * cache.block_size
        key_pos = torch.arange(width, device=slots.device)
        self._key_pos = key_pos
        self._offset = key_pos % cache.block_size
        self._block = key_pos // cache.block_size

    def positions(self, batch: int, t: int) -> torch.Tensor:
        return self.pos[None]

    def attend(
        self, core: AttentionCore, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        k_cache.index_copy_(0, self.slots, k[0].transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(0, self.slots, v[0].transpose(0, 1).to(v_cache.dtype))
        bs = self.cache.block_size
        keys = self.tables[:, self._block] * bs + self._offset  # [B, W * block_size]
        k_pos = torch.where(self._key_pos < self.seq_lens[:, None], self._key_pos, -1)
        kb = k_cache[keys].permute(0, 2, 1, 3).to(q.dtype)  # [B, Hkv, S, Dk]
        vb = v_cache[keys].permute(0, 2, 1, 3).to(q.dtype)
        qb = q[0].permute(1, 0, 2)[:, :, None]  # [B, H, 1, Dk]
        out = core(qb, kb, vb, self.pos[:, None], k_pos)  # [B, H, 1, Dv]
        return out[:, :, 0].permute(1, 0, 2)[None]

    def finish(self, t: int) -> None:
        pass
