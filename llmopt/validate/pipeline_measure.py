"""Measured pipeline bubbles and activation bytes, to check the engine against theory and plan.

Bubbles: uniform synthetic stage times and idle fractions from the executor's events
(benchmarks/pipeline_bubble.py); activations: `SavedTensorMeter` (the planner-vs-engine
crosscheck, benchmarks/recompute.py, benchmarks/finetune_memory.py). Nothing here runs at train
time, so it lives in llmopt.validate, not llmopt.parallel.

To compare a real run with the (p-1)/(m+p-1) theory the stages must cost the same; a tiny model
plus a fixed sleep per forward/backward makes that so regardless of which rank holds the
embedding or the head, and of other processes sharing the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from llmopt.parallel.pipeline.simulate import Bubble, Event
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
class MeasuredBubble(Bubble):
    """The bubble of a real step, from its recorded compute windows."""


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


class _Held:
    """A saved tensor while autograd keeps it; its death releases the storage's bytes."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor, key: int) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key
        entry = meter.live.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            meter.live[key] = [nbytes, 1]
            meter.current += nbytes
            meter.peak = max(meter.peak, meter.current)
        else:
            entry[1] += 1

    def __del__(self) -> None:
        entry = self.meter.live[self.key]
        entry[1] -= 1
        if entry[1] == 0:
            self.meter.current -= entry[0]
            del self.meter.live[self.key]


class SavedTensorMeter:
    """Peak bytes of tensors saved for backward (activation memory), counted per storage.

    The one activation meter (pipeline crosscheck, benchmarks/recompute.py). Parameters are
    excluded (pass them as `exclude`): they exist whether or not a micro-batch is in flight.
    A storage shared by several saved views counts once. `keep(t)` adds a tensor kept for
    backward outside autograd's saved tensors (a checkpointed region's inputs) until exit.
    """

    def __init__(
        self, exclude: Sequence[torch.Tensor] = (), only_inside: Sequence[nn.Module] = ()
    ) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        # With `only_inside`, count only what those modules' forwards save (e.g. the blocks,
        # to compare with a per-layer activation model that leaves out embedding and logits).
        self._depth = 0 if only_inside else 1
        self._kept: list[_Held] = []
        self._handles = []
        for module in only_inside:
            self._handles.append(module.register_forward_pre_hook(self._enter_module))
            self._handles.append(module.register_forward_hook(self._leave_module))

    def _enter_module(self, module, args) -> None:
        self._depth += 1

    def _leave_module(self, module, args, output) -> None:
        self._depth -= 1

    def _pack(self, tensor: torch.Tensor):
        key = tensor.untyped_storage().data_ptr()
        if self._depth <= 0 or key in self.exclude or tensor.numel() == 0:
            return tensor
        return _Held(self, tensor, key)

    def keep(self, tensor: torch.Tensor) -> None:
        """Count `tensor` (deduplicated with the saved ones) until the meter exits."""
        key = tensor.untyped_storage().data_ptr()
        if key not in self.exclude and tensor.numel() > 0:
            self._kept.append(_Held(self, tensor, key))

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._kept.clear()
