"""Per-GPU memory of a training plan: model states by ZeRO stage, activations, buffers.

Pure, vectorised functions: every argument may be a numpy array (one entry per candidate plan),
so the search and a single `estimate` run the same code, and the training engine can later be
checked against `memory_breakdown` rank by rank.

Activations follow Korthikanti et al. 2022 (arXiv:2205.05198) §4, generalised: per layer and
micro-batch of b sequences of s tokens, bf16 tensors kept for backward are
- replicated across TP ranks unless sequence parallel: the two norm inputs, the QKV and MLP
  inputs (4 × 2sbh) and, with dropout, two 1-byte masks (2 × sbh)          -> 10sbh for GPT;
- split across TP ranks: Q, K, V, the attention-output-projection input and the MLP
  intermediates (GELU: 2 × 2sbf; SwiGLU: 3 × 2sbf)                          -> 24sbh for GPT;
- the s² attention terms without a fused (flash) kernel: softmax output 2as²b, with dropout its
  mask as²b and output 2as²b                                                -> 5as²b for GPT.
That gives Korthikanti's sbh(10 + 24/t + 5as/ht) without SP, sbh·34/t with SP and selective
recomputation (which drops the s² terms), and 2sbh (/t with SP) for the layer input kept under
full recomputation. The first pipeline stage of 1F1B holds min(m, p) micro-batches in flight,
GPipe holds all m, and interleaving (v chunks) holds p + (p-1)/v, i.e. Korthikanti's
(1 + (p-1)/(p·v)) penalty on L layers.

Over 400 lines: model states, activations and buffers add up to one per-GPU total that the
search, the explanation and the engine's check all read; apart they would be three halves of
one sum.
"""

from __future__ import annotations

import numpy as np

from llmopt.errors import UsageError
from llmopt.models.config import ModelConfig
from llmopt.models.moe import attention_params, mlp_params
from llmopt.plan.experts import expert_dp, expert_params_per_rank, moe_activation_bytes
from llmopt.plan.grid import Grid
from llmopt.plan.hardware import GIB, Cluster
from llmopt.plan.recompute import dropped_bytes
from llmopt.plan.split import rank_layers
from llmopt.plan.workload import STATE_BYTES, Workload, optimizer_bytes_per_param

ACT_BYTES = 2  # bf16 activations (FP8 training keeps bf16 activations between GEMMs)
SCHED_GPIPE, SCHED_1F1B, SCHED_INTERLEAVED = 0, 1, 2
RC_NONE, RC_SELECTIVE, RC_FULL = 0, 1, 2


def model_state_bytes(
    num_params: float | np.ndarray,
    zero_stage: int | np.ndarray,
    shard: int | np.ndarray,
    state_bytes: str = "megatron",
    full_grads: int | np.ndarray = 0,
) -> dict[str, np.ndarray]:
    """Weights, gradients and optimizer states of `num_params` parameters on one rank.

    ZeRO stage 1 shards the optimizer states over the `shard` data-parallel ranks, stage 2 also
    the gradients, stage 3 also the weights (Rajbhandari et al. 2019, Fig. 1). `full_grads`
    (the "step" gradient policy, grid key gacc) keeps a full-size gradient buffer under ZeRO-2/3:
    gradients accumulate locally over the micro-batches and are reduce-scattered once.
    """
    w, g, o = STATE_BYTES[state_bytes]
    n = np.asarray(num_params, dtype=np.float64)
    z = np.asarray(zero_stage)
    d = np.asarray(shard, dtype=np.float64)
    return {
        "params": w * n / np.where(z >= 3, d, 1.0),
        "grads": g * n / np.where((z >= 2) & (np.asarray(full_grads) == 0), d, 1.0),
        "optimizer": o * n / np.where(z >= 1, d, 1.0),
    }


def grad_policy(grid: Grid) -> np.ndarray:
    """1 where a ZeRO-2/3 plan accumulates full gradients and reduce-scatters once per step."""
    return grid.get("gacc", np.zeros_like(grid["zero"]))


