"""The draft-and-verify loop: a cheap draft guesses γ tokens, the target checks them in one pass.

KV caches: the target cache always holds every committed token except the last; a verify pass
feeds [last, guess_1..guess_γ] and `rollback` drops the rejected guesses. Drafts keep their own
caches in line (see `llmopt.infer.drafts`). Exactness comes from `speculative_verify`; p and q
both come from `logits_to_probs`, so temperature, top-k and top-p are applied identically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from llmopt.errors import UsageError
from llmopt.infer.drafts import Draft, check_vocabularies
from llmopt.infer.sampling import SamplingConfig, logits_to_probs
from llmopt.infer.speculative_stats import SpeculativeStats
from llmopt.infer.speculative_verify import verify_greedy, verify_sampled
from llmopt.models.llama import KVCache, Transformer


@dataclass(frozen=True)
class SpeculativeConfig:
    """γ (guesses per round); adaptive γ grows by one after a fully accepted round and shrinks
    by one after a rejection, within [gamma_min, gamma_max]."""

    gamma: int = 4
    adaptive: bool = False
    gamma_min: int = 1
    gamma_max: int = 12

    def __post_init__(self) -> None:
        if not 1 <= self.gamma_min <= self.gamma <= self.gamma_max:
            raise UsageError(
                f"need 1 <= gamma_min={self.gamma_min} <= gamma={self.gamma} <= "
                f"gamma_max={self.gamma_max}"
            )


@dataclass
class SpeculativeResult:
    tokens: list[int]  # new tokens only
    stats: SpeculativeStats
    target_cache: KVCache  # holds every committed token but the last (for inspection/tests)


@torch.inference_mode()
def speculative_generate(
    target: Transformer,
    draft: Draft,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    config: SpeculativeConfig | None = None,
    seed: int | None = None,
    eos_token_id: int | None = None,
) -> SpeculativeResult:
    """Generate `max_new_tokens` tokens (fewer if EOS) by draft-and-verify."""
    sampling = sampling or SamplingConfig()
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
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    device = next(target.parameters()).device
    if device.type != "cpu":  # sampling draws on the probabilities' device
        gpu_generator = torch.Generator(device=device)
        gpu_generator.manual_seed(generator.initial_seed())
        generator = gpu_generator

    stats = SpeculativeStats(draft=draft.name, gamma=config.gamma, adaptive=config.adaptive)
    start_time, start_cpu = time.perf_counter(), time.process_time()
    cache = KVCache.for_model(target, 1, total)
    out: list[int] = []
    if max_new_tokens == 0:
        return SpeculativeResult(out, stats, cache)
    if len(prompt_ids) > 1:
        target(torch.tensor([prompt_ids[:-1]], device=device), cache, last_only=True)
    draft.start(prompt_ids, total)
    stats.prefill_time_s = time.perf_counter() - start_time
    stats.prefill_cpu_s = time.process_time() - start_cpu
    gamma = config.gamma
    context = list(prompt_ids)
    while len(out) < max_new_tokens:
        # Never guess past the requested length: the round's extra token would be wasted.
        g = min(gamma, max_new_tokens - len(out) - 1)
        t0 = time.perf_counter()
        proposal = draft.propose(context, g, sampling, generator)
        guesses = proposal.tokens[:g]
        t1 = time.perf_counter()
        x = torch.tensor([[context[-1], *guesses]], device=device)
        logits = target(x, cache)[0]
        if sampling.greedy:
            kept, nxt = verify_greedy(logits.argmax(-1).tolist(), guesses)
        else:
            p = logits_to_probs(logits, sampling)
            q = proposal.probs[: len(guesses)] if proposal.probs is not None else None
            kept, nxt = verify_sampled(p, q, guesses, generator)
        cache.rollback(len(context) + kept)
        stats.verify_time_s += time.perf_counter() - t1
        stats.draft_time_s += t1 - t0
        stats.rounds += 1
        if guesses:
            stats.proposing_rounds += 1
            stats.proposed += len(guesses)
            stats.accepted += kept
            stats.rejections += kept < len(guesses)
            stats.accept_lengths[kept] += 1
            stats.gammas_used[len(guesses)] += 1
        new = [*guesses[:kept], nxt]
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
        out.extend(new)
        context.extend(new)
        if eos_token_id is not None and out[-1] == eos_token_id:
            break
        if config.adaptive and guesses:
            if kept == len(guesses) == g == gamma:
                gamma = min(gamma + 1, config.gamma_max)
            elif kept < len(guesses):
                gamma = max(gamma - 1, config.gamma_min)
    stats.draft_forwards = draft.forward_calls
    stats.generated = len(out)
    stats.total_time_s = time.perf_counter() - start_time
    stats.total_cpu_s = time.process_time() - start_cpu
    return SpeculativeResult(out, stats, cache)
