"""The batched generation engine: scheduler + paged runner + per-request sampling.

`step()` runs one batched forward pass over whatever the scheduler picked and returns the new
tokens of every request that got some. Per request: greedy or seeded sampling (the same
`next_token`/`logits_to_probs` as `llmopt.infer.generate`, so a request alone decodes exactly
as `generate` does), EOS, max_tokens, stop strings, and n-gram speculation (NGramDraft guesses
verified by `verify_greedy`/`verify_sampled`: exact in greedy mode, distribution-exact when
sampling).

Not thread-safe: the server drives it from one thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llmopt.infer.batch.blocks import BlockManager
from llmopt.infer.batch.request import (
    InvalidRequestError,
    Request,
    SamplingParams,
    Status,
    StepOutput,
)
from llmopt.infer.batch.runner import Chunk, PagedRunner
from llmopt.infer.batch.scheduler import Scheduler
from llmopt.infer.drafts import NGramDraft
from llmopt.infer.generate import next_token
from llmopt.infer.sampling import logits_to_probs
from llmopt.infer.speculative import verify_greedy, verify_sampled


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 32
    max_batched_tokens: int = 512
    prefix_caching: bool = True


class Engine:
    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig = EngineConfig(),  # noqa: B008 (frozen dataclass)
        *,
        eos_token_id: int | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.model = model.eval()
        self.config = config
        self.max_len = model.config.max_seq_len
        self.vocab_size = model.config.vocab_size
        self.eos_token_id = eos_token_id
        self.detokenize = detokenize
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.prefix_caching)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=config.max_num_seqs,
            max_batched_tokens=config.max_batched_tokens,
            max_len=self.max_len,
        )
        self.runner = PagedRunner(model, config.num_blocks, config.block_size)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_generated = 0  # tokens emitted
        self.num_fed = 0  # committed tokens computed (prefill + decode, recompute included)

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

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Request:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt]
        self.check(prompt, params)
        request = Request(request_id, prompt, params, arrival=next(self._arrivals))
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.seed() % 2**62)
            request.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        if params.ngram:
            request.draft = NGramDraft(max_n=params.ngram)
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
        self.scheduler.release(request)
        request.status = Status.FINISHED
        self.requests.pop(request.request_id, None)

    # ---- one step ----
    def _propose(self, request: Request, room: int) -> list[int]:
        if request.draft is None:
            return []
        gamma = min(request.params.num_speculative, room)
        guesses = request.draft.propose(request.tokens, gamma, request.params.config, None)
        request.spec_proposed += len(guesses.tokens)
        return guesses.tokens

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
            chunks.append(
                Chunk(tokens, start, r.blocks, item.num_tokens - 1 if done_prompt else None)
            )
        logits = self.runner.forward(chunks)
        self.num_steps += 1
        outputs = []
        for item, rows in zip(work, logits, strict=True):
            r = item.request
            self.num_fed += item.num_tokens
            if rows is None:  # a prefill chunk that does not reach the end yet
                r.num_computed += item.num_tokens
                self._register(r)
                continue
            new = self._accept(r, item.draft, rows)
            r.num_computed += item.num_tokens + len(new) - 1
            outputs.append(self._append(r, new))
        return outputs

    def _accept(self, r: Request, draft: list[int], rows: torch.Tensor) -> list[int]:
        cfg = r.params.config
        if not draft:
            return [int(next_token(rows[-1:], cfg, r.generator)[0])]
        if r.params.greedy:
            kept, token = verify_greedy(rows.argmax(-1).tolist(), draft)
        else:
            kept, token = verify_sampled(logits_to_probs(rows, cfg), None, draft, r.generator)
        r.spec_accepted += kept
        return draft[:kept] + [token]

    def _append(self, r: Request, new: list[int]) -> StepOutput:
        reason = None
        added: list[int] = []
        for token in new:
            r.output.append(token)
            added.append(token)
            self.num_generated += 1
            if token == self.eos_token_id and not r.params.ignore_eos:
                reason = "stop"
            elif r.params.stop and self._hit_stop(r):
                reason = "stop"
            elif len(r.output) >= r.params.max_tokens:
                reason = "length"
            if reason:
                break
        self._register(r)  # before finishing too: a finished prompt still serves later hits
        if reason is None:
            self.scheduler.trim(r)
        else:
            self._finish(r, reason)
        if not r.params.stop and self.detokenize is not None:
            r.text = self.detokenize(r.output)
        return StepOutput(
            r.request_id,
            added,
            r.finished,
            r.finish_reason,
            r.text,
            len(r.prompt),
            len(r.output),
        )

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
