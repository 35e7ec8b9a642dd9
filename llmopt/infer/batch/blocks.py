"""Block manager for a paged KV cache: fixed-size blocks, reference counts, prefix caching.

A sequence's keys/values live in `block_size`-token blocks listed in its block table, so a
sequence holds exactly ceil(tokens / block_size) blocks and grows one block at a time: nothing
is reserved up front for the maximum context.

Prefix caching: once a block is full, it is registered under a digest of its tokens chained
with the digest of the block before it (so equal tokens at a different position, or after a
different prefix, never match). A new sequence whose prompt starts with registered blocks
takes a reference to them instead of recomputing them. A block whose reference count drops to
zero goes back to the free list but keeps its registration until it is handed out again
(least recently freed first), so a finished request's prompt still serves later hits.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


class OutOfBlocksError(RuntimeError):
    """No free block is left; the scheduler answers by preempting a sequence."""


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Content digest of one full block, chained to the digest of the block before it."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b",".join(str(int(t)).encode() for t in tokens))
    return h.digest()


class BlockManager:
    """Hands out block ids of a pool of `num_blocks` blocks of `block_size` token slots."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_count = [0] * num_blocks
        # free blocks in eviction order (oldest first); registered ones may still be hit
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._digest_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.prefix_hits = 0  # blocks reused through the prefix cache
        self.prefix_queries = 0  # full prompt blocks looked up

    # ---- counts ----
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ----
    def allocate(self) -> int:
        """A fresh block with reference count 1 (evicting the oldest cached free block)."""
        if not self._free:
            raise OutOfBlocksError(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self._free.popitem(last=False)
        digest = self._digest_of.pop(block, None)
        if digest is not None:
            del self._block_of[digest]
        self.ref_count[block] = 1
        return block

    def share(self, block: int) -> None:
        """Take one more reference to `block` (a prefix-cache hit)."""
        if self.ref_count[block] == 0:
            del self._free[block]
        self.ref_count[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; the tail is freed first so it is evicted first."""
        for block in reversed(blocks):
            count = self.ref_count[block]
            if count <= 0:
                raise RuntimeError(f"KV block {block} freed more often than allocated")
            self.ref_count[block] = count - 1
            if count == 1:
                self._free[block] = None

    # ---- prefix caching ----
    def match_prefix(self, tokens: Sequence[int], max_blocks: int) -> tuple[list[int], bytes]:
        """Share the longest run (<= max_blocks) of registered full blocks that `tokens`
        starts with; returns those block ids and the digest of the last one (b"" if none)."""
        digest, hits = b"", []
        if not self.prefix_caching:
            return hits, digest
        bs = self.block_size
        for i in range(min(max_blocks, len(tokens) // bs)):
            self.prefix_queries += 1
            nxt = block_digest(digest, tokens[i * bs : (i + 1) * bs])
            block = self._block_of.get(nxt)
            if block is None:
                break
            self.share(block)
            hits.append(block)
            digest = nxt
        self.prefix_hits += len(hits)
        return hits, digest

    def register(self, block: int, parent: bytes, tokens: Sequence[int]) -> bytes:
        """Record that full `block` holds `tokens` after the prefix with digest `parent`."""
        digest = block_digest(parent, tokens)
        if self.prefix_caching and block not in self._digest_of and digest not in self._block_of:
            self._digest_of[block] = digest
            self._block_of[digest] = block
        return digest

    def check_all_free(self) -> None:
        """Raise unless every block is free (the invariant after all requests are gone)."""
        held = [b for b, c in enumerate(self.ref_count) if c]
        if held or self.num_free != self.num_blocks:
            raise AssertionError(f"KV blocks still referenced: {held[:10]} ({len(held)} total)")
