"""Search the replica layout (TP, EP, data-parallel replicas) of a fixed number of GPUs that
serves a load fastest within latency targets (`--max-itl-ms`, `--max-ttft-ms`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from llmopt.models.config import ModelConfig
from llmopt.plan.hardware import Cluster
from llmopt.plan.serve.capacity import moe_shape
from llmopt.plan.serve.estimate import estimate
from llmopt.plan.serve.result import ServeEstimate
from llmopt.plan.serve.scenario import Scenario, ServeInputError


@dataclass(frozen=True)
class ServeSearch:
    """Layouts meeting the targets, fastest first; every other layout with why it lost."""

    ranked: list[ServeEstimate]
    missed: list[ServeEstimate] = field(default_factory=list)  # valid but over a target
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (layout, reason)

    @property
    def best(self) -> ServeEstimate | None:
        return self.ranked[0] if self.ranked else None

    def to_dict(self) -> dict:
        return {
            "best": None if self.best is None else self.best.to_dict(),
            "ranked": [e.to_dict() for e in self.ranked],
            "missed_target": [e.to_dict() for e in self.missed],
            "rejected": [{"layout": n, "reason": r} for n, r in self.rejected],
        }


def _target(name: str, value: float | None) -> float:
    if value is None:
        return math.inf
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ServeInputError(f"{name}={value!r} must be a positive finite number of ms")
    return float(value)


def layouts(model: ModelConfig, cluster: Cluster, num_gpus: int) -> list[tuple[int, int]]:
    """(tp, ep) pairs to try: tp a power of two dividing num_gpus inside one node, ep a divisor
    of tp for MoE models (1 for dense)."""
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus <= 0:
        raise ServeInputError(f"num_gpus={num_gpus!r} must be a positive integer")
    tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= min(num_gpus, cluster.gpus_per_node)]
    tps = [t for t in tps if num_gpus % t == 0]
    moe = moe_shape(model).is_moe
    return [(t, e) for t in tps for e in (range(1, t + 1) if moe else (1,)) if t % e == 0]


def search(
    model: ModelConfig,
    cluster: Cluster,
    base: Scenario,
    num_gpus: int,
    max_itl_ms: float | None = None,
    max_ttft_ms: float | None = None,
) -> ServeSearch:
    """Every layout of `num_gpus` GPUs for `base`'s load, ranked by output tokens/s among those
    whose ITL and TTFT meet the targets (a tie goes to the lower ITL)."""
    itl_cap, ttft_cap = _target("max_itl_ms", max_itl_ms), _target("max_ttft_ms", max_ttft_ms)
    if max_ttft_ms is not None and base.load.kind == "offline":
        raise ServeInputError(
            "--max-ttft-ms needs an online load (--concurrency or --request-rate); offline "
            "TTFT is the length of the queue"
        )
    ok, missed, rejected = [], [], []
    for tp, ep in layouts(model, cluster, num_gpus):
        name = f"tp={tp} ep={ep} x{num_gpus // tp}"
        try:
            sc = dataclasses.replace(base, tp=tp, ep=ep, num_gpus=num_gpus)
            est = estimate(model, cluster, sc)
        except ServeInputError as exc:
            rejected.append((name, str(exc)))
            continue
        ttft = math.inf if est.ttft_s is None else est.ttft_s * 1e3
        if est.itl_s * 1e3 <= itl_cap and (ttft <= ttft_cap or max_ttft_ms is None):
            ok.append(est)
        else:
            missed.append(est)
    ok.sort(key=lambda e: (-e.output_tokens_per_s, e.itl_s))
    missed.sort(key=lambda e: e.itl_s)
    if not ok and not missed:
        reasons = "; ".join(f"{n}: {r}" for n, r in rejected)
        raise ServeInputError(f"no layout of {num_gpus} GPUs can serve {model.name}: {reasons}")
    return ServeSearch(ok, missed, rejected)
