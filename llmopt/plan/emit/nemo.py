"""NeMo / Megatron-Bridge: the plan as ConfigContainer overrides of a pretraining recipe, one
shell-quoted torchrun line for Megatron-Bridge's `scripts/training/run_recipe.py` with trailing
KEY=VALUE overrides (the dataset owns the sequence length; the runner copies it to the model).

Field names are those of Megatron-Bridge's ConfigContainer (model: Megatron-Core's
TransformerConfig/ModelParallelConfig; train; ddp: DistributedDataParallelConfig; dataset;
mixed_precision: the registered recipe names), NVIDIA-NeMo/Megatron-Bridge@067f987d. The recipe
is chosen by model preset (it owns the shapes, experts, MLA and MTP); a model without a Bridge
recipe is refused. Megatron-Bridge runs Megatron-Core, so it refuses what `emit.megatron`
refuses, and gets the same split (`model.pipeline_model_parallel_layout`, with the recipe's
account-for-embedding/loss switches off), expert mapping and dispatcher, gradient-reduce dtype
(`ddp.grad_reduce_in_fp32`, as its performance recipes set it) and environment.
"""

from __future__ import annotations

import shlex

from llmopt.plan.emit import megatron
from llmopt.plan.emit.base import EmitError, Emitted, PlannedRun, refuse
from llmopt.plan.frameworks import refusal
from llmopt.plan.split import megatron_layout

FRAMEWORK = "Megatron-Bridge"
RECIPES = {
    "llama-3-8b": "llama3_8b_pretrain_config",
    "llama-3-70b": "llama3_70b_pretrain_config",
    "llama-3.1-8b": "llama31_8b_pretrain_config",
    "llama-3.1-70b": "llama31_70b_pretrain_config",
    "llama-3.1-405b": "llama31_405b_pretrain_config",
    # MoE recipes (src/megatron/bridge/recipes/{deepseek,qwen,gpt_oss}/__init__.py)
    "deepseek-v3": "deepseek_v3_pretrain_config",
    "qwen3-30b-a3b": "qwen3_30b_a3b_pretrain_config",
    "qwen3-235b-a22b": "qwen3_235b_a22b_pretrain_config",
    "gpt-oss-120b": "gpt_oss_120b_pretrain_config",
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
    why = refusal("nemo", run.model, run.parallel, run.plan.grad_reduce, run.work)
    if why:
        raise EmitError(why)
    recipe(run)


def overrides(run: PlannedRun) -> list[str]:
    """KEY=VALUE ConfigContainer overrides for the plan."""
    check(run)
    p, w = run.parallel, run.work
    layout = megatron_layout(run.model, p.pp, p.virtual_stages) if p.pp > 1 else None
    out = [
        f"model.tensor_model_parallel_size={p.tp}",
        f"model.pipeline_model_parallel_size={p.pp}",
        "model.virtual_pipeline_model_parallel_size="
        + (str(p.virtual_stages) if p.virtual_stages > 1 else "null"),
    ]
    if layout is not None:
        out += [
            f"model.pipeline_model_parallel_layout={layout}",
            "model.account_for_embedding_in_pipeline_split=false",
            "model.account_for_loss_in_pipeline_split=false",
        ]
    out += [
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
    if run.model.moe is not None:
        out += [
            f"model.expert_model_parallel_size={run.plan.ep}",
            f"model.expert_tensor_parallel_size={run.plan.expert_tp}",
        ]
        if w.ep_dispatcher == "alltoall":
            out.append("model.moe_token_dispatcher_type=alltoall")
        else:
            out += ["model.moe_token_dispatcher_type=flex",
                    f"model.moe_flex_dispatcher_backend={w.ep_dispatcher}"]  # fmt: skip
        out.append(f"model.overlap_moe_expert_parallel_comm={_bool(w.ep_comm_overlap)}")
    out.append(f"comm_overlap.tp_comm_overlap={_bool(w.tp_comm_overlap and p.tp > 1)}")
    out.append(f"mixed_precision={MIXED_PRECISION[(p.precision, p.fp8_recipe)]}")
    fp32 = _bool(p.reduce_dtype == "fp32")
    out += [f"mixed_precision.grad_reduce_in_fp32={fp32}", f"ddp.grad_reduce_in_fp32={fp32}"]
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
    env = [f"{k}={v}" for k, v in megatron.environment(run).items()]
    launcher = ["torchrun", "--nnodes", str(c.nodes), "--nproc-per-node", str(c.gpus_per_node)]
    cmd = [*env, *launcher, "scripts/training/run_recipe.py", "--recipe", recipe(run), "--mode"]
    cmd.append("pretrain")
    cmd += ["--dataset", "mock", *overrides(run)]
    header = (
        f"# Megatron-Bridge (NeMo): plan #{run.plan.rank or 1} ({run.parallel.short()}) for "
        f"{run.model.name} on {c.nodes}x{c.gpus_per_node} {c.gpu.name}; run from the "
        "Megatron-Bridge checkout\n"
    )
    return Emitted("#!/bin/sh\n" + header + shlex.join(cmd) + "\n")
