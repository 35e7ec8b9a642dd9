"""Megatron-LM: the plan as command-line arguments of `pretrain_gpt.py` (one shell-quoted
torchrun line with the environment Megatron requires, mock data and a null tokenizer so it runs
as written; swap in your data).

Option names and choices are those of Megatron-LM's own parser (megatron/training/arguments.py,
NVIDIA/Megatron-LM@d98e8a64; the parity test lists the ones used), and the values pass
Megatron-Core's own TransformerConfig validation (tests/plan/test_plan_emit.py builds one from the
emitted line). What the search prices is what is written:
- the pipeline split `llmopt.plan.split` prices, as `--pipeline-model-parallel-layout` when it
  is uneven (or holds DeepSeek-V3's MTP module), else `--num-virtual-stages-per-pipeline-rank`;
- MoE (`--num-experts`, `--moe-router-topk`, expert widths, `--moe-layer-freq` for leading
  dense blocks, `--expert-model-parallel-size`/`--expert-tensor-parallel-size`, grouped GEMM,
  the dispatcher, A2A overlap), MLA (`--multi-latent-attention` and its ranks) and MTP;
- the overlaps it prices: bucketed gradient reduce and parameter gather with the distributed
  optimizer, TP comm overlap when the workload has it;
- `CUDA_DEVICE_MAX_CONNECTIONS=1` where arguments.py asserts it (tp>1 or cp>1 before Blackwell,
  unless Megatron-FSDP or EP A2A overlap is on, which want it unset).
"""

from __future__ import annotations

import shlex

from llmopt.models.moe import num_moe_layers
from llmopt.plan.emit.base import EmitError, Emitted, PlannedRun
from llmopt.plan.frameworks import refusal
from llmopt.plan.split import megatron_layout

# planner fp8_recipe -> Megatron --fp8-recipe (choices: tensorwise, delayed, mxfp8, blockwise)
FP8_RECIPES = {"current": "tensorwise", "delayed": "delayed"}
# ZeRO-2/3 are Megatron-FSDP sharding strategies (which need the fsdp_dtensor checkpoint format)
FSDP_STRATEGY = {2: "optim_grads", 3: "optim_grads_params"}


def check(run: PlannedRun) -> None:
    """Refuse what Megatron-LM cannot run as planned (rules: `llmopt.plan.frameworks`)."""
    why = refusal("megatron", run.model, run.parallel, run.plan.grad_reduce, run.work)
    if why:
        raise EmitError(why)


def blackwell(run: PlannedRun) -> bool:
    """Compute capability 10+ (B200, GB200): Megatron drops the CUDA_DEVICE_MAX_CONNECTIONS
    requirement there (arguments.py: `get_device_arch_version() < 10`)."""
    return "B200" in run.cluster.gpu.name or "B300" in run.cluster.gpu.name


def environment(run: PlannedRun) -> dict[str, str]:
    """Environment variables Megatron-Core asserts for this plan (arguments.py, validate_args):
    one CUDA connection for TP/CP comm ordering before Blackwell; none with Megatron-FSDP or EP
    A2A overlap (which must not run with 1)."""
    p = run.parallel
    fsdp = p.zero_stage >= 2
    if (p.tp > 1 or p.cp > 1) and not blackwell(run) and not fsdp and not run.work.ep_comm_overlap:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def pipeline_arguments(run: PlannedRun) -> list[str]:
    p = run.parallel
    args = ["--pipeline-model-parallel-size", str(p.pp)]
    if p.pp == 1:
        return args
    layout = megatron_layout(run.model, p.pp, p.virtual_stages)
    if layout is not None:
        return args + ["--pipeline-model-parallel-layout", layout]
    if p.virtual_stages > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(p.virtual_stages)]
    return args


def moe_arguments(run: PlannedRun) -> list[str]:
    """The experts (and MLA, MTP) as Megatron-Core options; [] for a dense model."""
    m, w = run.model, run.work
    args: list[str] = []
    if m.mla is not None:
        a = m.mla
        args += ["--multi-latent-attention", "--kv-lora-rank", str(a.kv_lora_rank)]
        args += ["--qk-head-dim", str(a.qk_nope_head_dim)]
        args += ["--qk-pos-emb-head-dim", str(a.qk_rope_head_dim)]
        args += ["--v-head-dim", str(a.v_head_dim)]
        if a.q_lora_rank is not None:
            args += ["--q-lora-rank", str(a.q_lora_rank)]
    moe = m.moe
    if moe is None:
        return args
    dense = m.num_layers - num_moe_layers(m)
    args += ["--num-experts", str(moe.num_experts), "--moe-router-topk", str(moe.top_k)]
    args += ["--moe-ffn-hidden-size", str(moe.expert_ffn_hidden)]
    if moe.shared_experts:
        args += [
            "--moe-shared-expert-intermediate-size",
            str(moe.shared_experts * moe.shared_hidden),
        ]
    if dense:
        args += ["--moe-layer-freq", f"([0]*{dense}+[1]*{num_moe_layers(m)})"]
    if moe.mtp_layers:
        args += ["--mtp-num-layers", str(moe.mtp_layers)]
    args += ["--expert-model-parallel-size", str(run.plan.ep)]
    args += ["--expert-tensor-parallel-size", str(run.plan.expert_tp)]
    args += ["--moe-grouped-gemm", "--moe-router-load-balancing-type", "aux_loss"]
    if w.ep_dispatcher == "alltoall":
        args += ["--moe-token-dispatcher-type", "alltoall"]
    else:
        args += ["--moe-token-dispatcher-type", "flex"]
        args += ["--moe-flex-dispatcher-backend", w.ep_dispatcher]
    if w.ep_comm_overlap:
        args.append("--overlap-moe-expert-parallel-comm")
    return args


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
    if m.mla is None and m.num_kv_heads != m.num_heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.num_kv_heads)]
    if m.mla is None and m.head_dim * m.num_heads != m.hidden_size:
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
    args += pipeline_arguments(run)
    if p.cp > 1:
        args += ["--context-parallel-size", str(p.cp)]
    if p.sequence_parallel:
        args.append("--sequence-parallel")
    if w.tp_comm_overlap and p.tp > 1:
        args.append("--tp-comm-overlap")
    if p.zero_stage == 1:
        args.append("--use-distributed-optimizer")
    elif p.zero_stage >= 2:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
        args += [FSDP_STRATEGY[p.zero_stage], "--ckpt-format", "fsdp_dtensor"]
    if w.dp_comm_overlap and p.dp * p.cp > 1:
        args.append("--overlap-grad-reduce")
        if p.zero_stage >= 1:
            args.append("--overlap-param-gather")
    if p.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        args += ["--recompute-num-layers", "1"]
    elif p.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    args += moe_arguments(run)
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
    env = [f"{k}={v}" for k, v in environment(run).items()]
    line = shlex.join([*env, *launcher, "pretrain_gpt.py", *arguments(run)])
    line = line.replace("'${NODE_RANK}'", '"$NODE_RANK"').replace(
        "'${MASTER_ADDR}'", '"$MASTER_ADDR"'
    )
    header = (
        f"# Megatron-LM: plan #{run.plan.rank or 1} ({run.parallel.short()}) for "
        f"{run.model.name} on {c.nodes}x{c.gpus_per_node} {c.gpu.name}; run from the "
        "Megatron-LM checkout\n"
    )
    return Emitted("#!/bin/sh\n" + header + line + "\n")
