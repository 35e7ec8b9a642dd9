"""Turning logits into next tokens: temperature, top-k, top-p, greedy.

`logits_to_probs` is shared by plain and speculative decoding: speculative sampling is exact
only if draft and target probabilities are processed by the very same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmopt.errors import UsageError


@dataclass(frozen=True)
class SamplingConfig:
    """temperature=0 means greedy; top_k=0 and top_p=1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # NaN passes every comparison: refuse it first
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value):
                raise UsageError(f"{name}={value!r} must be a finite number")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise UsageError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        if self.temperature < 0:
            raise UsageError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise UsageError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities over the vocabulary (last dim) after temperature, top-k and top-p.

    Greedy returns a one-hot distribution on the argmax, so the same code path serves both.
    """
    logits = logits.float()
    if sampling.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `probs` ([..., vocab] -> [...])."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
