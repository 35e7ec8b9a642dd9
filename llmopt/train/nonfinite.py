"""Never train on NaN: a step whose loss or gradient norm is not finite updates nothing.

`NonFiniteGuard.step` is `TrainingEngine.step(skip_nonfinite=True)` plus the count: the global loss
and gradient norm are identical on every rank (both are reduced over the whole grid), so
every rank takes the same decision without another collective. A bad step leaves
masters and optimizer moments as they were; up to `skip_limit` of them are skipped (their
batch dropped), the next one stops the run with `NonFiniteError`, and no checkpoint of it is
written: the last good one stays the newest. `check_finite_state` is the last line before a
save: a checkpoint holding NaN/inf is never written, however the values got there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from llmopt.errors import LlmoptError
from llmopt.parallel.engine import TrainingEngine


class NonFiniteError(LlmoptError, ValueError):
    """Training produced a NaN/inf loss, gradient norm or state (a learning rate too high for
    the model, bad data): the run stops with one line, like any configuration that cannot run."""


@dataclass(frozen=True)
class GuardedStep:
    loss: float
    grad_norm: float
    skipped: bool  # True: non-finite, no update applied
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's (distillation)
    routing: dict[str, object] = field(default_factory=dict)  # MoE statistics of the step


class NonFiniteGuard:
    """Counts the skipped steps of a run; raises past `skip_limit`."""

    def __init__(self, skip_limit: int = 0) -> None:
        self.skip_limit = skip_limit
        self.skipped: list[int] = []

    def step(
        self,
        engine: TrainingEngine,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        step: int,
        num_tokens: float | None = None,
    ) -> GuardedStep:
        """One optimizer step (`step` is 0-based), unless its loss or gradient norm is not
        finite: then no update, and `NonFiniteError` once more than `skip_limit` were bad."""
        out = engine.step(inputs, targets, optimizer, max_norm, num_tokens, skip_nonfinite=True)
        loss, norm = out.loss, out.grad_norm
        if out.applied:
            return GuardedStep(loss, norm, skipped=False, metrics=out.metrics, routing=out.routing)
        self.skipped.append(step + 1)
        if len(self.skipped) > self.skip_limit:
            raise NonFiniteError(
                f"step {step + 1}: loss {loss} and gradient norm {norm} are not both finite "
                f"({len(self.skipped)} such steps: {self.skipped[-5:]}; --skip-nonfinite-steps "
                f"allows {self.skip_limit}); training stopped without applying it, the last "
                "checkpoint is intact; lower --lr, raise --warmup-steps or check the data"
            )
        return GuardedStep(loss, norm, skipped=True, routing=out.routing)


def check_finite_state(tensors: Iterable[tuple[str, torch.Tensor]], world, device) -> None:
    """Collective over `world`: raise `NonFiniteError` on every rank when any rank's tensors
    (floating point only) contain NaN/inf, naming the first bad one found on this rank."""
    bad = next(
        (
            name
            for name, t in tensors
            if t.is_floating_point() and not bool(torch.isfinite(t).all())
        ),
        None,
    )
    flag = torch.tensor([0.0 if bad is None else 1.0], device=device)
    world.all_reduce(flag, op="max")
    if flag.item() > 0:
        where = f"{bad} on this rank" if bad else "another rank's state"
        raise NonFiniteError(
            f"refusing to save a checkpoint holding NaN/inf ({where}); the previous "
            "checkpoint is kept as the newest"
        )
