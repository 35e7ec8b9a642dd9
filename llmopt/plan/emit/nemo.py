"""NeMo / Megatron-Bridge: the plan as ConfigContainer overrides of a pretraining recipe, one
shell-quoted torchrun line for Megatron-Bridge's `scripts/training/run_recipe.py` with trailing
KEY=VALUE overrides (the dataset owns the sequence length; the runner copies it to the model).

Field names are those of Megatron-Bridge's ConfigContainer (model: Megatron-Core's
TransformerConfig/ModelParallelConfig; train; ddp: DistributedDataParallelConfig; dataset;
mixed_precision: the registered recipe names), NVIDIA-NeMo/Megatron-Bridge@067f987d. The recipe
is chosen by model preset; a model without a Bridge recipe is refused. Megatron-Bridge runs
Megatron-Core, so it refuses what `emit.megatron` refuses; its mixed-precision presets reduce
gradients in fp32, so reduce_dtype=bf16 is refused too.
"""

from __future__ import annotations

import shlex

from llmopt.plan.emit import megatron
from llmopt.plan.emit.base import EmitError, Emitted, PlannedRun, refuse
from llmopt.plan.frameworks import refusal

FRAMEWORK = "Megatron-Bridge"
RECIPES = {
    "llama-3-8b": "llama3_8b_pretrain_config",
    "llama-3-70b": "llama3_70b_pretrain_config",
    "llama-3.1-8b": "llama31_8b_pretrain_config",
    "llama-3.1-70b": "llama31_70b_pretrain_config",
    "llama-3.1-405b": "llama31_405b_pretrain_config",
}
MIXED_PRECISION = {
    ("bf16", "current"): "bf16_mixed",
    ("bf16", "delayed"): "bf16_mixed",
    ("fp8", "current"): "bf16_with_fp8_current_scaling_mixed",
    ("fp8", "delayed"): "bf16_with_fp8_delayed_scaling_mixed",
}


def _bool(value: bool) -> str:
    return "true" if value else "false"


def check(run: PlannedRun) -> None:
    """Refuse what a Megatron-Bridge recipe override cannot express: Megatron-Core's rules and
    its own (`llmopt.plan.frameworks`), then a model without a recipe."""
    why = refusal("nemo", run.model, run.parallel, run.plan.grad_reduce)
    if why:
        raise EmitError(why)
    recipe(run)


def overrides(run: PlannedRun) -> list[str]:
    """KEY=VALUE ConfigContainer overrides for the plan."""
    check(run)
    p, w = run.parallel, run.work
    out = [
        f"model.tensor_model_parallel_size={p.tp}",
        f"model.pipeline_model_parallel_size={p.pp}",
        "model.virtual_pipeline_model_parallel_size="
        + (str(p.virtual_stages) if p.virtual_stages > 1 else "null"),
        f"model.context_parallel_size={p.cp}",
        f"model.sequence_parallel={_bool(p.sequence_parallel)}",
        f"dataset.seq_length={w.seq_len}",
        f"train.micro_batch_size={p.micro_batch}",
        f"train.global_batch_size={w.global_batch}",
        f"ddp.use_distributed_optimizer={_bool(p.zero_stage == 1)}",
    ]
    if p.zero_stage >= 2:
        out += [
            "ddp.use_megatron_fsdp=true",
            f"ddp.data_parallel_sharding_strategy={megatron.FSDP_STRATEGY[p.zero_stage]}",
            "checkpoint.ckpt_format=fsdp_dtensor",
        ]
    if p.recompute == "full":
        out += [
            "model.recompute_granularity=full",
            "model.recompute_method=uniform",
            "model.recompute_num_layers=1",
        ]
    elif p.recompute == "selective":
        out.append("model.recompute_granularity=selective")
    else:
        out.append("model.recompute_granularity=null")
    out.append(f"mixed_precision={MIXED_PRECISION[(p.precision, p.fp8_recipe)]}")
    return out


def recipe(run: PlannedRun) -> str:
    if run.model_name not in RECIPES:
        raise refuse(
            FRAMEWORK,
            f"model {run.model_name!r} (no pretraining recipe for it)",
            f"use one of {', '.join(RECIPES)}",
        )
    return RECIPES[run.model_name]


def emit(run: PlannedRun) -> Emitted:
    c = run.cluster
    launcher = ["torchrun", "--nnodes", str(c.nodes), "--nproc-per-node", str(c.gpus_per_node)]
    cmd = [*launcher, "scripts/training/run_recipe.py", "--recipe", recipe(run), "--mode"]
    cmd.append("pretrain")
    cmd += ["--dataset", "mock", *overrides(run)]
    header = (
        f"# Megatron-Bridge (NeMo): plan #{run.plan.rank or 1} ({run.parallel.short()}) for "
        f"{run.model.name} on {c.nodes}x{c.gpus_per_node} {c.gpu.name}; run from the "
        "Megatron-Bridge checkout\n"
    )
    return Emitted("#!/bin/sh\n" + header + shlex.join(cmd) + "\n")
