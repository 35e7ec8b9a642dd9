"""torchtitan: the plan as a TOML job config (`torchrun ... -m torchtitan.train
--job.config_file FILE`).

Section and field names are those of torchtitan's JobConfig dataclasses
(torchtitan/config/job_config.py at pytorch/torchtitan@238fa995, the last release line whose
runs are TOML files; later torchtitan moved to Python configs with the same field names).
What its code cannot run as planned is refused (plan rules in `llmopt.plan.frameworks`,
shared with the search):
- ZeRO-1 (FSDP2 shards parameters too; only ZeRO-2 = reshard never, ZeRO-3 = reshard always);
- ZeRO-0 (DDP) with any other parallelism ("DDP has not supported > 1D parallelism"), and so
  with context parallelism (FSDP is applied over the cp ranks whenever cp > 1);
- tensor parallelism without sequence parallelism (its TP plan always shards norms over the
  sequence);
- bf16 gradient reduction (mixed_precision_reduce only takes float32), FP8 delayed scaling
  (torchao float8 scales dynamically: tensorwise is the current-scaling recipe);
- model presets with no torchtitan llama3 flavor; a layer split it cannot reproduce.
"""

from __future__ import annotations

import math

from llmopt.plan.emit import toml
from llmopt.plan.emit.base import EmitError, Emitted, PlannedRun, refuse
from llmopt.plan.frameworks import refusal

FRAMEWORK = "torchtitan"
FLAVORS = {
    "llama-3-8b": "8B",
    "llama-3.1-8b": "8B",
    "llama-3-70b": "70B",
    "llama-3.1-70b": "70B",
    "llama-3.1-405b": "405B",
}
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}
RECOMPUTE = {"none": "none", "selective": "selective", "full": "full"}


def check(run: PlannedRun) -> None:
    p = run.parallel
    if run.model_name not in FLAVORS:
        raise refuse(
            FRAMEWORK,
            f"model {run.model_name!r} (no llama3 flavor for it)",
            f"use one of {', '.join(FLAVORS)}",
        )
    why = refusal("torchtitan", run.model, p, run.plan.grad_reduce, run.work)
    if why:
        raise EmitError(why)
    if p.precision == "fp8" and p.fp8_recipe == "delayed":
        raise refuse(FRAMEWORK, "fp8_recipe=delayed", "use fp8_recipe=current (tensorwise)")


def _layers_per_stage(run: PlannedRun) -> int:
    """Layers per pipeline stage, the embedding and the output layer weighted as one layer each
    (torchtitan/distributed/pipeline_parallel.py: ceil((layers + 1 + 1) / layers_per_stage)
    stages); `check` has refused splits it cannot reproduce."""
    p = run.parallel
    return math.ceil((run.model.num_layers + 2) / (p.pp * p.virtual_stages))


def job_config(run: PlannedRun) -> dict:
    """The job config as a dict of TOML tables."""
    check(run)
    p, w = run.parallel, run.work
    local = p.micro_batch * (p.num_microbatches if p.pp > 1 else 1)
    parallelism: dict = {
        "data_parallel_replicate_degree": p.dp if p.zero_stage == 0 else 1,
        "data_parallel_shard_degree": 1 if p.zero_stage == 0 else p.dp,
        "tensor_parallel_degree": p.tp,
        "pipeline_parallel_degree": p.pp,
        "context_parallel_degree": p.cp,
    }
    if p.zero_stage >= 2:
        parallelism["fsdp_reshard_after_forward"] = "never" if p.zero_stage == 2 else "always"
    if p.pp > 1:
        parallelism.update(
            {
                "pipeline_parallel_schedule": SCHEDULES[p.schedule],
                "pipeline_parallel_microbatch_size": p.micro_batch,
                "pipeline_parallel_layers_per_stage": _layers_per_stage(run),
                "pipeline_parallel_first_stage_less_layers": 1,
                "pipeline_parallel_last_stage_less_layers": 1,
            }
        )
    model: dict = {"name": "llama3", "flavor": FLAVORS[run.model_name]}
    doc: dict = {
        "job": {"description": f"llmopt plan #{run.plan.rank or 1}: {p.short()}"},
        "model": model,
        "training": {
            "local_batch_size": local,
            "global_batch_size": w.global_batch,
            "seq_len": w.seq_len,
            "mixed_precision_param": "bfloat16",
            "mixed_precision_reduce": "float32",
        },
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": RECOMPUTE[p.recompute]},
    }
    if p.recompute == "selective":
        doc["activation_checkpoint"]["selective_ac_option"] = "op"
    if p.precision == "fp8":
        model["converters"] = ["float8"]
        doc["quantize"] = {"linear": {"float8": {"recipe_name": "tensorwise"}}}
    return doc


def emit(run: PlannedRun) -> Emitted:
    c = run.cluster
    comments = [
        f"torchtitan job config: plan #{run.plan.rank or 1} for {run.model.name} on "
        f"{c.nodes}x{c.gpus_per_node} {c.gpu.name}",
        f"run: torchrun --nnodes {c.nodes} --nproc-per-node {c.gpus_per_node} "
        "-m torchtitan.train --job.config_file <this file>",
    ]
    if run.plan.grad_reduce == "step":  # no knob: torch.distributed.pipelining does it with pp>1
        comments.append(
            "gradients: grad_reduce=step, FSDP gradients accumulated over the micro-batches and "
            "reduce-scattered once per step (torch.distributed.pipelining with FSDP)"
        )
    return Emitted(toml.dumps(job_config(run), comments))
