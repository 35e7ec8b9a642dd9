"""A batch of parallel plans as aligned numpy arrays, so the cost model scores one plan or a
million with the same code.

The arrays use short internal keys (below); everything that leaves the planner (JSON, run
configs, messages) uses `ParallelPlan`'s field names. `GRID_FIELDS` is the one mapping.
"""

from __future__ import annotations

import numpy as np

from llmopt.errors import UsageError
from llmopt.parallel.plan import RECOMPUTES, SCHEDULES, ParallelPlan

# internal array key -> ParallelPlan field (etp, expert tensor parallelism, and gacc, the
# ZeRO-2/3 gradient policy, are the planner's own: ParallelPlan has no such fields;
# `Plan.expert_tp` and `Plan.grad_reduce` carry them)
GRID_FIELDS: dict[str, str] = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "cp": "cp",
    "sp": "sequence_parallel",
    "zero": "zero_stage",
    "mb": "micro_batch",
    "m": "num_microbatches",
    "v": "virtual_stages",
    "sched": "schedule",
    "rc": "recompute",
    "ep": "ep",
    "etp": "etp",
    "gacc": "grad_reduce",
}
# ZeRO-2/3 gradient policies (`gacc`): reduce-scatter each micro-batch's gradients into the
# shard, or accumulate full-size gradients over the step and reduce-scatter once (FSDP's
# no_sync / set_requires_gradient_sync(False) on all but the last micro-batch).
GRAD_REDUCES = ("microbatch", "step")
GRID_KEYS: tuple[str, ...] = tuple(GRID_FIELDS)

Grid = dict[str, np.ndarray]

# What the planner's numerics mean for the data-parallel reduction: the "megatron" convention
# keeps fp32 gradients (main_grad) and reduces them in fp32, "zero" keeps and reduces bf16.
REDUCE_DTYPE_OF_STATE = {"megatron": "fp32", "zero": "bf16"}
STATE_OF_REDUCE_DTYPE = {v: k for k, v in REDUCE_DTYPE_OF_STATE.items()}


def to_grid(
    plan: ParallelPlan,
    etp: int | None = None,
    grad_reduce: str = "microbatch",
    ep: int | None = None,
) -> Grid:
    """A one-plan grid (expert TP defaults to Megatron's: tp when ep > 1; `grad_reduce` is the
    ZeRO-2/3 gradient policy, one of GRAD_REDUCES; `ep` overrides plan.ep for an EP degree
    folded beyond dp·cp, which ParallelPlan does not hold)."""
    if grad_reduce not in GRAD_REDUCES:
        raise UsageError(f"grad_reduce={grad_reduce!r}; choose from {', '.join(GRAD_REDUCES)}")
    ep = plan.ep if ep is None else ep
    if etp is None:
        etp = plan.resolved_expert_tp if ep > 1 else 1
    return {
        "tp": np.array([plan.tp]),
        "pp": np.array([plan.pp]),
        "dp": np.array([plan.dp]),
        "cp": np.array([plan.cp]),
        "sp": np.array([int(plan.sequence_parallel)]),
        "zero": np.array([plan.zero_stage]),
        "mb": np.array([plan.micro_batch]),
        "m": np.array([plan.num_microbatches]),
        "v": np.array([plan.virtual_stages]),
        "sched": np.array([SCHEDULES.index(plan.schedule)]),
        "rc": np.array([RECOMPUTES.index(plan.recompute)]),
        "ep": np.array([ep]),
        "etp": np.array([etp]),
        "gacc": np.array([GRAD_REDUCES.index(grad_reduce)]),
    }


def grid_row(
    grid: Grid, i: int, precision: str = "bf16", state_bytes: str = "megatron"
) -> ParallelPlan:
    """The i-th plan of a grid, with the workload's numerics. An expert-parallel degree that
    ParallelPlan cannot hold (Megatron-Core's parallel folding lays EP over tp·cp·dp, so ep may
    exceed dp·cp) is left out of the ParallelPlan (ep=1); `Plan.ep` carries it."""
    ep = int(grid["ep"][i]) if "ep" in grid else 1
    dpcp = int(grid["dp"][i]) * int(grid["cp"][i])
    return ParallelPlan(
        tp=int(grid["tp"][i]),
        pp=int(grid["pp"][i]),
        dp=int(grid["dp"][i]),
        cp=int(grid["cp"][i]),
        ep=ep if dpcp % ep == 0 else 1,
        sequence_parallel=bool(grid["sp"][i]),
        zero_stage=int(grid["zero"][i]),
        micro_batch=int(grid["mb"][i]),
        num_microbatches=int(grid["m"][i]),
        schedule=SCHEDULES[int(grid["sched"][i])],  # type: ignore[arg-type]
        virtual_stages=int(grid["v"][i]),
        recompute=RECOMPUTES[int(grid["rc"][i])],  # type: ignore[arg-type]
        precision=precision,  # type: ignore[arg-type]
        reduce_dtype=REDUCE_DTYPE_OF_STATE[state_bytes],
    )
