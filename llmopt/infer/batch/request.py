"""Per-request state of the batched engine: tokens, block table, proposer, counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from llmopt.infer.sampling import SamplingParams
from llmopt.infer.speculative.stats import SpeculativeStats

# a position's log-probability: (logprob of its token, [(token id, logprob)] best first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


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
    draft: object | None = None  # a proposer (llmopt.infer.drafts): n-gram, draft model...
    gamma: int = 0  # guesses to ask for next (adaptive speculation moves it)
    proposal: object | None = None  # the proposer's last guesses (with their probabilities)
    spec: SpeculativeStats | None = None  # acceptance counters when the request speculates
    generator: torch.Generator | None = None
    # the block table at finish (blocks are free again, their contents intact until reused)
    final_blocks: list[int] = field(default_factory=list)
    # what requests with logprobs / prompt_logprobs / a grammar (params.plain False) carry
    matcher: object | None = None  # the grammar's parse state (llmopt.infer.guided)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # [0] is None

    @property
    def spec_proposed(self) -> int:
        return self.spec.proposed if self.spec else 0

    @property
    def spec_accepted(self) -> int:
        return self.spec.accepted if self.spec else 0

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
    """What one engine step produced for one request (tokens may be empty on finish/abort).
    `logprobs`: one entry per new token when the request asked for them; `prompt_logprobs`:
    the prompt's, with the request's first output."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
