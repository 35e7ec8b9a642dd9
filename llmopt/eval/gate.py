"""Accuracy gates: pass/fail a candidate model (quantized, pruned, FP8) against its reference.

A deployment step needs a yes/no answer, not a table. The numbers come from
`llmopt.eval.kl.kl_divergence`, which scores both models on the same windows (so the
perplexities compared here are of the same tokens); this module only turns them into gates:
mean KL(ref || candidate) at most `max_kl` nats, perplexity at most `max_ppl_increase_pct`
percent above the reference's, and top-1 agreement at least `min_top1`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from llmopt.errors import LlmoptError
from llmopt.eval.kl import KLResult, kl_divergence


class GateConfigError(LlmoptError, ValueError):
    """A threshold that is not a finite number in its valid range."""


@dataclass(frozen=True)
class GateThresholds:
    """Limits a candidate must meet; None leaves that gate out."""

    max_kl: float | None = None  # mean KL(ref || candidate), nats per token
    max_ppl_increase_pct: float | None = None  # 100 * (ppl / ref_ppl - 1)
    min_top1: float | None = None  # fraction of positions whose argmax tokens agree

    def __post_init__(self) -> None:
        checks = {
            "max_kl": (self.max_kl, 0.0, math.inf),
            "max_ppl_increase_pct": (self.max_ppl_increase_pct, -100.0, math.inf),
            "min_top1": (self.min_top1, 0.0, 1.0),
        }
        for name, (value, low, high) in checks.items():
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise GateConfigError(f"{name}={value!r} must be a number")
            if not math.isfinite(value) or not low <= value <= high:
                raise GateConfigError(f"{name}={value} must be a finite number in [{low}, {high}]")
        if self.max_kl is None and self.max_ppl_increase_pct is None and self.min_top1 is None:
            raise GateConfigError(
                "no gate given: set at least one of max_kl, max_ppl_increase_pct, min_top1"
            )


@dataclass(frozen=True)
class Gate:
    name: str  # "kl", "ppl_increase" or "top1"
    value: float
    threshold: float
    passed: bool

    def describe(self) -> str:
        label, unit, op = _LABELS[self.name]
        ok = "<=" if op == "max" else ">="
        bad = ">" if op == "max" else "<"
        sign = ok if self.passed else bad
        return f"{label} {self.value:.6g}{unit} {sign} {'max' if op == 'max' else 'min'} {self.threshold:.6g}{unit}"


_LABELS = {
    "kl": ("mean KL", " nats", "max"),
    "ppl_increase": ("perplexity increase", "%", "max"),
    "top1": ("top-1 agreement", "", "min"),
}


@dataclass(frozen=True)
class GateReport:
    gates: tuple[Gate, ...]
    kl: KLResult

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def failed(self) -> tuple[Gate, ...]:
        return tuple(g for g in self.gates if not g.passed)

    def reason(self) -> str:
        """One line: every failed gate with its value, or that all passed."""
        if self.passed:
            return "all gates passed: " + "; ".join(g.describe() for g in self.gates)
        return "gate failed: " + "; ".join(g.describe() for g in self.failed)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "reason": self.reason(),
            "gates": [asdict(g) for g in self.gates],
            "kl": asdict(self.kl),
        }


def ppl_increase_pct(result: KLResult) -> float:
    """Percent by which the candidate's perplexity exceeds the reference's, same windows."""
    return 100.0 * (result.ppl / result.ref_ppl - 1.0)


def apply_gates(result: KLResult, thresholds: GateThresholds) -> GateReport:
    """Judge measured statistics; a NaN statistic fails its gate (it can never pass)."""
    gates = []
    if thresholds.max_kl is not None:
        gates.append(_gate("kl", result.mean, thresholds.max_kl, upper=True))
    if thresholds.max_ppl_increase_pct is not None:
        value = ppl_increase_pct(result)
        gates.append(_gate("ppl_increase", value, thresholds.max_ppl_increase_pct, upper=True))
    if thresholds.min_top1 is not None:
        gates.append(_gate("top1", result.top1_agreement, thresholds.min_top1, upper=False))
    return GateReport(tuple(gates), result)


def _gate(name: str, value: float, threshold: float, upper: bool) -> Gate:
    ok = math.isfinite(value) and (value <= threshold if upper else value >= threshold)
    return Gate(name, float(value), float(threshold), ok)


def run_gates(
    model,
    ref_model,
    token_ids,
    thresholds: GateThresholds,
    *,
    ctx: int = 512,
    stride=None,
    progress=None,
) -> GateReport:
    """KL statistics of `model` against `ref_model` on `token_ids`, judged by `thresholds`."""
    result = kl_divergence(model, ref_model, token_ids, ctx=ctx, stride=stride, progress=progress)
    return apply_gates(result, thresholds)
