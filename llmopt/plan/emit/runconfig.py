"""llmopt's own run config (what `llmopt train --config` reads): [model], [data], [parallel]
(exactly `ParallelPlan.to_dict()`) and an informational [planner] table the trainer skips:
cluster, rank, predicted step time, memory, and calls/bytes per (group, op) on a first- and a
last-stage rank, keyed like the engine's communication counter.

MoE models are emitted like dense ones (a preset plus shape overrides, the experts' among
them); an EP plan writes its ep and expert_tp. What ParallelPlan cannot hold is refused: EP
folded beyond dp·cp (Megatron-Core's parallel folding over tp)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from llmopt.models.presets import PRESETS
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.emit import toml
from llmopt.plan.emit.base import EmitError, Emitted, PlannedRun
from llmopt.plan.frameworks import refusal
from llmopt.plan.predict import STAGES, predicted_comm

# Shape overrides the trainer takes next to a preset name.
TRAINER_SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "num_experts",
    "expert_ffn_hidden",
)


def check(run: PlannedRun) -> None:
    """A run config names a preset plus the trainer's shape overrides, nothing else, and a
    plan the engine runs (`frameworks.ENGINE_RULES`)."""
    if run.plan.ep != run.parallel.ep:
        raise EmitError(
            f"ep={run.plan.ep} is folded beyond dp*cp={run.parallel.dp * run.parallel.cp} "
            "(over tp), which llmopt's engine does not lay out; use --emit-format megatron, or "
            "--where with an ep that divides dp*cp"
        )
    why = refusal("engine", run.model, parallel_of(run), run.plan.grad_reduce, run.work)
    if why:
        raise EmitError(why)
    if run.model_name not in PRESETS:
        raise EmitError(
            f"a run config names a model preset, got {run.model_name!r}; use --model with one "
            f"of {', '.join(PRESETS)} (and shape flags such as --num-layers)"
        )
    other = sorted(set(run.model_overrides) - set(TRAINER_SHAPE_FIELDS))
    if other:
        raise EmitError(
            f"the trainer cannot override {', '.join(other)} of a preset; it takes "
            f"{', '.join(TRAINER_SHAPE_FIELDS)}"
        )


def parallel_of(run: PlannedRun) -> ParallelPlan:
    """The plan's ParallelPlan with its expert TP (the Plan carries it beside)."""
    if run.parallel.ep == 1:
        return run.parallel
    return dataclasses.replace(run.parallel, expert_tp=run.plan.expert_tp)


def run_config(run: PlannedRun) -> dict[str, Any]:
    """The run config as a dict of tables."""
    check(run)
    p, plan, c = parallel_of(run), run.plan, run.cluster
    return {
        "model": {"model": run.model_name, **run.model_overrides},
        "data": {"seq_len": run.work.seq_len, "global_batch": run.work.global_batch},
        "parallel": p.to_dict(),
        "planner": {
            "rank": plan.rank or 1,
            "fits": plan.fits,
            "cluster": {
                "name": c.name,
                "gpu": c.gpu.name,
                "nodes": c.nodes,
                "gpus_per_node": c.gpus_per_node,
            },
            "step_time_s": {k: round(v, 6) for k, v in plan.step_time_s.items()},
            "tokens_per_s": round(plan.tokens_per_s, 1),
            "mfu": round(plan.mfu, 4),
            "memory_gib": {k: round(v / 2**30, 3) for k, v in plan.memory_bytes.items()},
            "comm": {
                stage: predicted_comm(run.model, run.work.seq_len, run.work.global_batch, p, stage)
                for stage in STAGES
            },
        },
    }


def emit(run: PlannedRun, as_json: bool = False) -> Emitted:
    data = run_config(run)
    if as_json:
        return Emitted(json.dumps(data, indent=1) + "\n")
    comments = [
        f"llmopt run config: plan #{data['planner']['rank']} for {run.model.name} on "
        f"{run.cluster.nodes}x{run.cluster.gpus_per_node} {run.cluster.gpu.name}",
        f"run: llmopt train --config <this file> --nproc-per-node {run.cluster.gpus_per_node}"
        + (f" --nnodes {run.cluster.nodes}" if run.cluster.nodes > 1 else ""),
        "[planner] is informational; the trainer skips it.",
    ]
    return Emitted(toml.dumps(data, comments))
