"""What the engine does with the logits of requests that are not `plain`: the grammar's mask,
log-probabilities, logit bias and penalties, then sampling (vLLM's order: the grammar masks the
model's logits, logprobs are those of the masked logits before bias, penalties and temperature).

Plain requests never come here, so they pay none of this per token.
"""

from __future__ import annotations

import torch

from llmopt.infer.batch.request import Request, StepOutput, TokenLogprobs
from llmopt.infer.sampling import InvalidRequestError, SamplingParams, apply_penalties, next_token

_ROWS_AT_ONCE = 64  # prompt rows turned into log-probabilities per slice (bounds memory)


def check(params: SamplingParams, vocab_size: int) -> None:
    """Refuse (InvalidRequestError) what cannot apply to a model of `vocab_size` ids."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    grammar = params.grammar
    if grammar is not None and grammar.vocab_size != vocab_size:
        raise InvalidRequestError(
            f"the grammar was compiled for {grammar.vocab_size} token ids; the model has "
            f"{vocab_size}"
        )


def start(request: Request, draft: object | None) -> None:
    """Set up a request that is not plain: its grammar's parse state; no speculation."""
    if draft is not None:
        raise InvalidRequestError(
            "speculative decoding does not combine with logprobs, penalties, logit bias, "
            "min_p or a grammar"
        )
    if request.params.grammar is not None:
        request.matcher = request.params.grammar.matcher()


def wants_prompt_rows(request: Request) -> bool:
    """Whether this step needs logits for the prompt's positions (prompt_logprobs)."""
    return request.params.prompt_logprobs is not None and len(request.prompt_logprobs) < len(
        request.prompt
    )


def attach_logprobs(out: StepOutput, request: Request, added: int) -> StepOutput:
    """`out` with the logprobs of its `added` new tokens (and the prompt's, on the first)."""
    n = len(request.output)
    if request.params.logprobs is not None:
        out.logprobs = request.logprobs[n - added : n]
    if request.params.prompt_logprobs is not None and n == added:
        out.prompt_logprobs = request.prompt_logprobs
    return out


def prompt_rows(request: Request, num_tokens: int, rows: torch.Tensor) -> torch.Tensor | None:
    """Record the prompt logprobs a step's `rows` (from request.num_computed on) give; the
    last row for sampling once the chunk reaches the prompt's end, else None (the chunk is
    counted computed)."""
    record_prompt_logprobs(request, request.num_computed, rows)
    if request.num_computed + num_tokens < request.num_tokens:
        request.num_computed += num_tokens
        return None
    return rows[-1:]


def _entry(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    top: list[tuple[int, float]] = []
    if k:
        values, ids = logprobs.topk(k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return float(logprobs[token]), top


def sample(request: Request, row: torch.Tensor) -> int:
    """The next token of `request` from `row`, its [vocab] fp32 logits at the last position;
    records its logprobs and advances its grammar."""
    params = request.params
    matcher = request.matcher
    if matcher is not None:
        row = row.masked_fill(~matcher.allowed().to(row.device), float("-inf"))
    logprobs = row.log_softmax(-1) if params.logprobs is not None else None
    row = apply_penalties(row, params, request.prompt, request.output)
    token = int(next_token(row[None], params, request.generator)[0])
    if logprobs is not None:
        request.logprobs.append(_entry(logprobs, token, params.logprobs))
    if matcher is not None:
        matcher.advance(token)
    return token


def record_prompt_logprobs(request: Request, start: int, rows: torch.Tensor) -> None:
    """`rows[j]`: logits at position start + j; they give the logprob of the prompt token at
    start + j + 1. Positions recorded already (a recomputed request) are skipped; position 0
    has none (None, as in vLLM)."""
    prompt, k = request.prompt, request.params.prompt_logprobs
    out = request.prompt_logprobs
    if not out:
        out.append(None)
    first = len(out) - 1 - start  # the row predicting the next unrecorded position
    last = min(rows.shape[0], len(prompt) - 1 - start)  # rows that predict prompt tokens
    for a in range(max(first, 0), last, _ROWS_AT_ONCE):
        b = min(a + _ROWS_AT_ONCE, last)
        logprobs = rows[a:b].float().log_softmax(-1)
        targets = torch.tensor(prompt[start + a + 1 : start + b + 1], device=rows.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            tops = [[] for _ in chosen]
        out.extend(zip(chosen, tops, strict=True))
