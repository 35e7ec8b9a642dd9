"""Per-request state of the batched engine: sampling parameters, tokens, block table.

`SamplingParams` validates everything a client can send (the server turns its ValueError into
a 400), so the engine loop itself never meets a bad value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from llmopt.errors import LlmoptError
from llmopt.infer.sampling import SamplingConfig


class InvalidRequestError(LlmoptError, ValueError):
    """A request the engine refuses (bad sampling value, too long for the context)."""


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name}={value!r} must be a number")
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name}={value!r} must be finite")
    return float(value)


def _integer(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name}={value!r} must be an integer")
    if value < low:
        raise InvalidRequestError(f"{name}={value} must be >= {low}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """temperature=0: greedy. top_k=0 / top_p=1 disable those filters. `ngram` > 0 turns on
    n-gram speculation (prompt lookup) for this request with up to `num_speculative` guesses."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    ngram: int = 0
    num_speculative: int = 4

    def __post_init__(self) -> None:
        _integer("max_tokens", self.max_tokens, 1)
        temperature = _finite("temperature", self.temperature)
        if not 0.0 <= temperature <= 100.0:
            raise InvalidRequestError(f"temperature={temperature} must be in [0, 100]")
        top_p = _finite("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidRequestError(f"top_p={top_p} must be in (0, 1]")
        _integer("top_k", self.top_k, 0)
        if self.seed is not None:
            _integer("seed", self.seed, 0)
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(f"stop={self.stop!r} must be a list of non-empty strings")
        if len(self.stop) > 8:
            raise InvalidRequestError(f"at most 8 stop strings, got {len(self.stop)}")
        _integer("ngram", self.ngram, 0)
        _integer("num_speculative", self.num_speculative, 1)

    @property
    def config(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One sequence: prompt + generated tokens and the KV blocks that hold them.

    `num_computed` counts the leading tokens whose keys/values are in the cache; the next
    step feeds tokens[num_computed:]. Preemption frees the blocks and resets it to zero, so the
    sequence is recomputed (prompt and output so far) when it is scheduled again.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_registered: int = 0  # leading full blocks recorded in the prefix cache
    last_digest: bytes = b""
    finish_reason: str | None = None
    text: str = ""  # detokenized output (for stop strings), cut at a stop string
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    draft: object | None = None
    generator: torch.Generator | None = None
    spec_proposed: int = 0
    spec_accepted: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class StepOutput:
    """What one engine step produced for one request (tokens may be empty on finish/abort)."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
