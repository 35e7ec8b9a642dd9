"""What the engine does with the logits of requests that are not `plain`: the grammar's mask,
log-probabilities, logit bias and penalties, then sampling (vLLM's order: the grammar masks the
model's logits, logprobs are those of the masked logits before bias, penalties and temperature).

Plain requests never come here, so they pay none of this per token.
"""

from __future__ import annotations

import torch

from llmopt.infer.batch.request import Request, TokenLogprobs
from llmopt.infer.sampling import apply_penalties, next_token

_ROWS_AT_ONCE = 64  # prompt rows turned into log-probabilities per slice (bounds memory)


def _entry(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    top: list[tuple[int, float]] = []
    if k:
        values, ids = logprobs.topk(k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return float(logprobs[token]), top


def sample_processed(request: Request, row: torch.Tensor) -> int:
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
