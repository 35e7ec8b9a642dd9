"""Speculative decoding: a cheap draft guesses γ tokens, the target checks them in one pass.

Exactness:
- greedy: a guess is kept iff it equals the target's argmax at its position, and the token
  after the kept prefix is the target's own argmax, so the output is the target's greedy output.
- sampling: the modified rejection sampling of Leviathan et al. 2023 / Chen et al. 2023 — keep
  guess x with probability min(1, p(x)/q(x)), else draw from norm(max(0, p - q)) and stop; if
  all γ are kept, draw one more token from p. The emitted tokens are distributed exactly as the
  target's, whatever the draft. p and q both come from `logits_to_probs`, so temperature,
  top-k and top-p are applied identically to both.

KV caches: the target cache always holds every committed token except the last; a verify pass
feeds [last, guess_1..guess_γ] and `rollback` drops the rejected guesses. Drafts keep their own
caches in line (see `llmopt.infer.drafts`).

When does it help? Leviathan's model: with per-token acceptance α, draft cost c (one draft
step / one target step) and γ guesses, a round yields (1-α^(γ+1))/(1-α) tokens for γc+1 target
steps. `predicted_speedup` generalises the "+1" to the measured verify cost v(γ) (a γ+1-token
pass is not free on a CPU), which is what makes predictions match measurements.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from llmopt.infer.drafts import DRAFT_SPECS, Draft, check_vocabularies, make_draft
from llmopt.infer.sampling import SamplingConfig, logits_to_probs, sample
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
            raise ValueError(
                f"need 1 <= gamma_min={self.gamma_min} <= gamma={self.gamma} <= "
                f"gamma_max={self.gamma_max}"
            )


# ---------------------------------------------------------------- the speed model


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[tokens emitted per target pass] = (1-α^(γ+1))/(1-α) (Leviathan et al., eq. 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha={alpha} must be in [0, 1]")
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, c: float, verify_cost: float = 1.0) -> float:
    """Speedup over plain decoding: E[tokens per round] / (γ·c + v).

    v=1 is Leviathan's formula (a verify pass costs one decoding step); pass the measured
    cost of a (γ+1)-token pass relative to a 1-token step for an honest prediction.
    """
    if c < 0 or verify_cost <= 0:
        raise ValueError(f"costs must be positive: c={c}, verify_cost={verify_cost}")
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + verify_cost)


def optimal_gamma(
    alpha: float,
    c: float,
    max_gamma: int = 16,
    verify_cost: dict[int, float] | None = None,
) -> int:
    """The γ in [1, max_gamma] that maximises the predicted speedup.

    `verify_cost` maps γ to the measured v(γ); γs it lacks are not considered (None: v=1).
    """
    gammas = [g for g in range(1, max_gamma + 1) if verify_cost is None or g in verify_cost]
    if not gammas:
        raise ValueError(f"verify_cost has no entry for any gamma in [1, {max_gamma}]")
    return max(
        gammas,
        key=lambda g: predicted_speedup(
            alpha, g, c, 1.0 if verify_cost is None else verify_cost[g]
        ),
    )


# ---------------------------------------------------------------- statistics


@dataclass
class SpeculativeStats:
    """Counters and timings of one speculative generation."""

    draft: str = ""
    gamma: int = 0
    adaptive: bool = False
    rounds: int = 0  # target verify passes
    proposing_rounds: int = 0  # rounds in which the draft proposed at least one token
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0  # rounds that stopped at a rejected guess
    generated: int = 0
    draft_forwards: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_time_s: float = 0.0
    total_time_s: float = 0.0
    # CPU seconds of this process (time.process_time): on a shared machine they track what
    # the work would take on an idle one far better than wall-clock time does
    prefill_cpu_s: float = 0.0
    total_cpu_s: float = 0.0
    accept_lengths: Counter = field(default_factory=Counter)  # accepted-per-round histogram
    gammas_used: Counter = field(default_factory=Counter)
    # filled by `calibrate`
    step_time_s: float | None = None  # one 1-token target step at the final context

    @property
    def alpha(self) -> float:
        """Per-guess acceptance probability: MLE under Leviathan's i.i.d. model, where each round
        contributes its accepted guesses and, unless all were kept, one rejection."""
        trials = self.accepted + self.rejections
        return self.accepted / trials if trials else 0.0

    @property
    def acceptance_fraction(self) -> float:
        """Accepted / proposed (guesses after a rejection count as lost)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def mean_gamma(self) -> float:
        """Mean guesses per proposing round."""
        return self.proposed / self.proposing_rounds if self.proposing_rounds else 0.0

    @property
    def draft_cost(self) -> float | None:
        """c: one draft forward / one target step (0 for model-free drafts)."""
        if self.step_time_s is None:
            return None
        if self.draft_forwards == 0:
            return self.draft_time_s / max(self.proposed, 1) / self.step_time_s
        return self.draft_time_s / self.draft_forwards / self.step_time_s

    @property
    def verify_cost(self) -> float | None:
        """v: one verify pass / one 1-token target step."""
        if self.step_time_s is None or not self.rounds:
            return None
        return self.verify_time_s / self.rounds / self.step_time_s

    def predictions(self) -> dict[str, float | int | None]:
        c, v = self.draft_cost, self.verify_cost
        if c is None or v is None or not self.proposing_rounds:
            return {
                "predicted_speedup": None,
                "predicted_speedup_leviathan": None,
                "optimal_gamma": None,
                "optimal_gamma_leviathan": None,
            }
        gamma = max(1, round(self.mean_gamma))
        alpha = self.alpha
        # Rounds where the draft proposed nothing (n-gram miss) are plain steps: mix them in.
        f = self.proposing_rounds / self.rounds
        tokens = f * expected_tokens_per_round(alpha, gamma) + (1 - f)
        steps = f * (gamma * c + v) + (1 - f) * v
        # v(γ) modelled as linear in γ through the measured point: v(γ) = 1 + (v-1)·γ/γ_used
        slope = (v - 1.0) / gamma
        return {
            "predicted_speedup": tokens / steps,
            "predicted_speedup_leviathan": predicted_speedup(alpha, gamma, c),
            "optimal_gamma": optimal_gamma(
                alpha, c, 16, {g: max(1.0 + slope * g, 1e-3) for g in range(1, 17)}
            ),
            "optimal_gamma_leviathan": optimal_gamma(alpha, c, max_gamma=16),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "draft": self.draft,
            "gamma": self.gamma,
            "adaptive_gamma": self.adaptive,
            "generated": self.generated,
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "alpha": self.alpha,
            "acceptance_fraction": self.acceptance_fraction,
            "tokens_per_target_pass": self.tokens_per_pass,
            "mean_gamma": self.mean_gamma,
            "draft_forwards": self.draft_forwards,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "prefill_time_s": self.prefill_time_s,
            "total_time_s": self.total_time_s,
            "prefill_cpu_s": self.prefill_cpu_s,
            "total_cpu_s": self.total_cpu_s,
            "tokens_per_s": self.generated / self.total_time_s if self.total_time_s else None,
            "step_time_s": self.step_time_s,
            "draft_cost_c": self.draft_cost,
            "verify_cost_v": self.verify_cost,
            "accept_length_histogram": {str(k): v for k, v in sorted(self.accept_lengths.items())},
            "gammas_used": {str(k): v for k, v in sorted(self.gammas_used.items())},
            **self.predictions(),
        }


