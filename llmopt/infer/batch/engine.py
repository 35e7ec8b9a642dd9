"""The decode loop: scheduler + paged KV cache + runner + per-request sampling and speculation.

Every decode path runs here: `generate` is this engine at batch 1, speculative decoding is a
proposer per request, and the server drives it with many requests. `step()` runs one batched
forward pass over whatever the scheduler picked and returns the new tokens of every request
that got some. Per request: greedy or seeded sampling, EOS (one id or several), max_tokens,
stop strings, and speculation — a proposer (prompt lookup, or the engine's draft) guesses the
tokens that follow, the same pass verifies them (`verify_greedy`: exactly the greedy output;
`verify_sampled`: exactly the target's distribution), and adaptive speculation grows or
shrinks each request's number of guesses. Requests that ask for logprobs, prompt logprobs,
penalties, logit bias, min_p or a grammar are sampled by `llmopt.infer.batch.logits` and do
not speculate; plain requests never reach it.

Not thread-safe: the server drives it from one thread.

Over 400 lines: the one step every decode path shares (scheduling, the forward, acceptance,
finishing); what only some requests need lives in `logits` and `speculative.verify`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from llmopt.errors import UsageError
from llmopt.infer.batch import logits as processing
from llmopt.infer.batch.blocks import BlockManager
from llmopt.infer.batch.request import Request, Status, StepOutput
from llmopt.infer.batch.runner import EagerRunner, Runner
from llmopt.infer.batch.scheduler import Scheduler
from llmopt.infer.drafts import Draft, NGramDraft, SpeculativeConfig
from llmopt.infer.sampling import (
    InvalidRequestError,
    SamplingParams,
    argmax_rows,
    logits_to_probs,
    next_token,
)
from llmopt.infer.speculative.stats import SpeculativeStats
from llmopt.infer.speculative.verify import verify_greedy, verify_sampled
from llmopt.models.attention.paged import PagedKVCache, SeqChunk, StepBatch

RUNNERS = ("auto", "fused", "eager", "cuda-graph")


@dataclass(frozen=True)
class EngineConfig:
    """Cache size, batch limits and the runner. `runner`: "auto" (the fused CPU step when its
    kernels build, else eager), "fused" or "eager"; `threads`: the fused step's threads."""

    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 32
    max_batched_tokens: int = 512
    prefix_caching: bool = True
    runner: str = "auto"
    threads: int | None = None
    int8_head: bool = False
    speculative: SpeculativeConfig = SpeculativeConfig()  # noqa: RUF009 (frozen)
    # speculation turns itself off while more requests than this run (0: never): past a
    # few streams a step is compute-bound and a verify pass costs what its tokens cost
    speculative_max_batch: int = 0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name}={value!r} must be an integer >= 1")
        if (
            isinstance(self.speculative_max_batch, bool)
            or not isinstance(self.speculative_max_batch, int)
            or self.speculative_max_batch < 0
        ):
            raise UsageError(
                f"speculative_max_batch={self.speculative_max_batch!r} must be an integer >= 0 "
                "(0: speculation never turns itself off)"
            )
        if self.runner not in RUNNERS:
            raise UsageError(f"runner={self.runner!r} is not valid; choose one of {RUNNERS}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise UsageError(f"threads={self.threads!r} must be an integer >= 1")


class ServingEngine:
    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig = EngineConfig(),  # noqa: B008 (frozen dataclass)
        *,
        eos_token_id: int | Sequence[int] | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        draft: Callable[[], Draft] | None = None,
    ) -> None:
        """`draft`: makes a proposer per request (a draft model's own cache is per request);
        requests with `speculate=True` and no n-gram setting use it."""
        self.model = model.eval()
        self.config = config
        self.max_len = model.config.max_seq_len
        self.vocab_size = model.config.vocab_size
        if eos_token_id is None:
            self.eos_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_ids = frozenset((eos_token_id,))
        else:
            self.eos_ids = frozenset(int(t) for t in eos_token_id)
        self.detokenize = detokenize
        self.draft = draft
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=config.max_num_seqs,
            max_batched_tokens=config.max_batched_tokens,
            max_len=self.max_len,
        )
        # one block past the pool that no request holds: CUDA graphs pad their batches with it
        self.cache = PagedKVCache.for_model(model, config.num_blocks + 1, config.block_size)
        self.runner, self.fused_reason = make_runner(
            model,
            self.cache,
            config.runner,
            threads=config.threads,
            int8_head=config.int8_head,
            scratch_block=config.num_blocks,
        )
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_generated = 0  # tokens emitted
        self.num_fed = 0  # committed tokens computed (prefill + decode, recompute included)
        self.forward_s = 0.0  # wall seconds inside the runner

    # ---- requests ----
    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError when a request can never run (before queueing it)."""
        if not prompt:
            raise InvalidRequestError("the prompt is empty; generation needs at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt) + params.max_tokens > self.max_len:
            raise InvalidRequestError(
                f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} exceeds the "
                f"model context of {self.max_len} tokens"
            )
        need = self.blocks.blocks_for(len(prompt) + params.max_tokens)
        if need > self.blocks.num_blocks:
            raise InvalidRequestError(
                f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} needs {need} "
                f"KV blocks; the cache has {self.blocks.num_blocks}"
            )
        if params.stop and self.detokenize is None:
            raise InvalidRequestError("stop strings need an engine with a tokenizer")
        processing.check(params, self.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        draft: Draft | None = None,
    ) -> Request:
        """Queue a request. `draft`: this request's own proposer (overrides the engine's)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt]
        self.check(prompt, params)
        request = Request(request_id, prompt, params, arrival=next(self._arrivals))
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.seed() % 2**62)
            request.generator = torch.Generator(device=self.cache.k.device).manual_seed(seed)
        if not params.plain:  # logits processed per request: no speculation
            processing.start(request, draft)
        elif draft is None and params.ngram:
            draft = NGramDraft(max_n=params.ngram)
        elif draft is None and params.speculate and self.draft is not None:
            draft = self.draft()
        if draft is not None:
            spec = self.config.speculative
            request.draft = draft
            request.gamma = min(params.num_speculative, spec.gamma_max)
            if spec.adaptive or params.ngram:
                request.gamma = max(request.gamma, spec.gamma_min)
            request.spec = SpeculativeStats(
                draft=draft.name, gamma=request.gamma, adaptive=spec.adaptive
            )
            draft.start(prompt, len(prompt) + params.max_tokens)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is not (or no longer) known."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self._finish(request, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.final_blocks = list(request.blocks)
        self.scheduler.release(request)
        request.status = Status.FINISHED
        self.requests.pop(request.request_id, None)

    # ---- one step ----
    def _propose(self, request: Request, room: int) -> list[int]:
        if request.draft is None:
            return []
        limit = self.config.speculative_max_batch
        if limit and len(self.scheduler.running) > limit:
            request.spec.off_rounds += 1
            return []
        gamma = min(request.gamma, room)
        t0 = time.perf_counter()
        proposal = request.draft.propose(request.tokens, gamma, request.params, request.generator)
        request.spec.draft_time_s += time.perf_counter() - t0
        request.proposal = proposal
        return proposal.tokens[:gamma]

    def step(self) -> list[StepOutput]:
        """One batched forward pass; the new tokens (and finishes) it produced."""
        work = self.scheduler.schedule(self._propose)
        if not work:
            return []
        chunks = []
        for item in work:
            r, start = item.request, item.request.num_computed
            tokens = r.tokens[start : start + item.num_tokens] + item.draft
            done_prompt = start + item.num_tokens == r.num_tokens
            logits_from = item.num_tokens - 1 if done_prompt else None
            if processing.wants_prompt_rows(r):
                logits_from = 0
            chunks.append(SeqChunk(tokens, start, r.blocks, logits_from))
        batch = StepBatch.build(chunks, self.config.block_size, self.cache.k.device)
        t0 = time.perf_counter()
        logits = self.runner.forward(batch)
        elapsed = time.perf_counter() - t0
        self.forward_s += elapsed
        self.num_steps += 1
        # one argmax over every row: per-request argmaxes cost more than the whole 16-row head
        plain = any(i.request.params.greedy and i.request.params.plain for i in work)
        greedy = argmax_rows(logits) if plain else None
        outputs = []
        for item, span in zip(work, batch.logits_spans, strict=True):
            r = item.request
            self.num_fed += item.num_tokens
            if span is None:  # a prefill chunk that does not reach the end yet
                r.num_computed += item.num_tokens
                self._register(r)
                continue
            rows = logits[span[0] : span[0] + span[1]]
            if processing.wants_prompt_rows(r):
                rows = processing.prompt_rows(r, item.num_tokens, rows)
                if rows is None:  # a prefill chunk that does not reach the end yet
                    self._register(r)
                    continue
            plain_greedy = r.params.greedy and r.params.plain
            argmax = greedy[span[0] : span[0] + span[1]] if plain_greedy else None
            new = self._accept(r, item.draft, rows, argmax, elapsed)
            r.num_computed += item.num_tokens + len(new) - 1
            outputs.append(self._append(r, new))
        return outputs

    def _accept(
        self,
        r: Request,
        draft: list[int],
        rows: torch.Tensor,
        argmax: list[int] | None,
        elapsed: float,
    ) -> list[int]:
        """The tokens a request keeps: one sampled (or `argmax`), or verified guesses + one."""
        params = r.params
        if r.spec is None:
            if not params.plain:
                return [processing.sample(r, rows[-1])]
            if argmax is not None:
                return [argmax[-1]]
            return [int(next_token(rows[-1:], params, r.generator)[0])]
        if params.greedy:
            kept, token = verify_greedy(argmax, draft)
        else:
            q = getattr(r, "proposal", None)
            q = q.probs[: len(draft)] if q is not None and q.probs is not None else None
            kept, token = verify_sampled(logits_to_probs(rows, params), q, draft, r.generator)
        stats = r.spec
        stats.rounds += 1
        stats.verify_time_s += elapsed
        if draft:
            stats.proposing_rounds += 1
            stats.proposed += len(draft)
            stats.accepted += kept
            stats.rejections += kept < len(draft)
            stats.accept_lengths[kept] += 1
            stats.gammas_used[len(draft)] += 1
            spec = self.config.speculative
            if spec.adaptive and kept == len(draft) == r.gamma:
                r.gamma = min(r.gamma + 1, spec.gamma_max)
            elif spec.adaptive and kept < len(draft):
                r.gamma = max(r.gamma - 1, spec.gamma_min)
        r.proposal = None
        return draft[:kept] + [token]

    def _append(self, r: Request, new: list[int]) -> StepOutput:
        reason = None
        added: list[int] = []
        for token in new:
            r.output.append(token)
            added.append(token)
            self.num_generated += 1
            if token in self.eos_ids and not r.params.ignore_eos:
                reason = "stop"
            elif r.params.stop and self._hit_stop(r):
                reason = "stop"
            elif r.matcher is not None and r.matcher.finished:
                reason = "stop"  # the grammar is complete: nothing but EOS could follow
            elif len(r.output) >= r.params.max_tokens:
                reason = "length"
            if reason:
                break
        if r.spec is not None:
            r.spec.generated = len(r.output)
            r.spec.draft_forwards = getattr(r.draft, "forward_calls", 0)
        self._register(r)  # before finishing too: a finished prompt still serves later hits
        if reason is None:
            self.scheduler.trim(r)
        else:
            self._finish(r, reason)
        if not r.params.stop and self.detokenize is not None:
            r.text = self.detokenize(r.output)
        out = StepOutput(
            r.request_id,
            added,
            r.finished,
            r.finish_reason,
            r.text,
            len(r.prompt),
            len(r.output),
        )
        return out if r.params.plain else processing.attach_logprobs(out, r, len(added))

    def _hit_stop(self, r: Request) -> bool:
        text = self.detokenize(r.output)
        cut = min((i for i in (text.find(s) for s in r.params.stop) if i >= 0), default=-1)
        r.text = text if cut < 0 else text[:cut]
        return cut >= 0

    def _register(self, r: Request) -> None:
        """Record newly full, computed blocks in the prefix cache."""
        bs = self.blocks.block_size
        tokens = None
        while (r.num_registered + 1) * bs <= r.num_computed:
            tokens = tokens or r.tokens
            i = r.num_registered
            r.last_digest = self.blocks.register(
                r.blocks[i], r.last_digest, tokens[i * bs : (i + 1) * bs]
            )
            r.num_registered += 1

    # ---- convenience ----
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion together; output tokens per prompt, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._arrivals)}-{i}" for i in range(len(prompts))]
        reqs = [self.add_request(i, p, s) for i, p, s in zip(ids, prompts, plist, strict=True)]
        while any(not r.finished for r in reqs):
            self.step()
        return [r.output for r in reqs]

    def cached_kv(self, request: Request, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached keys, values [positions, kv_heads, dim] of a request (a finished one's blocks
        hold them until reused)."""
        table = request.blocks or request.final_blocks
        n = request.num_computed if request.blocks else request.num_tokens - 1
        bs = self.config.block_size
        pos = torch.arange(n)
        slots = torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
        slots = slots.to(self.cache.k.device)
        return self.cache.k[layer][slots], self.cache.v[layer][slots]


def make_runner(
    model: nn.Module,
    cache: PagedKVCache,
    runner: str = "auto",
    *,
    threads: int | None = None,
    int8_head: bool = False,
    scratch_block: int | None = None,
) -> tuple[Runner, str | None]:
    """(runner, why the fused step is not used or None). "auto": CUDA graphs on a GPU, the
    fused CPU step when available, else eager. `scratch_block`: a cache block no request
    holds (CUDA graphs pad their batches with it)."""
    if runner not in RUNNERS:
        raise UsageError(f"runner={runner!r} is not valid; choose one of {', '.join(RUNNERS)}")
    if int8_head and runner in ("eager", "cuda-graph"):
        raise UsageError(f"int8_head applies to the fused runner, not to runner={runner!r}")
    on_gpu = cache.k.device.type == "cuda"
    if runner == "cuda-graph" or (runner == "auto" and on_gpu and not int8_head):
        from llmopt.infer.batch.cuda_graphs import GraphRunner

        if scratch_block is None:
            raise UsageError("the CUDA-graph runner needs a scratch block in the cache")
        return GraphRunner(model, cache, scratch_block=scratch_block), "CUDA graphs"
    if runner == "eager":
        return EagerRunner(model, cache), "eager requested"
    from llmopt.infer.fast import fused_unavailable

    reason = fused_unavailable(model, int8_head)
    if reason is None:
        from llmopt.infer.fast import FusedRunner

        return FusedRunner(model, cache, threads=threads, int8_head=int8_head), None
    if runner == "fused" or int8_head:
        raise UsageError(f"the fused runner was requested but is unavailable: {reason}")
    return EagerRunner(model, cache), reason