def kv_heads_per_rank(model: ModelConfig, tp: np.ndarray) -> np.ndarray:
    """KV heads held by one TP rank (replicated when tp exceeds the number of KV heads)."""
    return np.maximum(model.num_kv_heads / np.asarray(tp, dtype=np.float64), 1.0)


def layer_params_per_rank(model: ModelConfig, tp: np.ndarray) -> np.ndarray:
    """Parameters of one block held by one TP rank (norm weights replicated); for MoE blocks
    the non-expert part (`llmopt.plan.experts.expert_params_per_rank` has the rest)."""
    h, hd = model.hidden_size, model.head_dim
    t = np.asarray(tp, dtype=np.float64)
    if model.moe is not None or model.mla is not None:
        mp = mlp_params(model)
        return (attention_params(model) + mp["dense"] + mp["shared"]) / t + mp["router"] + 2 * h
    n_mlp = 3 if model.mlp_kind == "swiglu" else 2
    split = 2 * h * model.q_size + n_mlp * h * model.intermediate_size
    kv = 2 * h * hd * kv_heads_per_rank(model, t)
    bias = 0.0
    if model.attention_bias:
        bias = model.q_size / t + 2 * hd * kv_heads_per_rank(model, t)
    return split / t + kv + bias + 2 * h


def layers_per_stage(model: ModelConfig, pp: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Layers on the most loaded pipeline rank of the most balanced split (`llmopt.plan.split`:
    the last rank, which also runs the output layer, may hold fewer)."""
    return rank_layers(model, pp, v)[1]


def stage_params(model: ModelConfig, grid: Grid) -> tuple[np.ndarray, np.ndarray]:
    """Parameters per rank on the first and on the last pipeline stage.

    The first stage holds the (vocab-parallel) embedding, the last the output layer and final
    norm; with tied embeddings and pp>1 the last stage keeps its own copy (Megatron does).
    Each holds its share of the layers (`llmopt.plan.split.rank_layers`).
    """
    tp, pp = grid["tp"], grid["pp"]
    t = tp.astype(np.float64)
    per_layer = layer_params_per_rank(model, tp) + expert_params_per_rank(model, grid)
    n_first, _, n_last = rank_layers(model, pp, grid["v"])
    emb = model.vocab_size * model.hidden_size / t
    head = np.where(model.tie_embeddings & (pp == 1), 0.0, emb) + model.hidden_size
    first = n_first * per_layer + emb + np.where(pp == 1, head, 0.0)
    last = n_last * per_layer + head + np.where(pp == 1, emb, 0.0)
    return first, last


def activation_bytes_per_layer(
    model: ModelConfig,
    seq_len: int,
    micro_batch: np.ndarray | int,
    tp: np.ndarray | int,
    sp: np.ndarray | int | bool,
    cp: np.ndarray | int = 1,
    recompute: np.ndarray | int = RC_NONE,
    flash_attention: bool = True,
    dropout: bool = False,
    kernels: str = "fused",
    act_bytes: int = ACT_BYTES,
) -> np.ndarray:
    """Bytes kept for backward by one layer for one micro-batch on one rank.

    kernels="fused" (default): Korthikanti's model of fused bf16 kernels (module docstring).
    kernels="eager": what this project's eager engine saves, activations of `act_bytes` each
    (`eager_activation_bytes_per_layer`); it has flash attention and no dropout.
    """
    if kernels not in KERNELS:
        raise UsageError(f"kernels={kernels!r}; choose from {', '.join(KERNELS)}")
    if act_bytes not in (2, 4):
        raise UsageError(f"act_bytes={act_bytes!r}; choose 2 (bf16) or 4 (fp32)")
    if kernels == "eager":
        if not flash_attention or dropout:
            raise UsageError("kernels='eager' models the engine: flash_attention=True, no dropout")
        return eager_activation_bytes_per_layer(
            model, seq_len, micro_batch, tp, sp, cp, recompute, act_bytes
        )
    if act_bytes != ACT_BYTES:
        raise UsageError(
            f"kernels='fused' models bf16 activations; act_bytes={act_bytes} needs 'eager'"
        )
    h, a, f = model.hidden_size, model.num_heads, model.intermediate_size
    t = np.asarray(tp, dtype=np.float64)
    spf = np.asarray(sp, dtype=bool)
    cpf = np.asarray(cp, dtype=np.float64)
    rc = np.asarray(recompute)
    tokens = np.asarray(micro_batch, dtype=np.float64) * seq_len / cpf  # per rank (CP splits s)
    rep_div = np.where(spf, t, 1.0)
    replicated = 4 * ACT_BYTES * h + (2 * h if dropout else 0)
    kv = kv_heads_per_rank(model, t) * model.head_dim
    mlp = (3 if model.mlp_kind == "swiglu" else 2) * ACT_BYTES * f
    split = (2 * ACT_BYTES * model.q_size + mlp) / t + 2 * ACT_BYTES * kv
    if flash_attention:
        scores = 4.0 * a / t  # fp32 log-sum-exp per head and query
    else:
        per_key = ACT_BYTES + (1 + ACT_BYTES if dropout else 0)  # softmax (+ mask, dropout out)
        scores = per_key * a * seq_len / t  # local queries attend to all s keys
    full = tokens * (replicated / rep_div + split + scores)
    if flash_attention:
        # With fused attention there is no s² term to drop; "selective" then means op-level
        # recomputation of the cheap memory-bound ops (torchtitan's selective AC): the norm
        # outputs (QKV and MLP inputs) and the SwiGLU product are rebuilt, GEMM outputs kept.
        dropped = 2 * ACT_BYTES * h / rep_div + (
            ACT_BYTES * f / t if model.mlp_kind == "swiglu" else 0
        )
        selective = full - tokens * dropped
    else:
        selective = full - tokens * scores
    kept_input = tokens * ACT_BYTES * h / rep_div
    return np.where(rc == RC_FULL, kept_input, np.where(rc == RC_SELECTIVE, selective, full))


KERNELS = ("fused", "eager")


def eager_activation_bytes_per_layer(
    model: ModelConfig,
    seq_len: int,
    micro_batch: np.ndarray | int,
    tp: np.ndarray | int,
    sp: np.ndarray | int | bool,
    cp: np.ndarray | int = 1,
    recompute: np.ndarray | int = RC_NONE,
    act_bytes: int = ACT_BYTES,
) -> np.ndarray:
    """Bytes autograd saves for one layer and micro-batch in this project's eager engine
    (`llmopt.models.llama` + `llmopt.parallel.tensor_parallel`, SDPA flash/efficient kernel, no
    dropout), activations of `act_bytes` each (2 = bf16, 4 = fp32). Counted tensor by tensor
    with saved-tensor hooks (one count per storage), per token of the micro-batch:

    - each RMSNorm (2 per layer) saves its fp32 upcast input (4h), the fp32 1/rms (4) and the
      normalised output in the compute dtype before the weight multiply (A·h): (4+A)h + 4,
      on the sequence shard under SP (Korthikanti's model: A·h, the norm input only);
    - the QKV and the MLP inputs (the norm outputs, A·h each), shared by the projections that
      read them; under SP the all-gathered input is a non-contiguous view and every linear
      that reads it saves its own contiguous copy: 3 (q, k, v) + 2 (gate, up) copies;
    - attention: post-RoPE q (A·q/t), k and v (A·kv each, GQA heads of this rank), the output
      (A·q/t, also the output projection's input, same storage) and the fp32 log-sum-exp per head (4a/t).
      RoPE itself keeps no activation (x·cos and rotate(x)·sin save cos and sin only, see
      `rope_table_bytes`);
    - SwiGLU: gate output, silu output, up output and their product (the down projection's input),
      4·A·f/t (fused model: 3); GELU: its input and output, 2·A·f/t;
    - selective recompute (the engine checkpoints the attention core): its inputs q, k, v stay
      saved and the output projection keeps its own input, so only the log-sum-exp (4a/t) is dropped;
    - full recompute (per-block checkpoint): the block input, A·h (/t under SP).
    Residual adds save nothing. No s² term: the SDPA kernel is memory-efficient.
    """
    h, a, f = model.hidden_size, model.num_heads, model.intermediate_size
    t = np.asarray(tp, dtype=np.float64)
    spf = np.asarray(sp, dtype=bool)
    rc = np.asarray(recompute)
    tokens = np.asarray(micro_batch, dtype=np.float64) * seq_len / np.asarray(cp, np.float64)
    rep_div = np.where(spf, t, 1.0)
    norms = 2 * ((4 + act_bytes) * h + 4) / rep_div
    mlp_inputs = 2 if model.mlp_kind == "swiglu" else 1
    linear_inputs = act_bytes * h * np.where(spf & (t > 1), 3 + mlp_inputs, 2)
    kv = kv_heads_per_rank(model, t) * model.head_dim
    attention = act_bytes * (2 * model.q_size / t + 2 * kv)
    lse = 4.0 * a / t
    mlp = (4 if model.mlp_kind == "swiglu" else 2) * act_bytes * f / t
    full = tokens * (norms + linear_inputs + attention + lse + mlp)
    selective = full - tokens * lse
    kept_input = tokens * act_bytes * h / rep_div
    return np.where(rc == RC_FULL, kept_input, np.where(rc == RC_SELECTIVE, selective, full))


def rope_table_bytes(model: ModelConfig, rows: int, act_bytes: int = ACT_BYTES) -> float:
    """cos and sin tables [rows, head_dim] kept by RoPE's backward: one pair per micro-batch
    and pipeline chunk in the eager engine (shared by its layers). rows = the sequence length
    when the fp32 tables are cast to a bf16 compute dtype each forward (a fresh slice-sized
    copy); max_seq_len when the tables already have the compute dtype (the slice is a view and
    keeps the whole table's storage alive)."""
    return 2.0 * act_bytes * rows * model.head_dim


def microbatches_in_flight(
    pp: np.ndarray, m: np.ndarray, v: np.ndarray, sched: np.ndarray
) -> np.ndarray:
    """Micro-batches whose activations the first stage holds at its peak (in layer-chunk units
    of its own layers: interleaving's extra in-flight chunks count as (p-1)/v)."""
    return microbatches_in_flight_on_rank(pp, m, v, sched, 0)


def microbatches_in_flight_on_rank(
    pp: np.ndarray, m: np.ndarray, v: np.ndarray, sched: np.ndarray, rank: np.ndarray | int
) -> np.ndarray:
    """Peak micro-batches (in units of the rank's whole stage) held by pipeline rank `rank`.

    GPipe: all m. 1F1B: p − r warm-up micro-batches. Interleaved (Megatron's warm-up of
    2(p−r−1) + (v−1)p chunk forwards, then one more in flight): (2(p−r−1) + (v−1)p + 1) chunks
    of 1/v stage each, i.e. p + (p−1)/v on the first rank; when p does not divide m, at least
    the (v−1)(p + m mod p) + 1 chunks of the enlarged last group's warm-up. Never more than all
    m micro-batches (the schedule has no more to run).
    """
    p = np.asarray(pp, dtype=np.float64)
    m = np.asarray(m, dtype=np.float64)
    vv = np.asarray(v, dtype=np.float64)
    r = np.asarray(rank, dtype=np.float64)
    one_f_one_b = np.minimum(m, p - r)
    # m not a multiple of p: the engine's schedule enlarges its last group to p + rem
    # micro-batches, whose warm-up holds (v-1)(p+rem) + 1 chunks on every rank.
    rem = np.where(m > p, np.mod(m, p), 0.0)
    chunks = np.maximum(2 * (p - r - 1) + (vv - 1) * p + 1, (vv - 1) * (p + rem) + 1)
    interleaved = np.minimum(m, chunks / vv)
    return np.where(
        sched == SCHED_GPIPE, m, np.where(sched == SCHED_1F1B, one_f_one_b, interleaved)
    )


def split_state_bytes(
    model: ModelConfig,
    stage_p: np.ndarray,
    grid: Grid,
    state_bytes: str,
    n_layers: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Model states of a stage's `stage_p` parameters per rank (`n_layers` of them in blocks;
    default the busiest rank's): dense parts ZeRO-sharded over dp·cp, routed experts over
    their expert-data-parallel ranks (`experts.expert_dp`)."""
    if n_layers is None:
        n_layers = layers_per_stage(model, grid["pp"], grid["v"])
    experts = n_layers * expert_params_per_rank(model, grid)
    z, full = grid["zero"], grad_policy(grid)
    dense = model_state_bytes(stage_p - experts, z, grid["dp"] * grid["cp"], state_bytes, full)
    routed = model_state_bytes(experts, z, expert_dp(grid), state_bytes, full)
    return {k: dense[k] + routed[k] for k in dense}


def memory_breakdown(
    model: ModelConfig, work: Workload, cluster: Cluster, grid: Grid
) -> dict[str, np.ndarray]:
    """Peak bytes per GPU of each plan in `grid` (max over first and last pipeline stage).

    Keys: params, grads, optimizer, activations, other, total, usable (all bytes), fits (bool).
    `other` = output-layer logits and fp32 loss buffers (last stage, one micro-batch), the
    sequence-parallel all-gather buffer, ZeRO-3 prefetch buffers (two unsharded layers) and
    the runtime reservation of the GPU profile.
    """
    tp, pp, cp, mb = grid["tp"], grid["pp"], grid["cp"], grid["mb"]
    t = tp.astype(np.float64)
    first_p, last_p = stage_params(model, grid)
    s = work.seq_len
    moe_extra = moe_activation_bytes(model, mb * s / cp, tp)
    per_layer = activation_bytes_per_layer(
        model, s, mb, tp, grid["sp"], cp, grid["rc"], work.flash_attention, work.dropout
    ) + np.where(grid["rc"] == RC_FULL, 0.0, moe_extra)
    modules = getattr(work, "recompute_modules", ())
    if modules:  # Megatron-Core's named modules replace the planner's own selective set
        keep_all = activation_bytes_per_layer(
            model, s, mb, tp, grid["sp"], cp, RC_NONE, work.flash_attention, work.dropout
        )
        named = keep_all + moe_extra - dropped_bytes(model, mb * s / cp, tp, grid["sp"], modules)
        per_layer = np.where(grid["rc"] == RC_SELECTIVE, np.maximum(named, 0.0), per_layer)
    n_first, _, n_last = rank_layers(model, pp, grid["v"])
    inflight = microbatches_in_flight(pp, grid["m"], grid["v"], grid["sched"])
    act_first = per_layer * n_first * inflight
    # Full recompute rebuilds one layer's activations at a time during backward.
    working = moe_extra + activation_bytes_per_layer(
        model, s, mb, tp, grid["sp"], cp, RC_NONE, work.flash_attention, work.dropout
    )
    act_first = act_first + np.where(grid["rc"] == RC_FULL, working, 0.0)
    inflight_last = microbatches_in_flight_on_rank(pp, grid["m"], grid["v"], grid["sched"], pp - 1)
    act_last = np.where(
        pp == 1,
        act_first,
        per_layer * n_last * inflight_last + np.where(grid["rc"] == 2, working, 0.0),
    )
    tokens = mb * s / cp
    logits = tokens * model.vocab_size / t * (ACT_BYTES + 4)  # bf16 logits + fp32 softmax/grad
    sp_buffer = np.where(grid["sp"] == 1, tokens * model.hidden_size * ACT_BYTES, 0.0)
    zero3_buf = np.where(
        grid["zero"] >= 3,
        2 * layer_params_per_rank(model, tp) * STATE_BYTES[work.state_bytes][0],
        0.0,
    )
    runtime = cluster.gpu.runtime_reserved_gib * GIB
    shard = grid["dp"] * grid["cp"]
    states = lora_model_states if getattr(work, "lora_rank", 0) else _full_model_states
    states_first = states(model, work, grid, first_p, shard, first=True)
    states_last = states(model, work, grid, last_p, shard, first=False)
    other_first = sp_buffer + zero3_buf + np.where(pp == 1, logits, 0.0)
    other_last = sp_buffer + zero3_buf + logits
    total_first = sum(states_first.values()) + act_first + other_first
    total_last = sum(states_last.values()) + act_last + other_last
    use_last = total_last > total_first
    out = {key: np.where(use_last, states_last[key], states_first[key]) for key in states_first}
    out["activations"] = np.where(use_last, act_last, act_first)
    out["other"] = np.where(use_last, other_last, other_first)
    out["total"] = np.maximum(total_first, total_last)
    usable = cluster.gpu.usable_bytes + runtime  # `other` already counts the runtime below
    out["other"] = out["other"] + runtime
    out["total"] = out["total"] + runtime
    out["usable"] = np.full_like(out["total"], usable)
    out["fits"] = out["total"] <= usable
    return out


def _full_model_states(model, work, grid, stage_p, shard, first: bool) -> dict[str, np.ndarray]:
    n_first, _, n_last = rank_layers(model, grid["pp"], grid["v"])
    out = split_state_bytes(model, stage_p, grid, work.state_bytes, n_first if first else n_last)
    moments = getattr(work, "moments", "fp32")
    out["optimizer"] = out["optimizer"] * optimizer_bytes_per_param(moments) / 12
    if getattr(work, "dualpipe", False):  # DualPipe keeps a second copy of the stage's weights
        out["params"] = out["params"] * np.where(grid["pp"] > 1, 2.0, 1.0)
    return out


QLORA_BYTES_PER_PARAM = 0.5 + 3 / 64  # INT4 codes + an fp16 scale and a uint8 zero per 64


def adapter_params_per_layer(model: ModelConfig, rank: int, tp: np.ndarray) -> np.ndarray:
    """LoRA parameters r·(in + out) of every linear of one block, on one TP rank."""
    h, i, q = model.hidden_size, model.intermediate_size, model.q_size
    kv = model.head_dim * kv_heads_per_rank(model, tp) * np.asarray(tp, dtype=np.float64)
    n_mlp = 3 if model.mlp_kind == "swiglu" else 2
    fan = 2 * (h + q) + 2 * (h + kv) + n_mlp * (h + i)
    return rank * fan / np.asarray(tp, dtype=np.float64)


def lora_model_states(model, work, grid, stage_p, shard, first: bool) -> dict[str, np.ndarray]:
    """Model states of LoRA/QLoRA fine-tuning on one rank: only the adapters get gradients,
    fp32 masters and Adam moments (ZeRO shards those); the frozen base weights are bf16 (or
    packed INT4 for the block linears with QLoRA) and replicated (ZeRO-3 included)."""
    w, g, _ = STATE_BYTES[work.state_bytes]
    o = optimizer_bytes_per_param(getattr(work, "moments", "fp32"))
    tp, z = grid["tp"], np.asarray(grid["zero"])
    d = np.asarray(shard, dtype=np.float64)
    layers = layers_per_stage(model, grid["pp"], grid["v"])
    n_adapt = layers * adapter_params_per_layer(model, work.lora_rank, tp)
    linears = layers * (layer_params_per_rank(model, tp) - 2 * model.hidden_size)
    base_linear_bytes = QLORA_BYTES_PER_PARAM if work.qlora else w
    frozen = (stage_p - linears) * w + linears * base_linear_bytes
    return {
        "params": frozen + w * n_adapt / np.where(z >= 3, d, 1.0),
        "grads": g * n_adapt / np.where(z >= 2, d, 1.0),
        "optimizer": o * n_adapt / np.where(z >= 1, d, 1.0),
    }
