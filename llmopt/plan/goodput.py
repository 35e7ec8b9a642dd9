"""Goodput under failures: checkpoint cost, the Young/Daly checkpoint interval, lost work.

A job on n GPUs fails every M seconds on average (M = per-GPU MTBF / n, or 86400 / failures per
day of the whole cluster). Each checkpoint stops training for C seconds (checkpoint bytes /
storage bandwidth, synchronous write). After a failure the job loses on average half a
checkpoint interval of work plus the restart time R. With interval τ the fraction of time
wasted is C/τ + (τ/2 + R)/M, minimal at Young's τ* = sqrt(2·C·M) (Young 1974; Daly 2006's
higher-order optimum differs by under 5 % while C << M). Goodput = 1 - waste.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from llmopt.errors import LlmoptError
from llmopt.models.config import ModelConfig

# Checkpoint bytes per parameter: bf16 weights (2) + fp32 master weights, Adam m and v (12).
CHECKPOINT_BYTES_PER_PARAM = 14


class GoodputError(LlmoptError, ValueError):
    """A failure-model input that cannot be used (one line, names the value)."""


def checkpoint_bytes(model: ModelConfig) -> float:
    """Bytes of one full training checkpoint (weights + optimizer states)."""
    return float(model.num_parameters()) * CHECKPOINT_BYTES_PER_PARAM


def _positive(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise GoodputError(f"{name}={value!r} must be a finite positive number")
    if value <= 0:
        raise GoodputError(f"{name}={value!r} must be > 0")
    return float(value)


def cluster_mtbf_s(
    gpus: int, gpu_mtbf_hours: float | None = None, failures_per_day: float | None = None
) -> float:
    """Mean seconds between failures of the whole job: per-GPU MTBF / GPUs, or 1 day / rate."""
    gpu_mtbf_hours = _positive("--gpu-mtbf-hours", gpu_mtbf_hours)
    failures_per_day = _positive("--failures-per-day", failures_per_day)
    if (gpu_mtbf_hours is None) == (failures_per_day is None):
        raise GoodputError("give one of --gpu-mtbf-hours or --failures-per-day")
    if failures_per_day is not None:
        return 86400.0 / failures_per_day
    return gpu_mtbf_hours * 3600.0 / gpus


@dataclass(frozen=True)
class Goodput:
    mtbf_s: float  # whole job
    checkpoint_s: float  # one checkpoint write (training paused)
    restart_s: float
    interval_s: float  # time between checkpoints (Young/Daly optimum unless given)
    lost_per_failure_s: float  # interval / 2 + restart
    goodput: float  # useful fraction of wall-clock time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        return (
            f"goodput {self.goodput:.1%}: a failure every {self.mtbf_s / 3600:.1f} h, checkpoint "
            f"{self.checkpoint_s:.0f} s every {self.interval_s / 60:.0f} min (Young/Daly), "
            f"{self.lost_per_failure_s / 60:.0f} min lost per failure"
        )


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Checkpoint interval minimising C/τ + τ/(2M): sqrt(2·C·M)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def waste_fraction(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float):
    """Fraction of wall-clock time spent checkpointing, redoing lost work and restarting."""
    return checkpoint_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def goodput(
    model: ModelConfig,
    gpus: int,
    storage_gbs: float,
    gpu_mtbf_hours: float | None = None,
    failures_per_day: float | None = None,
    restart_minutes: float = 10.0,
    interval_s: float | None = None,
) -> Goodput:
    """The failure model of a job of `model` on `gpus` GPUs writing checkpoints at
    `storage_gbs` GB/s (module docstring)."""
    storage = _positive("--ckpt-gbs", storage_gbs)
    if isinstance(restart_minutes, bool) or not math.isfinite(restart_minutes):
        raise GoodputError(f"--restart-minutes={restart_minutes!r} must be a finite number >= 0")
    if restart_minutes < 0:
        raise GoodputError(f"--restart-minutes={restart_minutes!r} must be >= 0")
    mtbf = cluster_mtbf_s(gpus, gpu_mtbf_hours, failures_per_day)
    c = checkpoint_bytes(model) / (storage * 1e9)
    r = restart_minutes * 60.0
    tau = young_daly_interval(c, mtbf) if interval_s is None else _positive("interval", interval_s)
    waste = waste_fraction(tau, c, r, mtbf)
    if waste >= 1:
        raise GoodputError(
            f"no progress: a failure every {mtbf / 60:.1f} min against a {c:.0f} s checkpoint "
            f"and {r / 60:.0f} min restart wastes {waste:.0%} of the time"
        )
    return Goodput(mtbf, c, r, tau, tau / 2 + r, 1.0 - waste)
