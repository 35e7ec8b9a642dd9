"""Autoregressive generation with a preallocated KV cache.

One prefill pass over the prompt, then one single-token pass per new token; the cache is sized
for prompt + max_new_tokens up front, so decoding never reallocates or copies it, and only the
last position's logits are computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmopt.infer.sampling import SamplingConfig, logits_to_probs, sample
from llmopt.models.llama import KVCache, Transformer


def check_context(model: Transformer, prompt_len: int, max_new_tokens: int) -> None:
    """Fail early, naming the numbers, when prompt + generation cannot fit the context."""
    ctx = model.config.max_seq_len
    if prompt_len == 0:
        raise ValueError("the prompt is empty; generation needs at least one token")
    if prompt_len >= ctx:
        raise ValueError(
            f"prompt of {prompt_len} tokens is longer than the model context max_seq_len={ctx} "
            "(it must leave room for at least one new token)"
        )
    if prompt_len + max_new_tokens > ctx:
        raise ValueError(
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
) -> list[int]:
    """New token ids after `prompt_ids` (the prompt is not repeated).

    Stops after `max_new_tokens` or right after emitting `eos_token_id` (which is included).
    `on_token(id)` is called as each token is chosen, for streaming. A `seed` makes sampling
    reproducible; greedy decoding ignores it.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    prompt_ids = [int(t) for t in prompt_ids]
    check_context(model, len(prompt_ids), max_new_tokens)
    vocab = model.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if max_new_tokens == 0:
        return []
    param = next(model.parameters())
    device = param.device
    generator = None
    if seed is not None and not sampling.greedy:
        generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache.for_model(model, batch_size=1, max_len=len(prompt_ids) + max_new_tokens)
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    logits = model(tokens, cache, last_only=True)[:, -1]
    out: list[int] = []
    while True:
        token = next_token(logits, sampling, generator)
        token_id = int(token)
        out.append(token_id)
        if on_token is not None:
            on_token(token_id)
        if token_id == eos_token_id or len(out) == max_new_tokens:
            return out
        logits = model(token.view(1, 1), cache, last_only=True)[:, -1]
