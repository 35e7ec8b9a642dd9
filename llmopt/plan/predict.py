"""What the planner predicts for one exact run, in the engine's own units and keys, so a
training log can be compared with it number for number.

`predicted_comm` gives calls and payload bytes per (group, op) for one optimizer step on one
rank of the first or last pipeline stage, keyed like `llmopt.parallel.comm.CommCounter`'s
tables: {"tp": {"all_reduce": {"calls": n, "bytes": b}}, ...}. Payload bytes follow the same
convention as the counter (all-reduce: the tensor; all-gather: the gathered output;
reduce-scatter: the unscattered input; send/recv: the message). `predicted_activation_bytes`
gives the peak bytes the rank's transformer blocks keep for backward in the eager engine.
Neither depends on the cluster: bytes are a property of the model, the batch and the plan.
"""

from __future__ import annotations

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.parallel.plan import SCHEDULES, ParallelPlan
from llmopt.plan.comm import collectives_for, summarize
from llmopt.plan.hardware import get_cluster
from llmopt.plan.memory import (
    activation_bytes_per_layer,
    layers_per_stage,
    microbatches_in_flight_on_rank,
    rope_table_bytes,
)
from llmopt.plan.search import workload_for
from llmopt.plan.workload import Workload

STAGES = ("first", "last")
CountTable = dict[str, dict[str, dict[str, int]]]


def _workload(plan: ParallelPlan, seq_len: int, global_batch: int) -> Workload:
    plan.check_batch(global_batch)
    return workload_for(Workload(seq_len=seq_len, global_batch=global_batch), plan)


def _stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}; choose 'first' or 'last'")


def predicted_comm(
    model: ModelConfig, seq_len: int, global_batch: int, plan: ParallelPlan, stage: str = "first"
) -> CountTable:
    """Calls and bytes per (group, op) of one optimizer step on a rank of `stage`."""
    _stage(stage)
    work = _workload(plan, seq_len, global_batch)
    # The layout (which link a group crosses) does not change bytes; any cluster of the
    # plan's size will do.
    cluster = get_cluster("dgx-h100", nodes=1, gpus_per_node=plan.world_size)
    out: CountTable = {}
    for (group, op), row in summarize(collectives_for(model, work, cluster, plan, stage)).items():
        out.setdefault(group, {})[op.replace("-", "_")] = {
            "calls": int(row["calls"]),
            "bytes": int(round(row["bytes"])),
        }
    return out


def predicted_activation_bytes(
    model: ModelConfig,
    seq_len: int,
    global_batch: int,
    plan: ParallelPlan,
    stage: str = "first",
    act_bytes: int = 2,
) -> float:
    """Peak bytes the eager engine's blocks save for backward on a rank of `stage`: per-layer
    activations (the planner's "eager" kernel model) and one RoPE cos/sin pair per chunk, times
    the micro-batches the schedule holds in flight. Under full recompute the block rebuilt
    during backward is packed by checkpointing itself, so it is not counted here."""
    _stage(stage)
    _workload(plan, seq_len, global_batch)
    rc = ("none", "selective", "full").index(plan.recompute)
    per_layer = float(
        activation_bytes_per_layer(
            model,
            seq_len,
            plan.micro_batch,
            plan.tp,
            plan.sequence_parallel,
            plan.cp,
            rc,
            True,
            False,
            kernels="eager",
            act_bytes=act_bytes,
        )
    )
    pp, v = np.array(plan.pp), np.array(plan.virtual_stages)
    n_layers = float(layers_per_stage(model, pp, v))
    rank = 0 if stage == "first" else plan.pp - 1
    sched = np.array(SCHEDULES.index(plan.schedule))
    inflight = float(
        microbatches_in_flight_on_rank(pp, np.array(plan.num_microbatches), v, sched, rank)
    )
    rope = rope_table_bytes(model, seq_len, act_bytes)
    return inflight * (per_layer * n_layers + rope * plan.virtual_stages)
