"""Continuous batching: which requests run in the next step, with how many tokens.

Every step has a token budget (`max_batched_tokens`). Running requests come first, oldest
first: a decoding request takes one token (plus its proposer's guesses when it speculates), a
request still in prefill takes a chunk of its prompt up to the remaining budget (chunked
prefill, so a long prompt never stalls the decodes of others). Then waiting requests are
admitted, oldest first, while the budget, `max_num_seqs` and free KV blocks allow; an admitted
request first takes its cached prefix blocks.

When a running request needs a block and none is free, the youngest running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
(prompt + output so far) later. Recompute costs compute but never leaks or swaps memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llmopt.infer.batch.blocks import BlockManager
from llmopt.infer.batch.request import Request, Status


@dataclass
class Scheduled:
    """`num_tokens` committed tokens from request.num_computed on, then `draft` guesses."""

    request: Request
    num_tokens: int
    draft: list[int]


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int,
        max_batched_tokens: int,
        max_len: int,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        if max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens={max_batched_tokens} must be >= 1")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.max_len = max_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- releasing ----
    def release(self, request: Request) -> None:
        """Drop a finished or aborted request from the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        self.blocks.free(request.blocks)
        request.blocks = []
        request.num_computed = 0
        request.num_registered = 0
        request.last_digest = b""

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free_blocks(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Give `request` blocks for num_tokens positions; False if the pool is too small."""
        need = self.blocks.blocks_for(num_tokens) - len(request.blocks)
        if need > self.blocks.num_free:
            return False
        request.blocks.extend(self.blocks.allocate() for _ in range(need))
        return True

    def trim(self, request: Request) -> None:
        """Free blocks past the computed tokens (held only by rejected speculative guesses)."""
        keep = self.blocks.blocks_for(request.num_computed)
        if len(request.blocks) > keep:
            self.blocks.free(request.blocks[keep:])
            del request.blocks[keep:]

    # ---- one step ----
    def _guesses(self, request: Request, n: int, budget: int, propose) -> list[int]:
        """Proposer guesses to verify after `n` tokens, when they complete the committed ones."""
        if propose is None or n != request.num_tokens - request.num_computed:
            return []
        room = min(
            budget - n,
            request.params.max_tokens - len(request.output) - 1,
            self.max_len - request.num_tokens,
        )
        return propose(request, room) if room > 0 else []

    def schedule(self, propose=None) -> list[Scheduled]:
        """The work of the next step. `propose(request, max_guesses)` returns guesses that a
        request's proposer makes when its step reaches the end of its committed tokens."""
        budget = self.max_batched_tokens
        out: list[Scheduled] = []
        preempted = False
        for request in sorted(self.running, key=lambda r: r.arrival):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed, budget)
            draft = self._guesses(request, n, budget, propose)
            total = request.num_computed + n + len(draft)
            while not self._grow(request, total):
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                continue
            out.append(Scheduled(request, n, draft))
            budget -= n + len(draft)
        if preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not request.blocks:
                tokens = request.tokens
                # a request that wants its prompt's logprobs computes the prompt whole
                limit = (len(tokens) - 1) // self.blocks.block_size
                if request.params.prompt_logprobs is not None:
                    limit = 0
                hits, digest = self.blocks.match_prefix(tokens, limit)
                request.blocks = hits
                request.num_computed = len(hits) * self.blocks.block_size
                request.num_registered = len(hits)
                request.last_digest = digest
            n = min(request.num_tokens - request.num_computed, budget)
            draft = self._guesses(request, n, budget, propose)
            if not self._grow(request, request.num_computed + n + len(draft)):
                self._free_blocks(request)  # keep nothing while waiting for memory
                break
            self.waiting.popleft()
            request.num_prefix_hit_tokens += request.num_computed
            request.status = Status.RUNNING
            self.running.append(request)
            out.append(Scheduled(request, n, draft))
            budget -= n + len(draft)
        return out
