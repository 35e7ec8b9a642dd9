"""Megatron-LM: the plan as command-line arguments of `pretrain_gpt.py` (one shell-quoted
torchrun line, mock data and a null tokenizer so it runs as written; swap in your data).

Option names and choices are those of Megatron-LM's own parser (megatron/training/arguments.py,
NVIDIA/Megatron-LM@d98e8a64; the parity test lists the ones used). Megatron's rank order is
tp, cp, ep, dp, pp, the planner's. What it cannot express is refused with the rules of
`llmopt.plan.frameworks` (the search applies the same ones): a GPipe schedule (Megatron-Core
runs 1F1B, interleaved with virtual stages), a layer count the pipeline does not divide (uneven
splits need explicit first/last-stage layer counts), ZeRO-2/3 (Megatron-FSDP) with pp>1.
"""

from __future__ import annotations

import shlex

from llmopt.plan.emit.base import EmitError, Emitted, PlannedRun
from llmopt.plan.frameworks import refusal

# planner fp8_recipe -> Megatron --fp8-recipe (choices: tensorwise, delayed, mxfp8, blockwise)
FP8_RECIPES = {"current": "tensorwise", "delayed": "delayed"}
# ZeRO-2/3 are Megatron-FSDP sharding strategies (which need the fsdp_dtensor checkpoint format)
FSDP_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}


def check(run: PlannedRun) -> None:
    """Refuse what Megatron-LM cannot run as planned (rules: `llmopt.plan.frameworks`)."""
    why = refusal("megatron", run.model, run.parallel, run.plan.grad_reduce)
    if why:
        raise EmitError(why)


def arguments(run: PlannedRun) -> list[str]:
    """The pretrain_gpt.py arguments: model shape, data, then the plan."""
    check(run)
    m, p, w = run.model, run.parallel, run.work
    args = [
        "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.intermediate_size),
        "--num-attention-heads", str(m.num_heads),
    ]  # fmt: skip
    if m.num_kv_heads != m.num_heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.num_kv_heads)]
    if m.head_dim * m.num_heads != m.hidden_size:
        args += ["--kv-channels", str(m.head_dim)]
    args += ["--seq-length", str(w.seq_len), "--max-position-embeddings", str(m.max_seq_len)]
    args += ["--position-embedding-type", "rope", "--rotary-base", f"{m.rope_theta:g}"]
    args += ["--normalization", "RMSNorm"]
    if m.mlp_kind == "swiglu":
        args.append("--swiglu")
    if not m.attention_bias:
        args.append("--disable-bias-linear")
    if not m.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab_size), "--mock-data"]
    args += ["--micro-batch-size", str(p.micro_batch), "--global-batch-size", str(w.global_batch)]
    args += ["--train-iters", "100", "--lr", "3e-4"]
    args += ["--tensor-model-parallel-size", str(p.tp)]
    args += ["--pipeline-model-parallel-size", str(p.pp)]
    if p.virtual_stages > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(p.virtual_stages)]
    if p.cp > 1:
        args += ["--context-parallel-size", str(p.cp)]
    if p.sequence_parallel:
        args.append("--sequence-parallel")
    if p.zero_stage == 1:
        args.append("--use-distributed-optimizer")
    elif p.zero_stage >= 2:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
        args += [FSDP_STRATEGY[p.zero_stage], "--ckpt-format", "fsdp_dtensor"]
    if p.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        args += ["--recompute-num-layers", "1"]
    elif p.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    args.append("--bf16")
    if p.precision == "fp8":
        args += ["--fp8-format", "hybrid", "--fp8-recipe", FP8_RECIPES[p.fp8_recipe]]
    if p.reduce_dtype == "bf16":
        args.append("--grad-reduce-in-bf16")
    return args


def emit(run: PlannedRun) -> Emitted:
    c = run.cluster
    launcher = ["torchrun", "--nnodes", str(c.nodes), "--nproc-per-node", str(c.gpus_per_node)]
    if c.nodes > 1:
        launcher += ["--node-rank", "${NODE_RANK}", "--master-addr", "${MASTER_ADDR}"]
    line = shlex.join([*launcher, "pretrain_gpt.py", *arguments(run)])
    line = line.replace("'${NODE_RANK}'", '"$NODE_RANK"').replace(
        "'${MASTER_ADDR}'", '"$MASTER_ADDR"'
    )
    header = (
        f"# Megatron-LM: plan #{run.plan.rank or 1} ({run.parallel.short()}) for "
        f"{run.model.name} on {c.nodes}x{c.gpus_per_node} {c.gpu.name}; run from the "
        "Megatron-LM checkout\n"
    )
    return Emitted("#!/bin/sh\n" + header + line + "\n")
