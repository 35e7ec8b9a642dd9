"""What the engine refuses before touching a model, and the FP8 conversion it starts with."""

from __future__ import annotations

import torch

from llmopt.errors import LlmoptError
from llmopt.models.llama import Transformer
from llmopt.parallel.grid import RankGrid
from llmopt.parallel.plan import ParallelPlan

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}


class EngineError(LlmoptError, ValueError):
    """A plan this engine cannot run on this grid; the message names the value and the fix."""


def check_plan(plan: ParallelPlan, grid: RankGrid, model: Transformer) -> None:
    """Refuse a plan that does not match the grid or that this engine cannot run."""
    d = grid.dims
    for name in ("tp", "pp", "dp", "cp", "ep"):
        if getattr(plan, name) != getattr(d, name):
            raise EngineError(
                f"plan {name}={getattr(plan, name)} but the rank grid has {name}={getattr(d, name)}"
            )
    if plan.resolved_expert_tp != d.expert_tp:
        raise EngineError(
            f"plan expert_tp={plan.resolved_expert_tp} but the rank grid has "
            f"expert_tp={d.expert_tp}"
        )
    moe = model.config.moe
    if plan.ep > 1 and moe is None:
        raise EngineError(f"ep={plan.ep} needs a model with experts; {model.config.name} is dense")
    if moe is not None and moe.num_experts % plan.ep:
        raise EngineError(f"ep={plan.ep} does not divide num_experts={moe.num_experts}")
    if moe is not None and plan.tp > 1 and d.expert_tp == 1 and plan.ep == 1:
        raise EngineError(
            f"expert_tp=1 with tp={plan.tp} and ep=1 would replicate every expert on every TP "
            "rank; use expert_tp=tp (the default) or ep>1"
        )
    if plan.cp > 1 and model.config.attn_softcap is not None:
        raise EngineError(
            f"cp={plan.cp}: ring attention does not support soft-capped attention scores "
            f"(attn_softcap={model.config.attn_softcap}); use cp=1"
        )


def convert_fp8(model: Transformer, plan: ParallelPlan, grid: RankGrid) -> None:
    try:
        from llmopt.precision.fp8 import convert_to_fp8
    except ImportError as exc:
        raise EngineError(
            f"precision=fp8 needs llmopt.precision.fp8.convert_to_fp8, unavailable: {exc}"
        ) from exc
    # Amaxes are MAX-reduced over the ranks holding the same pipeline stage (tp x cp x dp):
    # TP shards and DP replicas share one scale; other stages hold other layers. With pp=1
    # that is the world.
    group = grid.world if grid.pp.size == 1 else grid.stage
    convert_to_fp8(model, plan.fp8_recipe, amax_group=group)
