"""Batched model runner over a paged KV cache.

All tokens of one engine step (prefill chunks, single decode tokens, speculative verify runs of
several requests) go through the linear layers as one packed [tokens, hidden] matrix: that is
where batching pays, since decode is bound by reading the weights once per pass. Attention is
computed here over the paged cache, per-token positions and RoPE from the model's own rotary
tables, GQA by folding each KV head's query group into the query rows:
- short runs (decode, verify) of all requests are padded into one masked attention call,
- long prefill chunks get one call each, so a 512-token chunk does not pad the decodes.

Module names come from the model's `ModelSpec`, so quantized or FP8 linears (which replace the
modules, not the names) run unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.models.spec import spec_for

# query runs up to this length are batched into one padded attention call
_SHORT_RUN = 16


@dataclass
class Chunk:
    """Tokens of one sequence to feed at positions start.., and the rows whose logits are
    needed (`logits_from` is an index into `tokens`; None: no logits, a partial prefill)."""

    tokens: list[int]
    start: int
    block_table: list[int]
    logits_from: int | None = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class _Layer:
    """The modules of one block, looked up once by their spec names."""

    def __init__(self, spec, block: nn.Module) -> None:
        qkv = next((g for g in spec.fused if g.name == "qkv"), None)
        if qkv is None or len(qkv.parts) != 3:
            raise ValueError(f"architecture {spec.architecture!r} has no q/k/v fused group")
        prefix = spec.attention + "."
        out = [n for n in spec.row_parallel if n.startswith(prefix)]
        if len(out) != 1:
            raise ValueError(f"architecture {spec.architecture!r}: no single attention output")
        self.attn = spec.block_module(block, spec.attention)
        self.q, self.k, self.v = (spec.block_module(block, n) for n in qkv.parts)
        self.o = spec.block_module(block, out[0])
        self.norm1, self.norm2 = (spec.block_module(block, n) for n in spec.block_norms)
        self.feed_forward = spec.block_module(block, spec.feed_forward)


class PagedRunner:
    """Owns the paged K/V tensors ([layers, blocks * block_size, kv_heads, head_dim]) and runs
    the model on a list of chunks."""

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int) -> None:
        from llmopt.models.features import require_llama_block

        require_llama_block(model.config, "the paged batch runner")
        spec = spec_for(model)
        self.model = model
        self.decoder_layers = [_Layer(spec, b) for b in spec.blocks_of(model)]
        self.embedding = spec.top_module(model, "embedding")
        self.final_norm = spec.top_module(model, "final_norm")
        self.head = spec.top_module(model, "head")
        attn = self.decoder_layers[0].attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim = attn.head_dim
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype if param.is_floating_point() else torch.float32
        self.max_len = model.config.max_seq_len
        self.cos, self.sin = model.rotary(0, self.max_len, self.dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (
            len(self.decoder_layers),
            num_blocks * block_size,
            self.num_kv_heads,
            self.head_dim,
        )
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Flat cache rows of positions [start, end) of a sequence with block table `table`."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> list[torch.Tensor | None]:
        """Logits [rows, vocab] per chunk (rows from `logits_from` to its end), or None."""
        for c in chunks:
            if not c.tokens or c.start + len(c.tokens) > self.max_len:
                raise ValueError(f"chunk at {c.start} of {len(c.tokens)} tokens is out of range")
        dev = self.device
        tokens = torch.tensor([t for c in chunks for t in c.tokens], device=dev)
        positions = torch.cat([torch.arange(c.start, c.start + len(c.tokens)) for c in chunks])
        slots = torch.cat(
            [self.slots(c.block_table, c.start, c.start + len(c.tokens)) for c in chunks]
        )
        slots = slots.to(dev)
        positions = positions.to(dev)
        plan = _AttentionPlan(self, chunks)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        n, hd = tokens.shape[0], self.head_dim
        x = self.embedding(tokens)
        for i, layer in enumerate(self.decoder_layers):
            h = layer.norm1(x)
            q = layer.q(h).view(n, -1, hd)
            k = layer.k(h).view(n, -1, hd)
            v = layer.v(h).view(n, -1, hd)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k_cache[i].index_copy_(0, slots, k)
            self.v_cache[i].index_copy_(0, slots, v)
            attn = plan.attend(q, self.k_cache[i], self.v_cache[i])
            x = x + layer.o(attn)
            x = x + layer.feed_forward(layer.norm2(x))
        rows, offset, spans = [], 0, []
        for c in chunks:
            if c.logits_from is None:
                spans.append(None)
            else:
                spans.append((len(rows), len(c.tokens) - c.logits_from))
                rows.extend(range(offset + c.logits_from, offset + len(c.tokens)))
            offset += len(c.tokens)
        if not rows:
            return [None] * len(chunks)
        picked = x[torch.tensor(rows, device=dev)]
        logits = self.head(self.final_norm(picked)).float()
        return [None if s is None else logits[s[0] : s[0] + s[1]] for s in spans]


class _AttentionPlan:
    """Index tensors for one step's attention, built once and reused by every layer."""

    def __init__(self, runner: PagedRunner, chunks: list[Chunk]) -> None:
        self.heads, self.kv_heads = runner.num_heads, runner.num_kv_heads
        self.groups = self.heads // self.kv_heads
        dev = runner.device
        offsets, off = [], 0
        for c in chunks:
            offsets.append(off)
            off += len(c.tokens)
        self.total = off
        short = [i for i, c in enumerate(chunks) if len(c.tokens) <= _SHORT_RUN]
        self.long = []
        for i, c in enumerate(chunks):
            if len(c.tokens) > _SHORT_RUN:
                end = c.start + len(c.tokens)
                rows = torch.arange(offsets[i], offsets[i] + len(c.tokens), device=dev)
                keys = runner.slots(c.block_table, 0, end).to(dev)
                self.long.append((rows, keys, c.start, len(c.tokens)))
        self.short = None
        if short:
            t_max = max(len(chunks[i].tokens) for i in short)
            s_max = max(chunks[i].start + len(chunks[i].tokens) for i in short)
            q_idx = torch.zeros(len(short), t_max, dtype=torch.long)
            valid = torch.zeros(len(short), t_max, dtype=torch.bool)
            k_idx = torch.zeros(len(short), s_max, dtype=torch.long)
            mask = torch.zeros(len(short), t_max, s_max, dtype=torch.bool)
            key_pos = torch.arange(s_max)
            for b, i in enumerate(short):
                c = chunks[i]
                t, end = len(c.tokens), c.start + len(c.tokens)
                q_idx[b, :t] = torch.arange(offsets[i], offsets[i] + t)
                valid[b, :t] = True
                k_idx[b, :end] = runner.slots(c.block_table, 0, end)
                query_pos = torch.arange(c.start, end)
                mask[b, :t] = key_pos[None, :] <= query_pos[:, None]
                mask[b, t:, 0] = True  # padded query rows attend to one key: no NaN
            g = self.groups
            mask = (
                mask[:, None, None].expand(-1, 1, g, t_max, s_max).reshape(-1, 1, g * t_max, s_max)
            )
            self.short = (q_idx.to(dev), valid.to(dev), k_idx.to(dev), mask.to(dev), t_max)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [tokens, heads, d] -> attention output [tokens, heads * d]."""
        n, _, d = q.shape
        g, kvh = self.groups, self.kv_heads
        out = q.new_empty(n, self.heads * d)
        for rows, keys, start, t in self.long:
            qf = q[rows].view(t, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * t, d)
            k = k_cache[keys].permute(1, 0, 2)[None]
            v = v_cache[keys].permute(1, 0, 2)[None]
            if start == 0:
                o = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1)[None], k, v, is_causal=True, enable_gqa=g > 1
                )
                out[rows] = o[0].transpose(0, 1).reshape(t, -1)
                continue
            qpos = torch.arange(start, start + t, device=q.device)
            kpos = torch.arange(start + t, device=q.device)
            mask = (kpos[None, :] <= qpos[:, None]).repeat(g, 1)
            o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)
            out[rows] = o.view(kvh, g, t, d).permute(2, 0, 1, 3).reshape(t, -1)
        if self.short is not None:
            q_idx, valid, k_idx, mask, t_max = self.short
            b = q_idx.shape[0]
            qs = q[q_idx]  # [B, T, H, d]
            qf = qs.view(b, t_max, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * t_max, d)
            k = k_cache[k_idx].permute(0, 2, 1, 3)  # [B, kvh, S, d]
            v = v_cache[k_idx].permute(0, 2, 1, 3)
            o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)
            o = o.view(b, kvh, g, t_max, d).permute(0, 3, 1, 2, 4).reshape(b, t_max, -1)
            out[q_idx[valid]] = o[valid]
        return out
