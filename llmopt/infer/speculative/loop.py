"""Speculative generation of one prompt: the serving engine at batch 1 with a proposer.

The draft guesses γ tokens, the target checks them in one pass and the engine keeps the
accepted prefix plus one token of its own (`verify` makes that exact: the greedy
output in greedy mode, the target's distribution when sampling). Rejected guesses' keys and
values sit in cache slots past the committed tokens and are overwritten by the next step.
Drafts keep their own caches in line (see `llmopt.infer.drafts`); p and q both come from
`logits_to_probs`, so temperature, top-k and top-p are applied identically.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from llmopt.errors import UsageError
from llmopt.infer.drafts import Draft, SpeculativeConfig, check_vocabularies
from llmopt.infer.generate import batch_one_engine, check_context
from llmopt.infer.sampling import SamplingParams
from llmopt.infer.speculative.stats import SpeculativeStats

__all__ = ["SpeculativeConfig", "SpeculativeResult", "speculative_generate"]


@dataclass
class SpeculativeResult:
    tokens: list[int]  # new tokens only
    stats: SpeculativeStats
    context_len: int  # committed tokens whose keys/values the target cache holds
    engine: object = None  # the batch-1 engine that ran (its cache, for inspection and tests)
    request: object = None


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    draft: Draft,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    config: SpeculativeConfig | None = None,
    seed: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    fast: bool | None = None,
) -> SpeculativeResult:
    """Generate `max_new_tokens` tokens (fewer if EOS) by draft-and-verify."""
    sampling = sampling or SamplingParams()
    config = config or SpeculativeConfig()
    if not prompt_ids:
        raise UsageError("prompt_ids is empty: speculative decoding needs at least one token")
    if max_new_tokens < 0:
        raise UsageError(f"max_new_tokens={max_new_tokens} must be >= 0")
    vocab = target.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise UsageError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
    total = len(prompt_ids) + max_new_tokens
    if total > target.config.max_seq_len:
        raise UsageError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) = {total} tokens "
            f"exceeds the model context max_seq_len={target.config.max_seq_len}"
        )
    check_vocabularies(target, draft)
    stats = SpeculativeStats(draft=draft.name, gamma=config.gamma, adaptive=config.adaptive)
    if max_new_tokens == 0:
        return SpeculativeResult([], stats, 0)
    check_context(target, len(prompt_ids), max_new_tokens)
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    start_time, start_cpu = time.perf_counter(), time.process_time()
    engine = batch_one_engine(
        target,
        total,
        fast=fast,
        speculative=config,
        prompt_len=len(prompt_ids),
        eos_token_id=eos_token_id,
    )
    params = dataclasses.replace(
        sampling, max_tokens=max_new_tokens, seed=seed, num_speculative=config.gamma, ngram=0
    )
    request = engine.add_request("speculative", prompt_ids, params, draft=draft)
    first = True
    while not request.finished:
        outputs = engine.step()
        if first and any(o.new_tokens for o in outputs):
            first = False
            stats_first = len(request.output)
            prefill = (time.perf_counter() - start_time, time.process_time() - start_cpu)
    stats = request.spec
    stats.first_tokens = stats_first
    stats.prefill_time_s, stats.prefill_cpu_s = prefill
    stats.total_time_s = time.perf_counter() - start_time
    stats.total_cpu_s = time.process_time() - start_cpu
    context = len(prompt_ids) + len(request.output) - 1
    return SpeculativeResult(list(request.output), stats, context, engine, request)
