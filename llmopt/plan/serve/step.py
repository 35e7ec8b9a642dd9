"""Time of one engine iteration (a forward over a mixed batch of decode tokens and prefill
chunks) on one replica, from FLOPs, HBM bytes and TP all-reduces.

Each kernel class runs at the slower of its compute and its memory traffic (a roofline per
operation, not per step): GEMMs move the weights once per step and do 2 FLOPs per weight per
token; attention reads every decoding sequence's KV cache and does 4·span·q_size FLOPs per
token and layer (`llmopt.plan.flops`). TP costs two all-reduces of the hidden state per layer
on the critical path. A fixed per-iteration host cost covers scheduling, sampling and launches.

Efficiencies are the GPU profile's (catalog.py), shared with the training planner; the only
serving-specific constants are below, each global, none fitted per measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmopt.models.config import ModelConfig
from llmopt.plan.flops import head_flops_fwd_per_token, layer_flops_fwd_per_token
from llmopt.plan.hardware import Cluster
from llmopt.plan.serve.capacity import ACT_BYTES, gemm_weights, kv_bytes_per_token, moe_shape
from llmopt.plan.serve.engines import ENGINE_PROFILES
from llmopt.plan.serve.scenario import WEIGHT_BYTES, Scenario, ServeInputError

# W4A16 GEMMs dequantise in the main loop: Marlin/AWQ kernels reach ~0.8 of a bf16 GEMM at
# large batch (vLLM Marlin benchmarks); at small batch they are memory-bound anyway.
INT4_GEMM_EFFICIENCY_SCALE = 0.8


@dataclass(frozen=True)
class StepCost:
    """Seconds of one iteration, by what bounds each part."""

    gemm_compute_s: float
    weight_read_s: float
    attn_compute_s: float
    kv_read_s: float
    comm_s: float
    overhead_s: float
    tokens: float = 0.0  # tokens the iteration carries (decode + prefill)

    @property
    def gemm_s(self) -> float:
        return max(self.gemm_compute_s, self.weight_read_s)

    @property
    def attention_s(self) -> float:
        return max(self.attn_compute_s, self.kv_read_s)

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.comm_s + self.overhead_s

    def shares(self) -> dict[str, float]:
        """Fraction of the step each limit accounts for (sums to 1)."""
        t = self.total_s
        return {
            "compute": (
                (self.gemm_compute_s if self.gemm_compute_s >= self.weight_read_s else 0.0)
                + (self.attn_compute_s if self.attn_compute_s >= self.kv_read_s else 0.0)
            )
            / t,
            "weight bandwidth": (
                self.weight_read_s if self.weight_read_s > self.gemm_compute_s else 0.0
            )
            / t,
            "KV bandwidth": (self.kv_read_s if self.kv_read_s > self.attn_compute_s else 0.0) / t,
            "interconnect": self.comm_s / t,
            "host overhead": self.overhead_s / t,
        }


def gemm_flops_per_s(cluster: Cluster, precision: str) -> float:
    """Sustained GEMM FLOP/s of one GPU for the weight format."""
    gpu = cluster.gpu
    if precision == "fp8":
        if gpu.peak_fp8_tflops is None:
            raise ServeInputError(
                f"{gpu.name} has no FP8 tensor cores; valid precisions: bf16, int8, int4-awq"
            )
        peak, eff = gpu.peak_fp8_tflops * 1e12, gpu.fp8_gemm_efficiency
    elif precision == "int8":  # INT8 tensor cores: 2x the dense bf16 rate on A100/H100/B200
        peak, eff = 2 * gpu.peak_bf16_tflops * 1e12, gpu.fp8_gemm_efficiency
    elif precision == "int4-awq":
        peak, eff = gpu.peak_bf16_tflops * 1e12, gpu.gemm_efficiency * INT4_GEMM_EFFICIENCY_SCALE
    else:
        peak, eff = gpu.peak_bf16_tflops * 1e12, gpu.gemm_efficiency
    return peak * eff * gpu.clock_scale


def allreduce_s(cluster: Cluster, tp: int, nbytes: float) -> float:
    """Ring all-reduce of `nbytes` over the tp GPUs of a replica (NVLink inside a node)."""
    if tp == 1:
        return 0.0
    link = cluster.intra_node if tp <= cluster.gpus_per_node else cluster.inter_node
    return link.latency_us * 1e-6 + 2 * (tp - 1) / tp * nbytes / link.bytes_per_s


def weights_read(model: ModelConfig, sc: Scenario, tokens: int) -> float:
    """Weight bytes one rank reads in a step of `tokens` tokens: the GEMM weights and the output
    head (the embedding is gathered row by row, not streamed); for an MoE model only the
    experts some token was routed to (uniform routing)."""
    head = model.vocab_size * model.hidden_size * ACT_BYTES / sc.tp
    full = gemm_weights(model, sc.tp) * WEIGHT_BYTES[sc.precision] + head
    moe = moe_shape(model)
    if not moe.is_moe:
        return full
    n_mlp = 3 if model.mlp_kind == "swiglu" else 2
    expert = n_mlp * model.hidden_size * moe.expert_intermediate * WEIGHT_BYTES[sc.precision]
    # the routed experts of the MoE blocks, spread over the replica's tp GPUs (ep of them hold
    # whole experts, tp/ep split each one); each rank reads only those some token picked
    all_experts = moe.num_experts * expert * moe.moe_layers / sc.tp
    touched = moe.num_experts * (1 - (1 - moe.experts_per_token / moe.num_experts) ** tokens)
    return full - all_experts * (1 - touched / moe.num_experts)


def dispatch_s(model: ModelConfig, cluster: Cluster, sc: Scenario, tokens: float) -> float:
    """Expert-parallel dispatch and combine of one step (ep > 1): per MoE block two
    all-to-alls of the step's top_k token copies, (ep-1)/ep of them to other GPUs of the
    replica, in place of the MLP's TP all-reduce over the ep ranks."""
    moe = moe_shape(model)
    if not moe.is_moe or sc.ep == 1:
        return 0.0
    link = cluster.intra_node if sc.tp <= cluster.gpus_per_node else cluster.inter_node
    nbytes = tokens / sc.tp * moe.experts_per_token * model.hidden_size * ACT_BYTES
    per_call = link.latency_us * 1e-6 + (sc.ep - 1) / sc.ep * nbytes / link.bytes_per_s
    return 2 * moe.moe_layers * per_call