@dataclass
class SpeculativeResult:
    tokens: list[int]  # new tokens only
    stats: SpeculativeStats
    target_cache: KVCache  # holds every committed token but the last (for inspection/tests)


# ---------------------------------------------------------------- verification


def verify_greedy(target_argmax: list[int], guesses: list[int]) -> tuple[int, int]:
    """(number of guesses kept, the token that follows them) for greedy decoding."""
    n = 0
    while n < len(guesses) and guesses[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def verify_sampled(
    p: torch.Tensor,
    q: torch.Tensor | None,
    guesses: list[int],
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Leviathan/Chen rejection sampling: (number of guesses kept, the token that follows).

    p: target probabilities [γ+1, vocab]; q: draft probabilities [γ, vocab], or None when
    the draft is deterministic (q one-hot on each guess).
    """
    k = len(guesses)
    if k:
        idx = torch.tensor(guesses, device=p.device)
        rows = torch.arange(k, device=p.device)
        p_x = p[rows, idx]
        q_x = q[rows, idx] if q is not None else torch.ones_like(p_x)
        u = torch.rand(k, generator=generator, device=p.device)
        rejected = (u * q_x >= p_x).nonzero()  # accept iff u < p(x)/q(x)
        if len(rejected):
            i = int(rejected[0, 0])
            if q is not None:
                residual = (p[i] - q[i]).clamp_(min=0.0)
            else:
                residual = p[i].clone()
                residual[guesses[i]] = 0.0
            total = residual.sum()
            # p == q up to rounding leaves no residual mass; then p itself is the right law
            residual = residual / total if total > 0 else p[i]
            return i, int(sample(residual, generator))
    return k, int(sample(p[k], generator))


# ---------------------------------------------------------------- the decoding loop


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
        raise ValueError("prompt_ids is empty: speculative decoding needs at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    vocab = target.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
    total = len(prompt_ids) + max_new_tokens
    if total > target.config.max_seq_len:
        raise ValueError(
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


@torch.inference_mode()
def measure_step_time(
    target: Transformer, cache: KVCache, tokens: int = 1, repeats: int = 5
) -> float:
    """Median seconds of a `tokens`-token target pass on top of `cache`.

    Writes only past `cache.length` and rolls back after each pass, so committed positions
    are untouched.
    """
    length = cache.length
    if length + tokens > cache.max_len:
        raise ValueError(
            f"cannot time a {tokens}-token pass: cache holds {length} of {cache.max_len} positions"
        )
    device = cache.k.device
    x = torch.zeros((1, tokens), dtype=torch.long, device=device)
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        target(x, cache, last_only=tokens == 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cache.rollback(length)
    times = sorted(times[1:])
    return times[len(times) // 2]


def calibrate(result: SpeculativeResult, target: Transformer, repeats: int = 5) -> None:
    """Time a 1-token target step at the final context: the unit of c, v and the predictions.

    The cache holds all committed tokens but the last, so one free position always remains.
    """
    result.stats.step_time_s = measure_step_time(target, result.target_cache, 1, repeats)


# ---------------------------------------------------------------- CLI glue


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """`--draft/--gamma/--adaptive-gamma/--stats` for `llmopt generate`."""
    group = parser.add_argument_group("speculative decoding")
    group.add_argument(
        "--draft",
        metavar="SPEC",
        default=None,
        help=f"decode speculatively with this draft: {DRAFT_SPECS}",
    )
    group.add_argument(
        "--gamma", type=int, default=4, help="draft tokens verified per target pass (default 4)"
    )
    group.add_argument(
        "--adaptive-gamma",
        action="store_true",
        help="grow gamma after a fully accepted round, shrink it after a rejection",
    )
    group.add_argument(
        "--stats",
        action="store_true",
        help="also run plain decoding and report acceptance, costs, measured and predicted "
        "speedup and the optimal gamma (JSON with --json)",
    )


def run_speculative_from_args(
    args: argparse.Namespace,
    model: Transformer,
    tokenizer,
    prompt_ids: list[int],
    sampling: SamplingConfig,
) -> tuple[list[int], dict[str, Any]]:
    """Run `llmopt generate --draft ...`: (new token ids, statistics dict).

    Reads args.draft, args.gamma, args.adaptive_gamma, args.stats, args.max_new_tokens and,
    when present, args.seed. With --stats the target also decodes plainly (same seed) so the
    speedup is measured, and in greedy mode the two outputs are compared.
    """
    if not args.draft:
        raise ValueError(f"--draft is required for speculative decoding; valid: {DRAFT_SPECS}")
    gamma = args.gamma
    if gamma < 1:
        raise ValueError(f"--gamma {gamma} must be >= 1")
    config = SpeculativeConfig(gamma=gamma, adaptive=args.adaptive_gamma, gamma_max=max(12, gamma))
    draft = make_draft(args.draft, model, tokenizer)
    seed = getattr(args, "seed", None)
    eos = None if getattr(args, "ignore_eos", False) else getattr(tokenizer, "eos_token_id", None)
    result = speculative_generate(
        model,
        draft,
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        config=config,
        seed=seed,
        eos_token_id=eos,
    )
    stats: dict[str, Any] = {}
    if getattr(args, "stats", False):
        calibrate(result, model)
        stats = result.stats.to_dict()
        from llmopt.infer.generate import generate

        t0 = time.perf_counter()
        plain = generate(
            model,
            prompt_ids,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=seed,
            eos_token_id=eos,
        )
        plain_s = time.perf_counter() - t0
        stats["plain_time_s"] = plain_s
        stats["plain_tokens_per_s"] = len(plain) / plain_s if plain_s else None
        spec_rate, plain_rate = stats["tokens_per_s"], stats["plain_tokens_per_s"]
        stats["measured_speedup"] = spec_rate / plain_rate if spec_rate and plain_rate else None
        if sampling.greedy:
            stats["identical_to_plain"] = plain == result.tokens
        stats["sampling"] = {
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
        }
        if not math.isfinite(stats.get("alpha", 0.0)):
            stats["alpha"] = None
    return result.tokens, stats
