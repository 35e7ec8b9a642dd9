"""Measured pipeline bubbles: uniform synthetic stage times and idle fractions from events.

To compare a real run with the (p-1)/(m+p-1) theory the stages must cost the same; a tiny model
plus a fixed sleep per forward/backward makes that so regardless of which rank holds the
embedding or the head, and of other processes sharing the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llmopt.parallel.pipeline.simulate import Event
from llmopt.parallel.pipeline.stage import PipelineStage


class _Delay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, t_fwd: float, t_bwd: float) -> torch.Tensor:
        ctx.t_bwd = t_bwd
        time.sleep(t_fwd)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.t_bwd)
        return grad, None, None


def add_uniform_delay(stage: PipelineStage, t_fwd: float, t_bwd: float) -> PipelineStage:
    """Make every forward of `stage` take `t_fwd` more seconds and every backward `t_bwd` more."""

    def hook(module, args, output):
        return _Delay.apply(output, t_fwd, t_bwd)

    stage.register_forward_hook(hook)
    return stage


@dataclass(frozen=True)
class MeasuredBubble:
    makespan: float
    busy: tuple[float, ...]

    @property
    def bubble(self) -> tuple[float, ...]:
        return tuple(1.0 - b / self.makespan for b in self.busy)

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.bubble)


def measure_bubble(
    events: Sequence[Sequence[Event]], windows: Sequence[tuple[float, float]]
) -> MeasuredBubble:
    """Idle fraction per rank: 1 - compute time / step time.

    `windows` are each rank's (start, end) of the step on a shared clock (`time.perf_counter`
    is CLOCK_MONOTONIC, common to all processes of a machine); the step runs from the first
    start to the last end.
    """
    makespan = max(end for _, end in windows) - min(start for start, _ in windows)
    busy = tuple(sum(e.end - e.start for e in rank) for rank in events)
    return MeasuredBubble(makespan, busy)
