"""Model-shape agreement between what a run asks for and the weights it starts from.

Resuming a 4-layer checkpoint with `--num-layers 3` used to load three layers and drop the
fourth without a word, and `--init-from` ignored the shape flags altogether. Both are errors
naming the two values: the flags must match the weights (or be left out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmopt.train.config import TrainConfigError

# TrainConfig's shape flags (all ModelConfig fields of the same name).
SHAPE_FLAGS = (
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "vocab_size",
)
# ModelConfig fields a checkpoint's tensors (and their meaning) do not depend on: every other
# field must agree on resume (max_seq_len only sizes the recomputed RoPE tables).
NOT_SHAPE = ("name", "max_seq_len", "extra", "bos_token_id", "eos_token_id", "eos_token_ids")


class ShapeMismatchError(TrainConfigError):
    """Shape flags (or a run's model) that disagree with the weights it starts from."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_shape_flags(flags: Mapping[str, Any], model: Mapping[str, Any], source: str) -> None:
    """Every shape flag given (not None) must equal the value of the model loaded from
    `source` (a ModelConfig as a dict)."""
    bad = [
        (name, flags[name], model.get(name))
        for name in SHAPE_FLAGS
        if flags.get(name) is not None and flags[name] != model.get(name)
    ]
    if bad:
        asked = ", ".join(f"{_flag(n)} {v}" for n, v, _ in bad)
        found = ", ".join(f"{n}={m}" for n, _, m in bad)
        raise ShapeMismatchError(
            f"{asked} disagrees with {source} ({found}); drop the shape flags to use the "
            "weights' own shape, or start a new model without --init-from"
        )


def check_same_model(saved: Mapping[str, Any], here: Mapping[str, Any], source: str) -> None:
    """A resumed run's model (`here`) must have the checkpoint's (`saved`) shape."""
    keys = [k for k in dict.fromkeys([*saved, *here]) if k not in NOT_SHAPE]
    bad = [(k, saved.get(k), here.get(k)) for k in keys if saved.get(k) != here.get(k)]
    if bad:
        shown = ", ".join(f"{k}: checkpoint {a} vs this run {b}" for k, a, b in bad)
        raise ShapeMismatchError(
            f"cannot resume from {source}: its model has another shape ({shown}); use the "
            "checkpoint's shape flags, or train into a new --out-dir"
        )
