"""Refuse weights holding NaN or inf when a model is loaded, naming the tensor.

A model with one NaN weight "generates" (argmax of NaN logits is token 0), evaluates to NaN
and quantizes into garbage, all with exit status 0. One float32 sum per tensor finds any
non-finite element (NaN or inf make the sum non-finite) without a tensor-sized mask; only a
tensor whose finite values overflow the sum is checked element by element.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.errors import LlmoptError


class NonFiniteWeightsError(LlmoptError, ValueError):
    """A model whose weights contain NaN or inf."""


def first_non_finite(model: nn.Module) -> tuple[str, int] | None:
    """(name, count of non-finite elements) of the first floating-point parameter or buffer
    holding NaN/inf, or None."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if not tensor.is_floating_point() or tensor.numel() == 0 or tensor.is_meta:
            continue
        with torch.no_grad():
            if bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
                continue
            bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            return name, bad
    return None


def check_finite_weights(model: nn.Module, source: str) -> None:
    """Raise `NonFiniteWeightsError` naming the first tensor of `model` with NaN/inf."""
    found = first_non_finite(model)
    if found is not None:
        name, bad = found
        raise NonFiniteWeightsError(
            f"{source}: tensor {name!r} holds {bad} NaN/inf value(s); the weights are "
            "corrupted or diverged and cannot be used"
        )
