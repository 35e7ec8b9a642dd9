"""Autoregressive generation with a preallocated KV cache.

One prefill pass over the prompt, then one single-token pass per new token; the cache is sized
for prompt + max_new_tokens up front, so decoding never reallocates or copies it, and only the
last position's logits are computed.

Two decode paths share this loop: the fast one (`llmopt.infer.fast`: one C++ call per token,
fused layout, batch-1 kernels) whenever its kernels build and the model is supported, else the
eager model. `fast=False` forces eager; `fast=True` fails with the reason instead of falling back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from llmopt.errors import UsageError
from llmopt.infer.sampling import SamplingConfig, logits_to_probs, sample
from llmopt.models.llama import KVCache, Transformer


def check_context(model: Transformer, prompt_len: int, max_new_tokens: int) -> None:
    """Fail early, naming the numbers, when prompt + generation cannot fit the context."""
    ctx = model.config.max_seq_len
    if prompt_len == 0:
        raise UsageError("the prompt is empty; generation needs at least one token")
    if prompt_len >= ctx:
        raise UsageError(
            f"prompt of {prompt_len} tokens is longer than the model context max_seq_len={ctx} "
            "(it must leave room for at least one new token)"
        )
    if prompt_len + max_new_tokens > ctx:
        raise UsageError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the model "
            f"context max_seq_len={ctx}; use max_new_tokens <= {ctx - prompt_len}"
        )


def next_token(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> torch.Tensor:
    """[B, vocab] logits -> [B] token ids (argmax for greedy, no probability tensor built)."""
    if sampling.greedy:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, sampling), generator)


class _EagerStepper:
    """The plain model with a static KVCache, as prefill/step calls."""

    def __init__(self, model: Transformer, max_len: int) -> None:
        self.model = model
        self.cache = KVCache.for_model(model, batch_size=1, max_len=max_len)
        self.device = next(model.parameters()).device

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        tokens = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        return self.model(tokens, self.cache, last_only=True)[0, -1]

    def step(self, token: int) -> torch.Tensor:
        tokens = torch.tensor([[token]], dtype=torch.long, device=self.device)
        return self.model(tokens, self.cache, last_only=True)[0, -1]


def decode_path(model: Transformer, fast: bool | None) -> tuple[str, str | None]:
    """("fast" | "eager", why the fast path is not used or None)."""
    if fast is False:
        return "eager", "eager requested"
    from llmopt.infer.fast import fast_decode_unavailable

    reason = fast_decode_unavailable(model)
    if reason is None:
        return "fast", None
    if fast:
        raise UsageError(f"fast decode requested but unavailable: {reason}")
    return "eager", reason


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),  # noqa: B008 (frozen dataclass)
    seed: int | None = None,
    eos_token_id: int | None = None,
    on_token: Callable[[int], None] | None = None,
    fast: bool | None = None,
    int8_head: bool = False,
    stats: dict[str, Any] | None = None,
) -> list[int]:
    """New token ids after `prompt_ids` (the prompt is not repeated).

    Stops after `max_new_tokens` or right after emitting `eos_token_id` (which is included).
    `on_token(id)` is called as each token is chosen, for streaming. A `seed` makes sampling
    reproducible; greedy decoding ignores it. `fast`: None = fast path when available, True =
    require it, False = eager. `int8_head` (fast path only) reads the output head as per-row
    INT8 codes: 4x fewer bytes than fp32, not exact. A `stats` dict receives the path taken and
    prefill/decode seconds (decode excludes the prefill that yields the first token).
    """
    if max_new_tokens < 0:
        raise UsageError(f"max_new_tokens={max_new_tokens} must be >= 0")
    prompt_ids = [int(t) for t in prompt_ids]
    check_context(model, len(prompt_ids), max_new_tokens)
    vocab = model.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise UsageError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if max_new_tokens == 0:
        return []
    param = next(model.parameters())
    device = param.device
    generator = None
    if seed is not None and not sampling.greedy:
        generator = torch.Generator(device=device).manual_seed(seed)
    path, reason = decode_path(model, fast)
    max_len = len(prompt_ids) + max_new_tokens
    if path == "fast":
        from llmopt.infer.fast import FastDecoder

        stepper: Any = FastDecoder(model, max_len, int8_head=int8_head)
    else:
        stepper = _EagerStepper(model, max_len)
    t0 = time.perf_counter()
    logits = stepper.prefill(prompt_ids)
    t1 = time.perf_counter()
    out: list[int] = []
    while True:
        token_id = int(next_token(logits.view(1, -1), sampling, generator))
        out.append(token_id)
        if on_token is not None:
            on_token(token_id)
        if token_id == eos_token_id or len(out) == max_new_tokens:
            break
        logits = stepper.step(token_id)
    if stats is not None:
        stats.update(
            path=path,
            fallback_reason=reason,
            int8_head=int8_head and path == "fast",
            prefill_tokens=len(prompt_ids),
            prefill_s=t1 - t0,
            decode_tokens=len(out) - 1,
            decode_s=time.perf_counter() - t1,
        )
    return out
