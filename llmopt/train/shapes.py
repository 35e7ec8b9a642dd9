"""Model-shape agreement between what a run asks for and the weights it starts from.

Resuming a 4-layer checkpoint with `--num-layers 3` used to load three layers and drop the
fourth without a word, and `--init-from` ignored the shape flags altogether. Both are errors
naming the two values: the flags must match the weights (or be left out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmopt.train.config import TrainConfigError

if TYPE_CHECKING:
    from llmopt.models.config import ModelConfig

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


def check_dense_linears(model: Any, source: str, flag: str, purpose: str) -> None:
    """Every linear of every block must be a plain `nn.Linear`: a quantized (`QuantLinear`) or
    packed sparse layer has no float weight to train or to fold an adapter into."""
    from torch import nn

    from llmopt.models.spec import spec_for

    spec = spec_for(model)
    for block_name, block in spec.named_blocks(model):
        for name, module in spec.named_block_modules(block, spec.block_linears):
            if not isinstance(module, nn.Linear):
                raise ShapeMismatchError(
                    f"{flag} {source} holds a {type(module).__name__} at "
                    f"{block_name}.{name} (a quantized or packed model); {purpose} needs the "
                    "full-precision weights: use the model it was quantized or pruned from"
                )


def check_layout(cfg: Any, world_size: int, where: str) -> None:
    """The run's ParallelPlan on `world_size` ranks must split its model: tp divides the heads,
    KV heads, MLP width and vocabulary (and the sequence under SP), pp at most the layers.
    Checked by the launcher before any process starts, for the model it can know without
    loading weights (a preset with shape flags, or an HF directory's config.json)."""
    from llmopt.parallel.grid import ParallelDims

    plan = cfg.parallel_plan(world_size)
    model = _model_config(cfg)
    if model is None:
        return
    dims = ParallelDims.of_plan(plan)
    try:
        dims.validate_model(model, cfg.seq_len, cfg.parallel.sequence_parallel)
    except ValueError as exc:
        raise ShapeMismatchError(
            f"{where}: {exc} of the model {cfg.init_from or cfg.model}; choose a layout that "
            "splits it"
        ) from None


def _model_config(cfg: Any):
    """The run's model config when it is known without loading weights, else None."""
    from pathlib import Path

    if cfg.init_from is None:
        return model_config(cfg)
    path = Path(cfg.init_from)
    if (path / "config.json").is_file() and not (path / "llmopt_quant.json").exists():
        from llmopt.models.hf import read_config

        return read_config(path)
    return None


def model_config(cfg: Any) -> ModelConfig:
    """The model a run builds from scratch: its preset with the shape flags (and MoE
    overrides) applied."""
    from llmopt.models.presets import get_preset

    base = get_preset(cfg.model)
    changes = {name: getattr(cfg, name) for name in SHAPE_FLAGS if getattr(cfg, name) is not None}
    changes["max_seq_len"] = max(base.max_seq_len, cfg.seq_len)
    return with_moe_overrides(base.replace(**changes), cfg)


# TrainConfig field -> MoEConfig field (the `moe_` prefix keeps the flags unambiguous)
MOE_FIELDS = {
    "num_experts": "num_experts",
    "expert_ffn_hidden": "expert_ffn_hidden",
    "moe_top_k": "top_k",
    "moe_aux_loss_coef": "aux_loss_coef",
    "moe_z_loss_coef": "z_loss_coef",
    "moe_capacity_factor": "capacity_factor",
    "moe_bias_update_rate": "bias_update_rate",
    "moe_force_balance": "force_balance",
}


def with_moe_overrides(config: ModelConfig, cfg: Any) -> ModelConfig:
    """`config` with the run's MoE overrides (none: unchanged); refused for a dense model."""
    import dataclasses

    from llmopt.models.moe import MoEConfigError

    changes = {f: getattr(cfg, k) for k, f in MOE_FIELDS.items() if getattr(cfg, k) is not None}
    if not changes:
        return config
    if config.moe is None:
        given = ", ".join(_flag(k) for k in MOE_FIELDS if getattr(cfg, k) is not None)
        raise TrainConfigError(f"{given}: model {config.name!r} has no experts (dense)")
    try:
        return config.replace(moe=dataclasses.replace(config.moe, **changes))
    except MoEConfigError as exc:
        raise TrainConfigError(str(exc)) from None
