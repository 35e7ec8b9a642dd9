"""Step time of a training plan, vectorised over candidate plans.

Per micro-batch and layer on the busiest pipeline stage (the last one, which also runs the
output layer):
- GEMMs: 2·(matmul weights per TP rank)·tokens forward, twice that backward, at
  `peak × gemm_efficiency` (FP8 GEMMs at the FP8 peak × fp8_gemm_efficiency);
- attention core: 4·s·(heads·head_dim)/t FLOPs per token forward; a fused (flash) kernel skips
  the masked half of causal attention and runs at the attention efficiency of the workload's
  kernel generation (`GPUProfile.attention_efficiency_of`), the unfused path
  (Megatron 2021-22) computes the full s² at GEMM efficiency;
- memory-bound kernels (norms, residual adds, RoPE, activation function, softmax and dropout
  without flash) move bytes at `hbm_bandwidth × hbm_efficiency`; backward moves twice the bytes;
- recomputation: full repeats the forward (and its TP collectives), selective repeats the
  attention core (free with flash attention, whose backward recomputes it anyway);
- TP collectives on the link the group crosses, exposed unless `tp_comm_overlap`
  (then `1 - comm_overlap_efficiency` stays exposed); CP as ring attention (`llmopt.plan.ring`):
  cp-1 K/V passes per layer, each exposed by what it takes beyond one block's attention.
Pipeline: step = m·τ_last + (p-1)/v·τ_mean (Narayanan's bubble (p-1)/(v·m)), plus point-to-point
sends, plus the DP/ZeRO collectives not hidden behind backward (or forward, for parameter
gathers), plus the optimizer step, a memory-bound pass over the local shard
(`ADAM_BYTES_PER_PARAM`).

MoE blocks (routed-expert GEMMs, EP all-to-alls, permutes): `llmopt.plan.experts`.
MFU = model FLOPs per step (`Workload.flops_convention`) / (step time · GPUs · dense peak of the
workload's precision); HFU adds recomputed FLOPs (see `llmopt.plan.flops`).
"""

from __future__ import annotations

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.models.moe import attention_core_dim, attention_params, mlp_params
from llmopt.plan import dispatch, ring
from llmopt.plan.comm import Collectives, applies, collectives, layout
from llmopt.plan.experts import (
    expert_weight_seconds,
    host_seconds_per_block,
    moe_elementwise,
    routed_gemm_params,
)
from llmopt.plan.grid import Grid
from llmopt.plan.hardware import Cluster
from llmopt.plan.memory import (
    ACT_BYTES,
    RC_FULL,
    RC_SELECTIVE,
    SCHED_INTERLEAVED,
    grad_policy,
    kv_heads_per_rank,
    layers_per_stage,
    split_state_bytes,
    stage_params,
)
from llmopt.plan.split import mtp_layers, rank_layers
from llmopt.plan.workload import STATE_BYTES, Workload

# Share of the GPU's comm_overlap_efficiency that each data-parallel sharding implementation
# reaches for its gradient reduce and weight gathers. "fsdp" (PyTorch FSDP2, Megatron's
# distributed optimizer and Megatron-FSDP: bucketed, prefetched on side streams) is the
# reference, 1.0. "deepspeed" (ZeRO-3 parameter fetch from module hooks, prefetch bounded by
# stage3_prefetch_bucket_size) was fitted on the calibration rows 11-16 (Narayanan et al. 2021
# Table 2, DeepSpeed ZeRO-3 on 384-2240 A100): 0.6 puts their median error at 3.4 % (1.0: 17 %).
SHARDING_OVERLAP = {"fsdp": 1.0, "deepspeed": 0.6}
# Fixed cost of one pipeline step (one model chunk's forward or backward of one micro-batch on
# a rank): p2p handshake and launch gap. Fitted on the calibration rows: 0.5 ms moves the dense
# median from 5.2 to 4.8 % and the MoE p90 from 47 to 41 % (0, 0.2, 0.5, 1 and 2 ms tried;
# above 0.5 ms the NeMo rows with pp 8 x vp 8 turn slow).
CHUNK_STEP_S = 0.0005
# torchao Float8Linear (`Workload.fp8_casts == "torchao"`): bytes of HBM traffic per element of
# every linear's input (forward) and output gradient (backward): an amax read (2), a cast read
# and FP8 write (3) and a transposed FP8 copy for the other GEMM (3). Each linear casts its own
# input (torchtitan's wq, wk, wv each cast the same x). A prior, checked on the calibration
# rows 541-547 (torchao's README and the PyTorch float8 + FSDP2 blog, Llama 3 8B-405B).
TORCHAO_CAST_BYTES = 8.0
# Adam step, bytes moved per local parameter: read fp32 master, grad, m, v (16), write master,
# m, v (12) and the bf16 weight copy (2), plus a read of the gradient for the norm/clip (4).
ADAM_BYTES_PER_PARAM = 34.0
DP_GROUPS = ("dp", "edp")  # dense and routed-expert data parallelism


