"""Time and cost to train a token budget with a chosen plan: steps, days, GPU-hours, cost.

The step time is the planner's; `goodput` (`llmopt.plan.goodput`) stretches the wall clock by
the time failures and checkpoints take. No other planner answers "how long and how much for
15T tokens on this cluster" from the same cost model that ranks the plans.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from llmopt.errors import LlmoptError

SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12, "P": 10**15}
_TOKENS = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]?)\s*$")


class BudgetError(LlmoptError, ValueError):
    """A token budget or price that cannot be used (one line, names the value)."""


def parse_tokens(text: str | float | int) -> int:
    """'15T', '300B', '2.5e12', 4096 -> tokens (K/M/B=G/T/P are powers of 1000)."""
    if isinstance(text, bool):
        raise BudgetError(f"--tokens={text!r} is not a token count; e.g. 15T, 300B, 2.5e12")
    if isinstance(text, int | float):
        value, scale = float(text), 1
    else:
        match = _TOKENS.match(text)
        suffix = match.group(2).upper() if match else None
        if match is None or suffix not in SUFFIXES:
            raise BudgetError(
                f"--tokens={text!r} is not a token count; e.g. 15T, 300B, 2.5e12 "
                f"(suffixes {', '.join(s for s in SUFFIXES if s)})"
            )
        value, scale = float(match.group(1)), SUFFIXES[suffix]
    tokens = value * scale
    if not math.isfinite(tokens) or tokens < 1:
        raise BudgetError(f"--tokens={text!r} must be a finite count of at least 1 token")
    return round(tokens)


def check_price(price: float | None) -> float | None:
    """A GPU-hour price must be a finite number >= 0 (None: no cost reported)."""
    if price is None:
        return None
    if isinstance(price, bool) or not isinstance(price, int | float) or not math.isfinite(price):
        raise BudgetError(f"--gpu-hour-price={price!r} must be a finite number >= 0")
    if price < 0:
        raise BudgetError(f"--gpu-hour-price={price!r} must be >= 0")
    return float(price)


@dataclass(frozen=True)
class TrainingBudget:
    """What training `tokens` tokens costs with one plan."""

    tokens: int
    steps: int  # whole optimizer steps: the last one is trained in full
    step_s: float
    gpus: int
    goodput: float  # fraction of wall-clock time that trains (1.0 without a failure model)
    train_seconds: float  # steps x step time
    wall_seconds: float  # train_seconds / goodput
    gpu_hours: float
    cost: float | None  # gpu_hours x price, in the price's currency

    @property
    def days(self) -> float:
        return self.wall_seconds / 86400

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "days": self.days}

    def line(self) -> str:
        cost = "" if self.cost is None else f", cost {self.cost:,.0f}"
        lost = f" at {self.goodput:.1%} goodput" if self.goodput < 1 else ""
        return (
            f"{self.tokens:.3g} tokens = {self.steps:,} steps x {self.step_s:.2f} s: "
            f"{self.days:.1f} days{lost} on {self.gpus:,} GPUs, "
            f"{self.gpu_hours:,.0f} GPU-hours{cost}"
        )


def training_budget(
    tokens: int,
    tokens_per_step: int,
    step_s: float,
    gpus: int,
    price: float | None = None,
    goodput: float = 1.0,
) -> TrainingBudget:
    """Days, GPU-hours and cost of `tokens` tokens at `step_s` seconds per step of
    `tokens_per_step` tokens on `gpus` GPUs (wall clock / goodput)."""
    price = check_price(price)
    if tokens_per_step <= 0 or gpus <= 0:
        raise BudgetError(f"tokens_per_step={tokens_per_step} and gpus={gpus} must be positive")
    if not (math.isfinite(step_s) and step_s > 0):
        raise BudgetError(f"step time {step_s!r} s must be a finite positive number")
    if not (0 < goodput <= 1):
        raise BudgetError(f"goodput={goodput!r} must be in (0, 1]")
    steps = -(-tokens // tokens_per_step)
    train = steps * step_s
    wall = train / goodput
    hours = wall * gpus / 3600
    return TrainingBudget(
        tokens, steps, step_s, gpus, goodput, train, wall, hours,
        None if price is None else hours * price,
    )  # fmt: skip
