"""Sampling parameters and turning logits into next tokens: temperature, top-k, top-p, greedy.

`SamplingParams` is the one sampling-parameter type of every decode path (`generate`, the
serving engine, speculative decoding, the server, lm-eval): it validates everything a client
can send, so the decode loop never meets a bad value. `logits_to_probs` is shared by plain and
speculative decoding: speculative sampling is exact only if draft and target probabilities
are processed by the very same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmopt.errors import LlmoptError


class InvalidRequestError(LlmoptError, ValueError):
    """A request (or sampling value) the engine refuses; the server answers it with a 400."""


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name}={value!r} must be a number")
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name}={value!r} must be a finite number")
    return float(value)


def _integer(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name}={value!r} must be an integer")
    if value < low:
        raise InvalidRequestError(f"{name}={value} must be >= {low}")
    return value


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request decodes.

    temperature=0: greedy. top_k=0 / top_p=1 disable those filters. `max_tokens`: tokens to
    generate at most; `stop`: strings that end the output (cut before them); `ignore_eos`:
    run to max_tokens. `seed` makes sampling reproducible. Speculation per request: `ngram`
    > 0 proposes by prompt lookup (n-grams up to that size), `speculate=False` turns off the
    engine's draft for this request; `num_speculative` guesses per step at most.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    ngram: int = 0
    num_speculative: int = 4
    speculate: bool = True

    def __post_init__(self) -> None:
        temperature = _finite("temperature", self.temperature)
        if not 0.0 <= temperature <= 100.0:
            raise InvalidRequestError(f"temperature={temperature} must be in [0, 100]")
        top_p = _finite("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidRequestError(f"top_p={top_p} must be in (0, 1]")
        _integer("top_k", self.top_k, 0)
        _integer("max_tokens", self.max_tokens, 1)
        if self.seed is not None:
            _integer("seed", self.seed, 0)
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(f"stop={self.stop!r} must be a list of non-empty strings")
        if len(self.stop) > 8:
            raise InvalidRequestError(f"at most 8 stop strings, got {len(self.stop)}")
        _integer("ngram", self.ngram, 0)
        _integer("num_speculative", self.num_speculative, 1)
        for name in ("ignore_eos", "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name}={getattr(self, name)!r} must be true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
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


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Argmax of each row of [R, vocab] logits. On CPU through numpy, whose SIMD argmax is ~9x
    faster than torch's over a 49k vocabulary: at 16-64 streams torch's argmax alone costs
    more than the whole output head."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().contiguous().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def next_token(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """[B, vocab] logits -> [B] token ids (argmax for greedy, no probability tensor built)."""
    if sampling.greedy:
        return torch.tensor(argmax_rows(logits.reshape(-1, logits.shape[-1]))).reshape(
            logits.shape[:-1]
        )
    return sample(logits_to_probs(logits, sampling), generator)
