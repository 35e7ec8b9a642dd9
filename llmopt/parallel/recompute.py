"""Activation recomputation (checkpointing), applied to the plain model by a function.

- ``full``: each transformer block keeps only its input; the whole block is recomputed in
  backward (one extra forward: the classic ~1/3 more compute for the least memory).
- ``selective``: only the attention core softmax(QK^T)V is recomputed (Korthikanti et al.
  2022): its activations grow with seq^2 per head (or, with SDPA, are the kernel's internal
  state) while it costs few FLOPs to redo.
- ``none``: nothing.

The block's (or core's) `forward` is replaced on the instance by a checkpointed call, so the
module tree and parameter names do not change and module hooks (tensor-parallel
communication, ZeRO-3 gathering) keep running once per real forward, outside the
recomputation. Non-reentrant `torch.utils.checkpoint` is used: it composes with autograd
functions that communicate (the recomputed forward repeats the same collectives in the same
order on every rank).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from llmopt.models.spec import spec_for

RECOMPUTE_MODES = ("none", "selective", "full")


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Recompute `mode` ("none", "selective" or "full") on every block of `model`; returns it."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r} is not valid; choose one of {RECOMPUTE_MODES}")
    if mode == "none":
        return model
    spec = spec_for(model)
    for _, block in spec.named_blocks(model):
        target = block if mode == "full" else spec.block_module(block, spec.attention_core)
        if getattr(target, "_llmopt_recompute", False):
            raise ValueError("activation checkpointing is already applied to this model")
        target.forward = _checkpointed(target.forward)
        target._llmopt_recompute = True
    model.recompute = mode
    return model