def _linear_dims(model: ModelConfig, kv_dim: np.ndarray, t: np.ndarray) -> tuple:
    """Per token and layer on one TP rank: elements of the linears' inputs and of their output
    gradients, and the block's matmul weights in execution order (q, k, v, o, then the MLP's
    gate, up, down or fc1, fc2) as (weights per rank, ...)."""
    h, q, f = model.hidden_size, model.q_size, model.intermediate_size
    if model.mlp_kind == "swiglu":
        mlp_in, mlp_out = 2 * h + f / t, 2 * f / t + h
        weights = (h * q / t, h * kv_dim, h * kv_dim, q * h / t, h * f / t, h * f / t, f * h / t)
    else:
        mlp_in, mlp_out = h + f / t, f / t + h
        weights = (h * q / t, h * kv_dim, h * kv_dim, q * h / t, h * f / t, f * h / t)
    inputs = 3 * h + q / t + mlp_in
    outputs = q / t + 2 * kv_dim + h + mlp_out
    return inputs, outputs, weights


def _every_other_mm_share(weights: tuple) -> np.ndarray:
    """Share of the block's GEMM work in its 2nd, 4th, ... matmul: what torchtitan's op-level
    SAC recomputes."""
    total = sum(weights)
    return sum(weights[1::2]) / total


def _sum_time(cs: list[Collectives], cluster: Cluster, **match: object) -> np.ndarray:
    total = 0.0
    for c in cs:
        if all(getattr(c, k) in (v if isinstance(v, tuple) else (v,)) for k, v in match.items()):
            total = total + c.calls * c.seconds_per_call(cluster)
    return np.asarray(total, dtype=np.float64)