class StepModel:
    """`step_cost` for one (model, cluster, scenario), with everything that does not depend on
    the iteration's batch computed once: every term of an iteration is affine in its token
    counts (GEMM FLOPs and all-reduce bytes per token, attention FLOPs and KV bytes per
    token and key), except the weights an MoE step reads, which are cached per token count.
    The scheduler simulation (`simulate.py`) prices thousands of iterations through it."""

    def __init__(self, model: ModelConfig, cluster: Cluster, sc: Scenario) -> None:
        self.model, self.cluster, self.sc = model, cluster, sc
        self.engine = ENGINE_PROFILES[sc.engine]
        gpu = cluster.gpu
        layers = model.num_layers
        dense = layer_flops_fwd_per_token(model, 0)
        flops = gemm_flops_per_s(cluster, sc.precision) * sc.tp
        self._gemm_per_token = layers * dense / flops
        self._head_per_seq = head_flops_fwd_per_token(model) / flops
        attn_peak = gpu.peak_bf16_tflops * 1e12 * gpu.attention_efficiency * gpu.clock_scale
        # attention FLOPs per token grow linearly with the keys it attends
        per_key = layer_flops_fwd_per_token(model, 1) - dense
        self._attn_per_token_key = layers * per_key / sc.tp / attn_peak
        hbm = gpu.hbm_bandwidth_gbs * 1e9 * gpu.hbm_efficiency
        self._hbm = hbm
        self._kv_per_token_key = kv_bytes_per_token(model, sc.tp, sc.kv_dtype) / hbm
        self._moe = moe_shape(model).is_moe
        self._dense_weights_s = weights_read(model, sc, 1) / hbm
        self._weights: dict[int, float] = {}
        row = model.hidden_size * ACT_BYTES
        if sc.tp == 1:
            self._comm0 = self._comm1 = 0.0
        else:  # 2 all-reduces per layer, affine in the tokens
            c0 = allreduce_s(cluster, sc.tp, 0.0)
            c1 = allreduce_s(cluster, sc.tp, row) - c0
            n = 2 * layers - (moe_shape(model).moe_layers if sc.ep > 1 else 0)
            self._comm0, self._comm1 = n * c0, n * c1

    def weight_read_s(self, tokens: float) -> float:
        if not self._moe:
            return self._dense_weights_s
        key = max(1, round(tokens))
        if key not in self._weights:
            self._weights[key] = weights_read(self.model, self.sc, key) / self._hbm
        return self._weights[key]

    def cost(
        self,
        decode: float,
        decode_ctx: float,
        prefill_tokens: float = 0.0,
        prefill_span: float = 0.0,
        prefill_requests: float = 0.0,
        tokens_per_seq: int = 1,
    ) -> StepCost:
        """See `step_cost`."""
        dec = decode * tokens_per_seq
        tokens = dec + prefill_tokens
        comm = self._comm0 + self._comm1 * tokens if self.sc.tp > 1 else 0.0
        if self.sc.ep > 1:  # the MoE blocks' MLP all-reduce becomes dispatch + combine
            comm += dispatch_s(self.model, self.cluster, self.sc, tokens)
        eng = self.engine
        k = eng.gpu_time_scale
        return StepCost(
            gemm_compute_s=k
            * (self._gemm_per_token * tokens + self._head_per_seq * (dec + prefill_requests)),
            weight_read_s=k * self.weight_read_s(tokens),
            attn_compute_s=k
            * self._attn_per_token_key
            * (decode_ctx * dec + prefill_span * prefill_tokens),
            kv_read_s=k * decode * decode_ctx * self._kv_per_token_key,
            comm_s=k * comm,
            overhead_s=eng.overhead_s
            + (eng.eager_layer_s * self.model.num_layers if prefill_tokens else 0.0),
            tokens=tokens,
        )


def step_cost(
    model: ModelConfig,
    cluster: Cluster,
    sc: Scenario,
    decode: float,
    decode_ctx: float,
    prefill_tokens: float = 0.0,
    prefill_span: float = 0.0,
    prefill_requests: float = 0.0,
    tokens_per_seq: int = 1,
) -> StepCost:
    """One iteration carrying `decode` sequences (`tokens_per_seq` tokens each: 1, or k+1 when
    verifying k drafted tokens; `decode_ctx` cached tokens on average) and `prefill_tokens`
    prompt tokens attending `prefill_span` keys on average."""
    return StepModel(model, cluster, sc).cost(
        decode, decode_ctx, prefill_tokens, prefill_span, prefill_requests, tokens_per_seq
    )
