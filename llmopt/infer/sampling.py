"""Sampling parameters and turning logits into next tokens: temperature, top-k, top-p, min-p,
greedy, and the penalties and logit bias applied before them.

`SamplingParams` is the one sampling-parameter type of every decode path (`generate`, the
serving engine, speculative decoding, the server, lm-eval): it validates everything a client
can send, so the decode loop never meets a bad value. `logits_to_probs` is shared by plain and
speculative decoding: speculative sampling is exact only if draft and target probabilities
are processed by the very same function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmopt.errors import LlmoptError

MAX_LOGPROBS = 20  # alternatives per position a request may ask for (vLLM's default limit)


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

    As vLLM applies them: `repetition_penalty` (> 1 discourages every token of the prompt and
    output so far), `frequency_penalty` and `presence_penalty` (subtracted per occurrence / once
    for tokens of the output), `logit_bias` ((token id, bias) pairs added to the logits), then
    temperature, `min_p` (drop tokens below min_p x the top probability), top-k, top-p.
    `logprobs`: report each generated token's log-probability with that many alternatives;
    `prompt_logprobs`: the same for the prompt's tokens (the prompt is then computed whole, not
    read from the prefix cache). `grammar`: constrained decoding (`llmopt.infer.guided`).
    Requests that use any of these do not speculate (`plain` is False).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: object | None = None  # a compiled llmopt.infer.guided.Grammar

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _finite(name, getattr(self, name)) <= 2.0:
                raise InvalidRequestError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if not 0.0 < _finite("repetition_penalty", self.repetition_penalty) <= 2.0:
            raise InvalidRequestError(
                f"repetition_penalty={self.repetition_penalty} must be in (0, 2]"
            )
        if not 0.0 <= _finite("min_p", self.min_p) <= 1.0:
            raise InvalidRequestError(f"min_p={self.min_p} must be in [0, 1]")
        if isinstance(self.logit_bias, (str, dict)):
            raise InvalidRequestError("logit_bias must be (token id, bias) pairs")
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidRequestError(f"logit_bias entry {pair!r} must be (token id, bias)")
            _integer("logit_bias token id", pair[0], 0)
            if not -100.0 <= _finite(f"logit_bias[{pair[0]}]", pair[1]) <= 100.0:
                raise InvalidRequestError(f"logit_bias[{pair[0]}]={pair[1]} must be in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and _integer(name, value, 0) > MAX_LOGPROBS:
                raise InvalidRequestError(f"{name}={value} must be in [0, {MAX_LOGPROBS}]")
        if self.grammar is not None and not callable(getattr(self.grammar, "matcher", None)):
            raise InvalidRequestError(f"grammar={self.grammar!r} is not a compiled Grammar")
        plain = (
            self.grammar is None
            and self.logprobs is None
            and self.prompt_logprobs is None
            and not self.logit_bias
            and self.min_p == 0.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.repetition_penalty == 1.0
        )
        object.__setattr__(self, "_plain", plain)  # read per token by the engine: computed once

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """True when sampling needs nothing but temperature/top-k/top-p (no penalty, bias,
        min-p, logprobs or grammar): such requests cost no per-token work beyond sampling and
        may speculate."""
        return self._plain


def logits_to_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Probabilities over the vocabulary (last dim) after temperature, min-p, top-k and top-p.

    Greedy returns a one-hot distribution on the argmax, so the same code path serves both.
    """
    logits = logits.float()
    if sampling.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / sampling.temperature
    if sampling.min_p > 0.0:
        probs = logits.softmax(-1)
        floor = sampling.min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
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


def apply_penalties(
    logits: torch.Tensor,
    sampling: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
) -> torch.Tensor:
    """[vocab] logits after logit bias and the repetition, frequency and presence penalties
    (vLLM's definitions: repetition over prompt + output, the other two over the output)."""
    vocab, device = logits.shape[-1], logits.device
    if sampling.logit_bias:
        ids, bias = zip(*sampling.logit_bias, strict=True)
        values = torch.tensor(bias, dtype=logits.dtype, device=device)
        logits = logits.index_add(-1, torch.tensor(ids, device=device), values)
    if sampling.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor([*prompt, *output], dtype=torch.long, device=device)] = True
        rp = sampling.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if output and (sampling.frequency_penalty or sampling.presence_penalty):
        out = torch.tensor(output, dtype=torch.long, device=device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        logits = logits - sampling.frequency_penalty * counts
        logits = logits - sampling.presence_penalty * (counts > 0).to(logits.dtype)
    return logits