def step_time(
    model: ModelConfig, work: Workload, cluster: Cluster, grid: Grid
) -> dict[str, np.ndarray]:
    """Seconds per step and its parts for each plan of `grid` (module docstring)."""
    gpu = cluster.gpu
    tp, cp, pp, m, v = grid["tp"], grid["cp"], grid["pp"], grid["m"], grid["v"]
    t = tp.astype(np.float64)
    sp = grid["sp"] == 1
    rc = grid["rc"]
    h, f, s, a = model.hidden_size, model.intermediate_size, work.seq_len, model.num_heads
    tokens = grid["mb"] * s / cp
    gemm_rate = gpu.peak_flops(work.precision) * gpu.clock_scale
    gemm_rate *= gpu.fp8_gemm_efficiency if work.precision == "fp8" else gpu.gemm_efficiency
    bf16 = gpu.peak_flops("bf16") * gpu.clock_scale
    hbm = gpu.hbm_bandwidth_gbs * 1e9 * gpu.hbm_efficiency
    kv_dim = kv_heads_per_rank(model, tp) * model.head_dim
    n_mlp = 3 if model.mlp_kind == "swiglu" else 2

    # Forward of one layer for one micro-batch.
    gemm_params = (2 * h * model.q_size + n_mlp * h * f) / t + 2 * h * kv_dim
    moe_elem = expert_gpu = expert_w = 0.0
    if model.moe is not None or model.mla is not None:
        mp = mlp_params(model)
        dense = attention_params(model) + mp["dense"] + mp["shared"]
        routed = routed_gemm_params(model, work)
        gemm_params = (dense + routed) / t + mp["router"]
        g_bytes = STATE_BYTES[work.state_bytes][1]
        expert_w = expert_weight_seconds(model, grid, g_bytes, hbm)
        expert_gpu = 3 * tokens * 2 * routed / t / gemm_rate + expert_w  # forward + backward
        moe_elem = moe_elementwise(model) / t
        f = mp["dense"] / (n_mlp * h)  # the dense MLPs' width, averaged over blocks
    t_gemm = tokens * 2 * gemm_params / gemm_rate
    lin_in, lin_out, lin_weights = _linear_dims(model, kv_dim, t)
    t_cast = 0.0
    if work.precision == "fp8" and work.fp8_casts == "torchao":
        t_cast = tokens * TORCHAO_CAST_BYTES * (lin_in + lin_out) / hbm
    attn_flops = tokens * 2.0 * s * attention_core_dim(model) / t
    if work.flash_attention:
        t_attn = 0.5 * attn_flops / (bf16 * gpu.attention_efficiency_of(work.attention_kernel))
    else:
        t_attn = attn_flops / (bf16 * gpu.gemm_efficiency)
    t_attn = t_attn * ring.causal_imbalance(cp, ring.CP_LOAD_BALANCED)  # busiest CP rank
    # Elements (bf16 units) moved per token by memory-bound kernels. Fused: two norms read and
    # write h (4h), two residual adds read 2h and write h (6h), RoPE reads and writes Q and K,
    # SwiGLU reads two f and writes one (GELU + bias: 4f). Eager PyTorch (fp32-upcast RMSNorm
    # ~6 kernels, 36 bytes per element; complex RoPE ~28 bytes; silu then mul 10 bytes):
    # norms 36h, RoPE 14(q+k), SwiGLU 5f.
    norms = 4 * h if work.fused_kernels else 36 * h
    replicated = norms + 6 * h + (5 * h if work.dropout else 0)
    act_fn = ((3 if work.fused_kernels else 5) if model.mlp_kind == "swiglu" else 4) * f / t
    rope = (2 if work.fused_kernels else 14) * (model.q_size / t + kv_dim)
    softmax = 0.0 if work.flash_attention else (2 + (2.5 if work.dropout else 0)) * a * s / t
    elem_fwd = replicated / np.where(sp, t, 1.0) + act_fn + rope + moe_elem
    t_elem = tokens * ACT_BYTES * (elem_fwd + softmax) / hbm
    t_softmax = tokens * ACT_BYTES * softmax / hbm
    layer_fwd = t_gemm + t_attn + t_elem

    # Output layer and loss (last stage): logits GEMM, fp32 softmax/cross-entropy passes. The
    # output layer stays bf16 under FP8 training: Megatron-Core builds it as its own
    # tensor_parallel.ColumnParallelLinear, which TE's fp8_autocast does not touch
    # (megatron/core/models/gpt/gpt_model.py @41eecc45; an MXFP8 LM head is a later opt-in),
    # torchtitan's Float8 conversion skips it (torchtitan/float8.py @9dec370:
    # module_filter_fn=lambda mod, fqn: fqn != "output"), as does llmopt's (precision/fp8).
    head_fwd = tokens * 2 * h * model.vocab_size / t / (bf16 * gpu.gemm_efficiency)
    head_fwd = head_fwd + tokens * model.vocab_size / t * (ACT_BYTES + 3 * 4) / hbm

    # Layers per rank of the most balanced split (llmopt.plan.split): the busiest non-last rank
    # holds n_mid, the last rank n_last plus the output layer. Per-layer parts first.
    _, n_mid, n_last = rank_layers(model, pp, v)
    n_layers = layers_per_stage(model, pp, v)  # = n_mid: what collectives() counts per rank
    fwd_layer = layer_fwd
    compute_layer = 3 * layer_fwd + expert_w + t_cast
    # Selective: Megatron recomputes the attention core; with flash attention (which already
    # recomputes it) selective means op-level recomputation of the memory-bound ops, and under
    # torchtitan's op-level SAC also every second matmul (Workload.selective).
    if work.flash_attention:
        selective = t_elem - t_softmax
        if work.selective == "every-other-mm":
            selective = selective + _every_other_mm_share(lin_weights) * t_gemm
    else:
        selective = t_attn + t_softmax
    recompute_layer = np.where(
        rc == RC_FULL, layer_fwd, np.where(rc == RC_SELECTIVE, selective, 0.0)
    )

    cs = collectives(model, work, cluster, grid)
    tp_hidden = gpu.comm_overlap_efficiency if work.tp_comm_overlap else 0.0
    tp_layer = (1 - tp_hidden) * _sum_time(cs, cluster, group="tp", stage="all") / m / n_layers
    tp_last = (1 - tp_hidden) * _sum_time(cs, cluster, group="tp", stage="last") / m
    # CP: ring attention's K/V passes, each hidden behind the previous block's attention
    crosses = layout(cluster, grid)["cp"]
    cp_layer = ring.ring_exposed_seconds(model, cluster, grid, s, t_attn, crosses, rc == RC_FULL)
    # EP dispatch/combine per dispatcher, hidden behind the paired micro-batch's compute with
    # A2A overlap or DualPipe (llmopt.plan.dispatch)
    a2a_layer = dispatch.calls_per_microbatch(model, rc == RC_FULL) * dispatch.seconds_per_call(
        model, cluster, grid, tokens, work.ep_dispatcher
    )
    hidden = work.ep_comm_overlap or work.dualpipe
    ep_layer = dispatch.exposed_seconds(
        a2a_layer, compute_layer + recompute_layer, hidden, gpu.comm_overlap_efficiency
    )
    # MoE blocks cannot run faster than the host launches their per-expert kernels
    host_layer = host_seconds_per_block(model, work, grid, expert_gpu)
    per_layer = compute_layer + recompute_layer + tp_layer + cp_layer + ep_layer + host_layer
    # The last stage's extra work per micro-batch: the output layer and loss and, per MTP module
    # (llmopt.plan.split.head_units), one more block (priced as an average block), its 2h->h
    # projection and the output layer again.
    mtp = mtp_layers(model)
    proj_fwd = tokens * 2 * (2 * h * h) / t / gemm_rate
    head_mb = (1 + mtp) * (3 * head_fwd + tp_last) + mtp * (per_layer + 3 * proj_fwd)
    # Each model chunk a rank runs per micro-batch (forward and backward) is a pipeline step:
    # its p2p handshake and the launch gap before its first kernel (CHUNK_STEP_S)
    chunk_steps = np.where(pp > 1, 2 * v * CHUNK_STEP_S, 0.0)
    tau_mid = n_mid * per_layer + chunk_steps
    tau_last = n_last * per_layer + head_mb + chunk_steps
    last_busiest = tau_last >= tau_mid
    n_busy = np.where(last_busiest, n_last, n_mid)
    tau_mean = model.num_layers / pp * per_layer + head_mb / pp
    stages = np.where(work.dualpipe, np.maximum(pp / 2 - 1, 0), pp - 1)  # DualPipe halves it
    bubble = stages / v * tau_mean
    fwd_mb = n_busy * fwd_layer
    recompute_mb = n_busy * recompute_layer
    p2p = _sum_time(
        cs, cluster, group="pp", op="send", stage=("all", "not_first", "not_last", "last")
    )
    # Megatron-Core's interleaved schedule posts the next chunk's send/recv before computing
    # (--overlap-p2p-communication, on by default with virtual stages): the transfers hide
    # behind the chunk computes; Megatron-LM up to 2022 and 1F1B wait for them.
    p2p_hidden = (grid["sched"] == SCHED_INTERLEAVED) & (not work.pp_scatter_gather)
    hide_p2p = gpu.comm_overlap_efficiency * m * tau_mid
    p2p = np.where(p2p_hidden, np.maximum(0.0, p2p - hide_p2p), p2p)

    # Data parallel / ZeRO collectives and what of them hides behind compute; DeepSpeed's
    # ZeRO-3 fetches parameters from module hooks with a bounded prefetch bucket, so less of
    # its traffic hides than behind FSDP's per-layer prefetch streams (SHARDING_OVERLAP).
    hide = (
        gpu.comm_overlap_efficiency * SHARDING_OVERLAP[work.sharding]
        if work.dp_comm_overlap
        else 0.0
    )
    fwd_window = hide * fwd_mb
    bwd_window = hide * (2 * fwd_mb + recompute_mb)  # a recomputed forward runs in backward too
    # Interleaved 1F1B finishes its chunks' last backwards one by one through the cooldown, so
    # Megatron's bucketed grad reduce (and the next step's param gather, during the warm-up)
    # also hides behind about half the bubble (--overlap-grad-reduce / --overlap-param-gather).
    interleaved = grid["sched"] == SCHED_INTERLEAVED
    step_fwd_window = fwd_window + np.where(interleaved, hide * bubble / 2, 0.0)
    step_bwd_window = bwd_window + np.where(interleaved, hide * bubble / 2, 0.0)
    grad_once = _sum_time(cs, cluster, group=DP_GROUPS, phase="step", op="all-reduce", stage="last")
    z = grid["zero"]
    rs_total = _sum_time(cs, cluster, group=DP_GROUPS, op="reduce-scatter", stage="last")
    ag_step = _sum_time(cs, cluster, group=DP_GROUPS, op="all-gather", phase="step", stage="last")
    ag_fwd = (
        _sum_time(cs, cluster, group=DP_GROUPS, op="all-gather", phase="forward", stage="last") / m
    )
    ag_bwd = (
        _sum_time(cs, cluster, group=DP_GROUPS, op="all-gather", phase="backward", stage="last") / m
    )
    # ZeRO-2/3 "step" policy: the one reduce-scatter runs in the last micro-batch's backward
    once = grad_policy(grid) == 1
    rs_mb = np.where(once, 0.0, rs_total / m)
    rs_once = np.where(once, rs_total, 0.0)
    first_layer = 1 / n_layers  # the first bucket/layer's gather cannot hide
    dp01 = np.maximum(0.0, grad_once + rs_total - step_bwd_window) + np.maximum(
        0.0, ag_step - step_fwd_window
    )
    dp2 = m * np.maximum(0.0, rs_mb - bwd_window) + np.maximum(0.0, ag_step - fwd_window)
    dp2 = dp2 + np.maximum(0.0, rs_once - bwd_window)
    dp3 = m * (
        np.maximum(0.0, ag_fwd - fwd_window)
        + np.maximum(0.0, ag_bwd + rs_mb - bwd_window)
        + first_layer * np.where(hide > 0, ag_fwd + rs_mb, 0.0)
    )
    # the last backward shares its window between the weight gathers and the one reduce
    last_bwd = np.maximum(0.0, ag_bwd + rs_once - bwd_window) - np.maximum(0.0, ag_bwd - bwd_window)
    dp3 = dp3 + np.where(once, last_bwd, 0.0)
    dp_exposed = np.where(z <= 1, dp01, np.where(z == 2, dp2, dp3))

    first_p, last_p = stage_params(model, grid)
    opt_params = split_state_bytes(model, np.maximum(first_p, last_p), grid, "zero")
    adam_bytes = ADAM_BYTES_PER_PARAM - (8 if work.moments == "bf16" else 0)  # m, v read+write
    optimizer = opt_params["optimizer"] / 12 * adam_bytes / hbm

    busy_head = np.where(last_busiest, 1.0, 0.0)
    head_compute = (1 + mtp) * 3 * head_fwd + mtp * (compute_layer + 3 * proj_fwd)
    n_blocks = n_busy + busy_head * mtp  # the busiest rank's blocks, MTP blocks included
    out = {
        "compute": m * (n_busy * compute_layer + busy_head * head_compute + chunk_steps),
        "recompute": m * n_blocks * recompute_layer,
        "tp_comm_exposed": m * (n_blocks * tp_layer + busy_head * (1 + mtp) * tp_last),
        "cp_comm_exposed": m * n_blocks * cp_layer,
        "pp_bubble": bubble,
        "pp_p2p": p2p,
        "dp_comm_exposed": dp_exposed,
        "optimizer": optimizer,
    }
    if model.moe is not None:  # MoE-only parts (dense plans' breakdowns stay as they were)
        out.update(
            ep_comm_exposed=m * n_blocks * ep_layer, moe_host_bound=m * n_blocks * host_layer
        )
    out["total"] = sum(out.values())
    return out


def comm_bytes_per_gpu(
    model: ModelConfig, work: Workload, cluster: Cluster, grid: Grid
) -> dict[str, np.ndarray]:
    """Wire bytes one GPU of the busiest (last) stage sends per step, by link. A ring
    collective across nodes with k of its ranks per node leaves each node once per ring on
    each of k NICs: 1/k of a rank's ring traffic goes over its NIC, the rest over NVLink."""
    intra = inter = 0.0
    for c in collectives(model, work, cluster, grid):
        wire = np.where(applies(c.stage, "last", grid["pp"]), c.wire_bytes, 0.0)
        ring = c.op not in ("send", "recv")
        net = wire / np.maximum(c.per_node, 1) if ring else wire
        inter = inter + np.where(c.inter_node, net, 0.0)
        intra = intra + np.where(c.inter_node, wire - net, wire)
    return {"intra_node": np.asarray(intra), "inter_node": np.asarray(inter)}
