"""Per-tensor FP8 scaling state: one scale and amax history per tensor role of a layer.

With tensor or data parallelism each amax is all-reduced (MAX) over a process group before
it is used, so every rank quantises with the same scale.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmopt.precision.fp8.cast import (
    DelayedScaling,
    Fp8Error,
    Recipe,
    compute_amax,
    quantize,
    scale_from_amax,
)

# ---------------------------------------------------------------------------------------------
# Per-tensor scaling state
# ---------------------------------------------------------------------------------------------

# A torch ProcessGroup, the engine's counted `llmopt.parallel.comm.Group` (anything with
# `all_reduce(tensor, op="max")`), None (no reduction) or "auto" (the world when initialised).
AmaxGroup = Any


def resolve_group(group: AmaxGroup) -> Any:
    if isinstance(group, str):
        if group != "auto":
            raise Fp8Error(f"amax_group={group!r}: pass a process group, None or 'auto'")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None
    return group


def reduce_amax(amax: torch.Tensor, group: AmaxGroup) -> torch.Tensor:
    """All-reduce MAX over `group` (in place) so all ranks derive the same scale."""
    group = resolve_group(group)
    if group is None:
        return amax
    if hasattr(group, "all_reduce"):  # counted engine group; a no-op when its size is 1
        group.all_reduce(amax, op="max")
    elif dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


class Fp8Scaler(nn.Module):
    """Scale and amax history of one tensor role (input, weight or grad_output) of one layer.

    Buffers are non-persistent: a checkpoint of an FP8 model is the plain model's state dict
    (the master weights), loadable without FP8. A resumed delayed-scaling run therefore
    rebuilds its history, starting from scale 1 like a fresh TE run.
    """

    def __init__(self, recipe: Recipe, fp8_dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.recipe = recipe
        self.fp8_dtype = fp8_dtype
        self.group: AmaxGroup = None
        length = recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1
        self.register_buffer("amax_history", torch.zeros(length, device=device), persistent=False)
        self.register_buffer("scale", torch.ones((), device=device), persistent=False)

    def _apply(self, fn, recurse=True):
        """Follow device moves but never dtype casts: scales and amaxes stay fp32.

        `model.to(torch.bfloat16)` would otherwise round them (and `_scaled_mm` wants fp32).
        """
        for name, buf in self._buffers.items():
            if buf is not None:
                moved = fn(buf)
                self._buffers[name] = buf.to(device=moved.device, dtype=torch.float32)
        return self

    @torch.no_grad()
    def update_scale(self) -> torch.Tensor:
        """Delayed scaling's step: scale from the history, then roll it (TE's kernel order).

        Roll: entry i takes entry i+1, the last takes the old entry 0 (the latest amax), and
        entry 0 is zeroed for the amax about to be recorded.
        """
        history = self.amax_history
        if self.recipe.amax_compute_algo == "max":
            amax = history.amax()
        else:
            amax = history[0].clone()
        self.scale.copy_(
            scale_from_amax(amax, self.fp8_dtype, self.recipe.margin, previous=self.scale)
        )
        self.amax_history.copy_(torch.roll(history, -1, 0))
        self.amax_history[0] = 0.0
        return self.scale

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 data, inverse scale) of x under this role's recipe."""
        if isinstance(self.recipe, DelayedScaling):
            self.update_scale()
            data = quantize(x, self.scale, self.fp8_dtype)
            self.amax_history[0] = reduce_amax(compute_amax(x), self.group)
        else:
            amax = reduce_amax(compute_amax(x), self.group)
            self.amax_history[0] = amax
            self.scale.copy_(
                scale_from_amax(amax, self.fp8_dtype, self.recipe.margin, previous=self.scale)
            )
            data = quantize(x, self.scale, self.fp8_dtype)
        return data, self.scale.reciprocal()

    def extra_repr(self) -> str:
        return f"{self.fp8_dtype}, history={self.amax_history.numel()}"
