"""Sliding-window perplexity, the convention of HF transformers' perplexity guide.

Windows of `ctx` tokens start every `stride` tokens. Each window scores only the tokens that
the previous window did not reach, so with stride < ctx every token except the very first is
scored exactly once (N - 1 tokens in all), each with at least `ctx - stride` tokens of context
(the first window's tokens with whatever precedes them). stride == ctx gives disjoint chunks
whose first tokens cannot be scored (no context inside the window) and whose early tokens see
little context; smaller strides trade compute for context.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmopt.errors import UsageError
from llmopt.models.llama import Transformer
from llmopt.models.spec import spec_for


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood, nats per scored token
    tokens_scored: int
    tokens_per_s: float  # scored tokens per second of model time


@dataclass(frozen=True)
class Window:
    begin: int  # first input position
    end: int  # one past the last input position
    score_from: int  # first position whose token is scored (predicted from position - 1)


def windows(n_tokens: int, ctx: int, stride: int) -> Iterator[Window]:
    """The windows over a sequence of `n_tokens` tokens (see the module docstring)."""
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + ctx, n_tokens)
        yield Window(begin, end, max(prev_end, begin + 1))
        prev_end = end
        if end == n_tokens:
            return


def check_window_args(model: Transformer, n_tokens: int, ctx: int, stride: int) -> None:
    max_ctx = model.config.max_seq_len
    if not 2 <= ctx <= max_ctx:
        raise UsageError(f"ctx={ctx} must be in [2, {max_ctx}] (the model's max_seq_len)")
    if not 1 <= stride <= ctx:
        raise UsageError(f"stride={stride} must be in [1, ctx={ctx}]")
    if n_tokens < 2:
        raise UsageError(f"need at least 2 tokens to score, got {n_tokens}")


def window_logprobs(model: Transformer, tokens: torch.Tensor, window: Window) -> torch.Tensor:
    """fp32 log-probabilities [n_scored, vocab] for the scored positions of one window.

    The LM head runs only on the positions that predict scored tokens: for overlapping
    windows that is `stride` of `ctx` rows, the most expensive matmul of a small model.
    """
    device = next(model.parameters()).device
    ids = tokens[window.begin : window.end].to(device).unsqueeze(0)
    h = model.hidden_states(ids)
    first = window.score_from - window.begin - 1
    head = spec_for(model).top_module(model, "head")
    logits = head(h[0, first : window.end - window.begin - 1])
    return F.log_softmax(logits.float(), dim=-1)


def as_token_tensor(token_ids, max_tokens: int | None) -> torch.Tensor:
    tokens = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if max_tokens is not None:
        if max_tokens < 2:
            raise UsageError(f"max_tokens={max_tokens} must be >= 2")
        tokens = tokens[:max_tokens]
    return tokens


@torch.inference_mode()
def perplexity(
    model: Transformer,
    token_ids,
    *,
    ctx: int = 1024,
    stride: int = 512,
    max_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity of `model` on `token_ids` with sliding windows (HF convention).

    `progress(done, total)` is called with scored-token counts after each window.
    """
    tokens = as_token_tensor(token_ids, max_tokens)
    n = tokens.numel()
    check_window_args(model, n, ctx, stride)
    if int(tokens.max()) >= model.config.vocab_size or int(tokens.min()) < 0:
        raise UsageError(f"token ids must be in [0, {model.config.vocab_size})")
    total_nll = 0.0
    scored = 0
    start = time.perf_counter()
    for window in windows(n, ctx, stride):
        logprobs = window_logprobs(model, tokens, window)
        targets = tokens[window.score_from : window.end].to(logprobs.device)
        total_nll -= logprobs.gather(1, targets[:, None]).sum().item()
        scored += targets.numel()
        if progress is not None:
            progress(scored, n - 1)
    seconds = time.perf_counter() - start
    nll = total_nll / scored
    return PerplexityResult(
        ppl=math.exp(nll),
        nll=nll,
        tokens_scored=scored,
        tokens_per_s=scored / seconds if seconds > 0 else float("inf"),
    )
