"""Measuring speculative decoding: pass costs apart from the timed run, plain vs speculative.

Predictions need the costs c and v(t) measured separately from the run they predict (timed
inside a run they carry the draft's bookkeeping and the load of that moment), on both clocks:
on a shared machine process CPU time tracks what the work costs on an idle core far better
than wall-clock time. Measured speedups compare decode phases (after each side's prefill),
since that is what the speed model describes; end-to-end figures are reported beside them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from llmopt.infer.drafts import Draft, ModelDraft, SpeculativeConfig
from llmopt.infer.generate import generate
from llmopt.infer.sampling import SamplingParams
from llmopt.infer.speculative.loop import SpeculativeResult, speculative_generate
from llmopt.infer.speculative.predict import PassCosts
from llmopt.infer.speculative.stats import SpeculativeStats
from llmopt.models.llama import KVCache, Transformer

CLOCKS = ("wall", "cpu")


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


@torch.inference_mode()
def time_passes(
    model: torch.nn.Module, context_len: int, sizes: Iterable[int], repeats: int = 5
) -> dict[str, dict[int, float]]:
    """Median wall and CPU seconds of a t-token pass on top of `context_len` cached positions,
    for each t in `sizes`, interleaved so that a change in load hits every size alike.

    The cache is not filled: attention costs the same whatever the cached keys hold.
    """
    sizes = sorted(set(sizes))
    if not sizes or sizes[0] < 1 or repeats < 1:
        raise ValueError(f"need pass sizes >= 1 and repeats >= 1, got {sizes}, {repeats}")
    cache = KVCache.for_model(model, 1, context_len + sizes[-1])
    cache.length = context_len
    device = cache.k.device
    samples: dict[str, dict[int, list[float]]] = {clock: {t: [] for t in sizes} for clock in CLOCKS}
    for _ in range(repeats + 1):  # the first round warms up
        for t in sizes:
            x = torch.zeros((1, t), dtype=torch.long, device=device)
            wall, cpu = _now()
            model(x, cache, last_only=t == 1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples["wall"][t].append(time.perf_counter() - wall)
            samples["cpu"][t].append(time.process_time() - cpu)
            cache.rollback(context_len)
    return {
        clock: {t: statistics.median(v[1:]) for t, v in by_size.items()}
        for clock, by_size in samples.items()
    }


def costs_from_times(
    target_times: dict[str, dict[int, float]],
    draft_times: dict[str, dict[int, float]] | None = None,
) -> dict[str, PassCosts]:
    """`PassCosts` per clock from `time_passes` of the target (1-token pass included) and of a
    model draft (1- and 2-token passes; None: a draft without a model, which costs 0)."""
    costs = {}
    for clock in CLOCKS:
        times = target_times[clock]
        step = times[1]
        c = draft_times[clock][1] / step if draft_times else 0.0
        c2 = draft_times[clock][2] / step if draft_times else 0.0
        costs[clock] = PassCosts(step, {t: s / step for t, s in times.items()}, c, c2)
    return costs


def calibrate_costs(
    target: Transformer, draft: Draft, context_len: int, max_gamma: int, repeats: int = 5
) -> dict[str, PassCosts]:
    """Pass costs per clock: target passes of 1..max_gamma+1 tokens and, for a model draft,
    its 1- and 2-token passes (a draft without a model costs 0: its time is in the run)."""
    times = time_passes(target, context_len, range(1, max_gamma + 2), repeats)
    drafted = None
    if isinstance(draft, ModelDraft):
        drafted = time_passes(draft.model, context_len, (1, 2), repeats)
    return costs_from_times(times, drafted)


def calibrate(
    result: SpeculativeResult,
    target: Transformer,
    repeats: int = 5,
    draft: Draft | None = None,
) -> dict[str, PassCosts]:
    """Calibrate the costs at the run's final context and store them in `result.stats.costs`.

    Without `draft`, c is the one observed in the run (draft time per forward), less exact.
    """
    stats = result.stats
    max_gamma = max(8, stats.gamma, *stats.gammas_used)
    room = max(0, target.config.max_seq_len - max_gamma - 1)  # for the longest pass
    context_len = min(result.context_len, room)
    if draft is not None:
        stats.costs = calibrate_costs(target, draft, context_len, max_gamma, repeats)
        return stats.costs
    times = time_passes(target, context_len, range(1, max_gamma + 2), repeats)
    # the run's draft time is wall-clock: the observed c serves both clocks
    per_forward = stats.draft_time_s / (stats.draft_forwards or max(stats.proposed, 1))
    c = per_forward / times["wall"][1]
    costs = costs_from_times(times)
    stats.costs = {clock: replace(cost, draft=c, draft_2=c) for clock, cost in costs.items()}
    return stats.costs


@dataclass(frozen=True)
class Timing:
    """Tokens produced in one phase and the seconds it took (summable over prompts)."""

    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0

    def __add__(self, other: Timing) -> Timing:
        return Timing(
            self.tokens + other.tokens, self.wall_s + other.wall_s, self.cpu_s + other.cpu_s
        )

    def rate(self, clock: str = "wall") -> float | None:
        """Tokens per second on `clock` ("wall" or "cpu"); None when nothing was timed."""
        if clock not in CLOCKS:
            raise ValueError(f"clock {clock!r} is not one of {CLOCKS}")
        seconds = self.wall_s if clock == "wall" else self.cpu_s
        return self.tokens / seconds if seconds > 0 and self.tokens else None


@dataclass(frozen=True)
class PlainRun:
    """Plain decoding of one prompt: the tokens, the decode phase (every token after the
    first, which comes out of the prefill pass) and the whole call."""

    prompt_ids: tuple[int, ...]
    tokens: list[int]
    decode: Timing
    total: Timing


def measure_plain(
    target: Transformer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    eos_token_id: int | None = None,
) -> PlainRun:
    """Time `generate` on one prompt, per token, on both clocks."""
    stamps: list[tuple[float, float]] = []
    wall, cpu = _now()
    tokens = generate(
        target,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling or SamplingParams(),
        seed=seed,
        eos_token_id=eos_token_id,
        on_token=lambda _: stamps.append(_now()),
    )
    total = Timing(len(tokens), time.perf_counter() - wall, time.process_time() - cpu)
    decode = Timing()
    if stamps:
        (w0, c0), (w1, c1) = stamps[0], stamps[-1]
        decode = Timing(len(tokens) - 1, w1 - w0, c1 - c0)
    return PlainRun(tuple(prompt_ids), tokens, decode, total)


@dataclass
class Comparison:
    """Speculative and plain decoding of the same prompt(s), measured side by side."""

    stats: SpeculativeStats
    plain_decode: Timing
    plain_total: Timing
    identical: bool | None = None  # greedy: same tokens as plain decoding (None: sampling)

    @classmethod
    def pooled(cls, comparisons: Iterable[Comparison]) -> Comparison:
        """One configuration over several prompts: token rates pooled, not averaged."""
        comparisons = list(comparisons)
        if not comparisons:
            raise ValueError("pooled() needs at least one Comparison")
        same = [c.identical for c in comparisons]
        return cls(
            SpeculativeStats.pooled(c.stats for c in comparisons),
            sum((c.plain_decode for c in comparisons), Timing()),
            sum((c.plain_total for c in comparisons), Timing()),
            None if None in same else all(same),
        )

    @property
    def speculative_decode(self) -> Timing:
        st = self.stats
        return Timing(
            st.generated - st.first_tokens,
            st.total_time_s - st.prefill_time_s,
            st.total_cpu_s - st.prefill_cpu_s,
        )

    @property
    def speculative_total(self) -> Timing:
        return Timing(self.stats.generated, self.stats.total_time_s, self.stats.total_cpu_s)

    def speedup(self, clock: str = "wall", end_to_end: bool = False) -> float | None:
        """Speculative over plain token rate (decode phase unless `end_to_end`)."""
        if end_to_end:
            fast, slow = self.speculative_total.rate(clock), self.plain_total.rate(clock)
        else:
            fast, slow = self.speculative_decode.rate(clock), self.plain_decode.rate(clock)
        return fast / slow if fast and slow else None

    def to_dict(self) -> dict[str, Any]:
        out = self.stats.to_dict()
        out.update(
            {
                "plain_time_s": self.plain_total.wall_s,
                "plain_tokens_per_s": self.plain_total.rate("wall"),
                "measured_speedup": self.speedup("wall"),
                "measured_speedup_cpu": self.speedup("cpu"),
                "measured_speedup_end_to_end": self.speedup("wall", end_to_end=True),
            }
        )
        if self.identical is not None:
            out["identical_to_plain"] = self.identical
        return out


def compare_with_plain(
    target: Transformer,
    draft: Draft,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    config: SpeculativeConfig | None = None,
    seed: int | None = None,
    eos_token_id: int | None = None,
    plain: PlainRun | None = None,
) -> tuple[SpeculativeResult, Comparison]:
    """Decode `prompt_ids` speculatively and plainly (same seed) and compare the two.

    `plain`: a `measure_plain` of this prompt to reuse (one plain run for several drafts).
    """
    sampling = sampling or SamplingParams()
    run = {
        "max_new_tokens": max_new_tokens,
        "sampling": sampling,
        "seed": seed,
        "eos_token_id": eos_token_id,
    }
    if plain is None:
        plain = measure_plain(target, prompt_ids, **run)
    elif plain.prompt_ids != tuple(prompt_ids):
        raise ValueError("the plain run given to compare_with_plain is of another prompt")
    result = speculative_generate(target, draft, prompt_ids, config=config, **run)
    identical = result.tokens == plain.tokens if sampling.greedy else None
    return result, Comparison(result.stats, plain.decode, plain.total, identical)
