"""The speculative-decoding speed model: one predictor, from acceptance and measured costs.

Leviathan et al. 2023: with per-guess acceptance α (i.i.d.) and γ guesses, a round emits
E = (1-α^(γ+1))/(1-α) tokens. Costs are in units of one 1-token target step; a round costs
γ·c (draft steps) + v(γ+1) (one (γ+1)-token verify pass). Leviathan takes v = 1, but on a
CPU a 5-token pass costs ~1.8 steps (GEMM instead of a bandwidth-bound matrix-vector
product), so that formula predicts 3.6-4.8x where 1.9-2.2x is measured. Two more terms
bring every recorded run within 14% (docs/benchmarks/speculative.md):
- rounds where the draft proposes nothing (a prompt-lookup miss) are plain 1-token steps;
- after a fully accepted round (probability f·α^γ, f the fraction of rounds that propose) a
  model draft's first pass catches up on two tokens (its last guess and the bonus token),
  costing c₂ instead of c.
The costs must be measured apart from the timed run (`measure.calibrate`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[tokens emitted per target pass] = (1-α^(γ+1))/(1-α) (Leviathan et al., eq. 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha={alpha} must be in [0, 1]")
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(
    alpha: float,
    gamma: int,
    c: float,
    verify_cost: float = 1.0,
    *,
    proposal_rate: float = 1.0,
    catchup_cost: float | None = None,
) -> float:
    """Speedup over plain decoding: E[tokens per round] / E[cost per round].

    c: one draft step; verify_cost: one (γ+1)-token target pass (both per 1-token target
    step); proposal_rate: the fraction of rounds in which the draft proposes; catchup_cost:
    c₂, the draft's 2-token pass (None: c). The defaults give Leviathan's formula.
    """
    c2 = c if catchup_cost is None else catchup_cost
    if not (math.isfinite(c) and c >= 0 and math.isfinite(c2) and c2 >= 0):
        raise ValueError(f"draft costs must be finite and >= 0: c={c}, catchup_cost={c2}")
    if not (math.isfinite(verify_cost) and verify_cost > 0):
        raise ValueError(f"verify_cost={verify_cost} must be finite and > 0")
    if not 0.0 <= proposal_rate <= 1.0:
        raise ValueError(f"proposal_rate={proposal_rate} must be in [0, 1]")
    f = proposal_rate
    tokens = f * expected_tokens_per_round(alpha, gamma) + (1 - f)
    # catch-up: the previous round proposed and kept all γ guesses (probability f·α^γ)
    draft = gamma * c + f * alpha**gamma * (c2 - c)
    return tokens / (f * (draft + verify_cost) + (1 - f))


def optimal_gamma(
    alpha: float,
    c: float,
    max_gamma: int = 16,
    verify_cost: Mapping[int, float] | None = None,
    *,
    proposal_rate: float = 1.0,
    catchup_cost: float | None = None,
) -> int:
    """The γ in [1, max_gamma] that maximises the predicted speedup.

    `verify_cost` maps γ to the measured v of a (γ+1)-token pass; γs it lacks are not
    considered (None: v = 1).
    """
    gammas = [g for g in range(1, max_gamma + 1) if verify_cost is None or g in verify_cost]
    if not gammas:
        raise ValueError(f"verify_cost has no entry for any gamma in [1, {max_gamma}]")
    return max(
        gammas,
        key=lambda g: predicted_speedup(
            alpha,
            g,
            c,
            1.0 if verify_cost is None else verify_cost[g],
            proposal_rate=proposal_rate,
            catchup_cost=catchup_cost,
        ),
    )


@dataclass(frozen=True)
class PassCosts:
    """Costs of one target/draft pair on one clock, per 1-token target step.

    target[t]: a t-token target pass (target[1] == 1); draft: c, a 1-token draft pass;
    draft_2: c₂, a 2-token draft pass (both 0 for a draft without a model).
    """

    step_s: float  # seconds of one 1-token target step: the unit
    target: Mapping[int, float]
    draft: float = 0.0
    draft_2: float = 0.0

    def __post_init__(self) -> None:
        values = [self.step_s, self.draft, self.draft_2, *self.target.values()]
        if not all(math.isfinite(v) and v >= 0 for v in values) or self.step_s == 0:
            raise ValueError(f"pass costs must be finite and >= 0 (step_s > 0): {self}")
        if 1 not in self.target or len(self.target) < 2:
            raise ValueError(f"target pass costs need t=1 and some t>1, got {sorted(self.target)}")

    def verify(self, gamma: int) -> float:
        """v(γ+1): the verify pass of a round with γ guesses."""
        if gamma + 1 not in self.target:
            raise ValueError(
                f"no calibrated cost for a {gamma + 1}-token pass; have {sorted(self.target)}"
            )
        return self.target[gamma + 1]

    def predict(self, alpha: float, gamma: int, proposal_rate: float = 1.0) -> float:
        return predicted_speedup(
            alpha,
            gamma,
            self.draft,
            self.verify(gamma),
            proposal_rate=proposal_rate,
            catchup_cost=self.draft_2,
        )

    def optimal_gamma(self, alpha: float, proposal_rate: float = 1.0) -> int:
        """Best γ among the calibrated pass lengths."""
        v = {t - 1: cost for t, cost in self.target.items() if t >= 2}
        return optimal_gamma(
            alpha,
            self.draft,
            max(v),
            v,
            proposal_rate=proposal_rate,
            catchup_cost=self.draft_2,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "target_pass": {str(t): v for t, v in sorted(self.target.items())},
            "draft_c": self.draft,
            "draft_c2": self.draft_2,
        }


def predicted_tree_speedup(tokens_per_pass: float, verify_cost: float, draft_cost: float) -> float:
    """Speedup of draft trees (or a feature head's chains) over plain decoding: τ / (draft +
    verify), all per 1-token target step.

    tokens_per_pass: τ, the mean tokens one verify pass yields (accepted guesses + 1);
    verify_cost: v(1 + budget), the tree pass; draft_cost: the head's calls of one round — one
    catch-up chain over the accepted tokens (which also scores the root's children) and one
    expansion call per further depth (`TreeCosts.round_draft`)."""
    if not (math.isfinite(tokens_per_pass) and tokens_per_pass >= 1):
        raise ValueError(f"tokens_per_pass={tokens_per_pass} must be finite and >= 1")
    if not (math.isfinite(verify_cost) and verify_cost > 0):
        raise ValueError(f"verify_cost={verify_cost} must be finite and > 0")
    if not (math.isfinite(draft_cost) and draft_cost >= 0):
        raise ValueError(f"draft_cost={draft_cost} must be finite and >= 0")
    return tokens_per_pass / (verify_cost + draft_cost)


@dataclass(frozen=True)
class TreeCosts:
    """Pass costs of a feature head and its target, per 1-token target step, measured apart
    from the timed run (`llmopt.infer.speculative.tree_decode.calibrate_tree`).

    verify: the (1 + budget)-token tree pass; chain: the head's catch-up call; expand: one
    expansion call (top_k nodes at once)."""

    step_s: float
    verify: float
    chain: float
    expand: float

    def round_draft(self, depth: int) -> float:
        return self.chain + (depth - 1) * self.expand

    def predict(self, tokens_per_pass: float, depth: int, budget: int | None = None) -> float:
        """`depth` expansions, of which at most `budget` can matter (a path of d nodes)."""
        depth = depth if budget is None else min(depth, budget)
        return predicted_tree_speedup(tokens_per_pass, self.verify, self.round_draft(depth))

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "verify": self.verify, "chain": self.chain,
                "expand": self.expand}  # fmt: skip
