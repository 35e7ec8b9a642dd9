"""Counters and timings of speculative generation, and the predictions they feed.

Acceptance is summarised the way the speed model (`predict`) consumes it: α is
the per-guess acceptance under Leviathan's i.i.d. model, and the fraction of rounds in which
the draft proposed anything is kept apart (a prompt-lookup miss is a plain step).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from llmopt.infer.speculative.predict import PassCosts, optimal_gamma, predicted_speedup

_SUMMED = (
    "rounds",
    "proposing_rounds",
    "proposed",
    "accepted",
    "rejections",
    "generated",
    "first_tokens",
    "draft_forwards",
    "draft_time_s",
    "verify_time_s",
    "prefill_time_s",
    "total_time_s",
    "prefill_cpu_s",
    "total_cpu_s",
)
_NO_PREDICTION: dict[str, float | int | None] = dict.fromkeys(
    ("predicted_speedup", "predicted_speedup_leviathan", "optimal_gamma", "optimal_gamma_leviathan")
)


@dataclass
class SpeculativeStats:
    """Counters and timings of one speculative generation (or several, `pooled`)."""

    draft: str = ""
    gamma: int = 0
    adaptive: bool = False
    rounds: int = 0  # target verify passes
    proposing_rounds: int = 0  # rounds in which the draft proposed at least one token
    off_rounds: int = 0  # rounds the engine ran without asking the draft (batch too large)
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0  # rounds that stopped at a rejected guess
    generated: int = 0
    first_tokens: int = 0  # tokens out of the step that also prefilled the prompt
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
    # filled by `measure.calibrate`: pass costs per clock ("wall", "cpu")
    costs: dict[str, PassCosts] | None = None

    @classmethod
    def pooled(cls, runs: Iterable[SpeculativeStats]) -> SpeculativeStats:
        """Counters and times summed over runs of one configuration (e.g. several prompts);
        name, γ and costs come from the first."""
        runs = list(runs)
        if not runs:
            raise ValueError("pooled() needs at least one SpeculativeStats")
        first = runs[0]
        out = cls(draft=first.draft, gamma=first.gamma, adaptive=first.adaptive)
        out.costs = first.costs
        for run in runs:
            for name in _SUMMED:
                setattr(out, name, getattr(out, name) + getattr(run, name))
            out.accept_lengths.update(run.accept_lengths)
            out.gammas_used.update(run.gammas_used)
        return out

    @property
    def step_time_s(self) -> float | None:
        """One 1-token target step (wall clock), once calibrated."""
        return self.costs["wall"].step_s if self.costs else None

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
    def proposal_rate(self) -> float:
        """Fraction of rounds in which the draft proposed at least one token."""
        return self.proposing_rounds / self.rounds if self.rounds else 0.0

    @property
    def draft_cost(self) -> float | None:
        """c as observed in the run: one draft forward / one target step (0 without a model)."""
        step = self.step_time_s
        if step is None:
            return None
        if self.draft_forwards == 0:
            return self.draft_time_s / max(self.proposed, 1) / step
        return self.draft_time_s / self.draft_forwards / step

    @property
    def verify_cost(self) -> float | None:
        """v as observed in the run: one verify pass / one 1-token target step."""
        step = self.step_time_s
        if step is None or not self.rounds:
            return None
        return self.verify_time_s / self.rounds / step

    def predict(self, costs: PassCosts) -> dict[str, float | int | None]:
        """Predicted speedup and optimal γ from this run's acceptance and calibrated costs,
        with Leviathan's published formula (verify = one step) beside them."""
        if not self.proposing_rounds:
            return dict(_NO_PREDICTION)
        gamma, alpha, f = max(1, round(self.mean_gamma)), self.alpha, self.proposal_rate
        return {
            "predicted_speedup": costs.predict(alpha, gamma, f),
            "predicted_speedup_leviathan": predicted_speedup(alpha, gamma, costs.draft),
            "optimal_gamma": costs.optimal_gamma(alpha, f),
            "optimal_gamma_leviathan": optimal_gamma(alpha, costs.draft, max_gamma=16),
        }

    def predictions(self) -> dict[str, float | int | None]:
        """`predict` on the calibrated wall-clock costs, plus the CPU-time prediction."""
        if self.costs is None:
            return {**_NO_PREDICTION, "predicted_speedup_cpu": None}
        out: dict[str, float | int | None] = self.predict(self.costs["wall"])
        out["predicted_speedup_cpu"] = self.predict(self.costs["cpu"])["predicted_speedup"]
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("adaptive", "accept_lengths", "gammas_used", "costs")
        }
        out.update(
            {
                "adaptive_gamma": self.adaptive,
                "alpha": self.alpha,
                "acceptance_fraction": self.acceptance_fraction,
                "tokens_per_target_pass": self.tokens_per_pass,
                "mean_gamma": self.mean_gamma,
                "proposal_rate": self.proposal_rate,
                "tokens_per_s": self.generated / self.total_time_s if self.total_time_s else None,
                "step_time_s": self.step_time_s,
                "draft_cost_c": self.draft_cost,
                "verify_cost_v": self.verify_cost,
                "accept_length_histogram": {
                    str(k): v for k, v in sorted(self.accept_lengths.items())
                },
                "gammas_used": {str(k): v for k, v in sorted(self.gammas_used.items())},
                "calibration": {k: c.to_dict() for k, c in (self.costs or {}).items()},
                **self.predictions(),
            }
        )
        return out
