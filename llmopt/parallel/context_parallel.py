"""Context parallelism: ring attention over the cp group, as an attention backend.

Each of the cp ranks holds 2 of the 2*cp chunks of every sequence, chunk r and chunk
2*cp-1-r (the zig-zag split `llmopt.plan.ring` prices: every rank gets the same share of the
causal triangle), so its T = S/cp tokens sit at known, non-contiguous positions. The model
reads those positions from the backend for RoPE; attention needs every earlier key, so the
ranks pass their K/V blocks round the ring:

    forward:  cp steps; at step j a rank attends its queries to the block it holds (its own,
              then its predecessor's, ...) while sending that block to its successor and
              receiving the next (cp - 1 transfers of one K/V block). Partial results merge
              by their log-sum-exp.
    backward: the blocks go round again with their key/value gradients riding along (cp - 1
              transfers of K/V + dK/dV), and one last hop takes each dK/dV home.

A block's transfer is issued before its attention is computed and waited for after it, so
the pass overlaps the compute (on gloo the CPU does both; on NCCL they run concurrently). The
attention math is the layer's `AttentionCore` rules (scale, sliding window, causal by
position) written out per block, because merging blocks needs each block's log-sum-exp,
which the core does not return; Gemma 2's soft-capped scores are refused. Every transfer is a
point-to-point send/recv on the "cp" group, counted by `llmopt.parallel.comm`.
"""

from __future__ import annotations

import torch

from llmopt.models.attention.core import AttentionCore, visible_keys
from llmopt.parallel.comm import Group


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions [T] of rank `rank`'s tokens: chunks rank and 2*cp-1-rank of 2*cp."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp} (the zig-zag split "
            "of context parallelism); use a multiple"
        )
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def zigzag_shard(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens of sequences x [B, S, ...] (dim 1)."""
    return x[:, zigzag_positions(x.shape[1], cp, rank, x.device)]


def _block(qf, k, v, qpos, kpos, scale, window):
    """One block's attention in fp32: (out [B, Hkv, M, Dv], lse [B, Hkv, M]); fully masked
    rows give lse -inf and out 0."""
    mask = visible_keys(qpos[None], kpos[None], window)[0]  # [M, Tk]
    scores = torch.matmul(qf, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(probs, v), lse


def _merge(out, lse, out_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    a = torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1)
    b = torch.exp(lse_b - new).nan_to_num(0.0).unsqueeze(-1)
    return out * a + out_b * b, new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: RingAttention, scale: float, window):
        batch, heads, t, dk = q.shape
        kv_heads, dv = k.shape[1], v.shape[-1]
        groups = heads // kv_heads
        qf = q.float().reshape(batch, kv_heads, groups * t, dk)
        qpos = ring.local_positions.repeat(groups)
        block = torch.cat([k, v], dim=-1).contiguous()  # travels in the compute dtype
        out = qf.new_zeros(batch, kv_heads, groups * t, dv)
        lse = qf.new_full((batch, kv_heads, groups * t), float("-inf"))
        for step in range(ring.size):
            works, incoming = ring.pass_on(block) if step < ring.size - 1 else ([], None)
            kpos = ring.positions_of(ring.owner(step))
            if bool(visible_keys(qpos[None], kpos[None], window).any()):
                kv = block.float()
                out_b, lse_b = _block(qf, kv[..., :dk], kv[..., dk:], qpos, kpos, scale, window)
                out, lse = _merge(out, lse, out_b, lse_b)
            for work in works:
                work.wait()
            block = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.window = ring, scale, window
        return out.reshape(batch, heads, t, dv).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, window = ctx.ring, ctx.scale, ctx.window
        batch, heads, t, dk = q.shape
        kv_heads, dv = k.shape[1], v.shape[-1]
        groups = heads // kv_heads
        qf = q.float().reshape(batch, kv_heads, groups * t, dk)
        dout = grad.float().reshape(batch, kv_heads, groups * t, dv)
        qpos = ring.local_positions.repeat(groups)
        delta = (dout * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(qf)
        block = torch.cat([k, v], dim=-1).contiguous()  # K/V and their gradients travel in
        dblock = torch.zeros_like(block)  # the compute dtype; each rank adds in fp32
        for step in range(ring.size):
            kpos = ring.positions_of(ring.owner(step))
            mask = visible_keys(qpos[None], kpos[None], window)[0]
            if bool(mask.any()):
                kv = block.float()
                kb, vb = kv[..., :dk], kv[..., dk:]
                scores = torch.matmul(qf, kb.transpose(-1, -2)) * scale
                probs = torch.exp(scores.masked_fill(~mask, float("-inf")) - lse.unsqueeze(-1))
                probs = probs.nan_to_num(0.0)
                dprobs = torch.matmul(dout, vb.transpose(-1, -2))
                dscores = probs * (dprobs - delta)
                dq += torch.matmul(dscores, kb) * scale
                dkb = torch.matmul(dscores.transpose(-1, -2), qf) * scale
                dvb = torch.matmul(probs.transpose(-1, -2), dout)
                dblock = (dblock.float() + torch.cat([dkb, dvb], dim=-1)).to(block.dtype)
            if step < ring.size - 1:
                works, incoming = ring.pass_on(torch.cat([block, dblock], dim=-1))
                for work in works:
                    work.wait()
                block, dblock = incoming.split([block.shape[-1], dblock.shape[-1]], dim=-1)
                block, dblock = block.contiguous(), dblock.contiguous()
        if ring.size > 1:  # the last block's gradient goes home to its owner (our successor)
            works, dblock = ring.pass_on(dblock)
            for work in works:
                work.wait()
        dk_, dv_ = dblock[..., :dk], dblock[..., dk:]
        return (
            dq.reshape(batch, heads, t, dk).to(q.dtype),
            dk_.to(k.dtype),
            dv_.to(v.dtype),
            None,
            None,
            None,
        )


class RingAttention:
    """The attention backend of context parallelism (`llmopt.models.attention.backend`):
    this rank's zig-zag positions for RoPE, ring attention for every layer."""

    def __init__(self, group: Group, seq_len: int, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.size, self.rank = group.size, group.rank
        self.seq_len = seq_len
        self._positions = [
            zigzag_positions(seq_len, self.size, r, device) for r in range(self.size)
        ]

    @property
    def local_positions(self) -> torch.Tensor:
        return self._positions[self.rank]

    def positions_of(self, rank: int) -> torch.Tensor:
        return self._positions[rank]

    def owner(self, step: int) -> int:
        """The cp rank whose K/V block this rank holds at ring step `step`."""
        return (self.rank - step) % self.size

    def pass_on(self, block: torch.Tensor):
        """Send `block` to the successor, receive the predecessor's: (works, incoming)."""
        incoming = torch.empty_like(block)
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        works = self.group.batch_p2p([("send", block, nxt), ("recv", incoming, prev)])
        return works, incoming

    # ---- AttentionBackend ----
    def positions(self, batch: int, t: int) -> torch.Tensor:
        if t != self.local_positions.numel():
            raise ValueError(
                f"context parallelism: {t} tokens on this rank, the split expects "
                f"{self.local_positions.numel()} (sequence {self.seq_len} over cp={self.size})"
            )
        return self.local_positions[None]

    def attend(
        self, core: AttentionCore, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if core.softcap is not None:
            raise ValueError(
                "context parallelism does not support soft-capped attention scores (Gemma 2)"
            )
        scale = core.scale if core.scale is not None else q.shape[-1] ** -0.5
        return _RingAttention.apply(q, k, v, self, scale, core.window)

    def finish(self, t: int) -> None:
        """Nothing to advance: no cache."""
