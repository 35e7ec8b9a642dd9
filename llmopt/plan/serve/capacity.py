"""Memory of one serving GPU: weights + activation workspace + runtime reserve vs HBM, and what
is left for the KV cache, in tokens and in concurrent sequences.

KV bytes per token are GQA-aware: 2 (K and V) x layers x KV heads held by this rank x head_dim
x dtype bytes. With tp above the KV-head count each rank keeps one KV head (replicated), as
vLLM and TRT-LLM do. Sequences are admitted with their whole final length reserved (I + O
rounded up to KV blocks): TRT-LLM's default GUARANTEED_NO_EVICT policy, under which no running
request is ever preempted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmopt.models.config import ModelConfig
from llmopt.models.moe import num_moe_layers
from llmopt.plan.hardware import GIB, GPUProfile
from llmopt.plan.serve.scenario import KV_BYTES, WEIGHT_BYTES, Scenario, ServeInputError

KV_BLOCK_TOKENS = 32  # TRT-LLM tokens_per_block default (vLLM: 16); a sequence holds whole blocks
ACT_BYTES = 2  # bf16 activations (fp8/int8 GEMMs take bf16 in and quantise on the fly)
LOGIT_BYTES = 4  # fp32 logits for sampling


@dataclass(frozen=True)
class MoEShape:
    """Routed experts of an MoE model (dense models: num_experts = 0), from `ModelConfig.moe`:
    the planner's one description of experts (`llmopt.models.moe.MoEConfig`)."""

    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1


def moe_shape(model: ModelConfig) -> MoEShape:
    """The routed experts of `model`; a dense model (no `moe`) gives MoEShape()."""
    moe = getattr(model, "moe", None)
    if moe is None or moe.num_experts <= 1:
        return MoEShape()
    return MoEShape(moe.num_experts, moe.top_k, moe.expert_ffn_hidden, num_moe_layers(model))


def kv_heads_per_rank(model: ModelConfig, tp: int) -> int:
    """KV heads one TP rank holds; tp and the KV-head count must divide one another."""
    heads = model.num_heads
    if heads % tp:
        valid = ", ".join(str(t) for t in range(1, min(heads, 64) + 1) if heads % t == 0)
        raise ServeInputError(
            f"tp={tp} does not divide the {heads} attention heads of {model.name}; "
            f"valid tp: {valid}"
        )
    kv = model.num_kv_heads
    if kv % tp and tp % kv:
        raise ServeInputError(
            f"tp={tp} and the {kv} KV heads of {model.name} must divide one another"
        )
    return max(1, kv // tp)


def kv_bytes_per_token(model: ModelConfig, tp: int, kv_dtype: str) -> int:
    """KV-cache bytes one token costs on one TP rank. Multi-head latent attention (DeepSeek)
    caches one compressed latent and the decoupled RoPE key per layer, kv_lora_rank +
    qk_rope_head_dim values, which every TP rank holds whole (vLLM's and SGLang's MLA caches);
    other models cache K and V of the KV heads the rank holds."""
    mla = getattr(model, "mla", None)
    if mla is not None:
        return model.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * KV_BYTES[kv_dtype]
    heads = kv_heads_per_rank(model, tp)
    return 2 * model.num_layers * heads * model.head_dim * KV_BYTES[kv_dtype]


def gemm_weights(model: ModelConfig, tp: int) -> float:
    """GEMM weights (all layers, all experts) held by one TP rank, counting replicated KV heads."""
    h, layers = model.hidden_size, model.num_layers
    norms = 2 * h * layers + h
    head = 0 if model.tie_embeddings else model.vocab_size * h
    total = model.num_parameters() - model.embedding_parameters() - head - norms
    if getattr(model, "mla", None) is not None:  # latent projections split over the heads
        return total / tp
    replicated = (kv_heads_per_rank(model, tp) * tp - model.num_kv_heads) * model.head_dim
    return total / tp + 2.0 * h * replicated * layers / tp


def embedding_bytes(model: ModelConfig, tp: int) -> float:
    """Embedding and output head of one rank (vocab-parallel, kept in bf16 by every engine)."""
    tables = 1 if model.tie_embeddings else 2
    return tables * model.vocab_size * model.hidden_size * ACT_BYTES / tp


def weight_bytes(model: ModelConfig, tp: int, precision: str) -> float:
    """HBM one rank spends on weights."""
    return gemm_weights(model, tp) * WEIGHT_BYTES[precision] + embedding_bytes(model, tp)


def activation_bytes(model: ModelConfig, sc: Scenario) -> float:
    """Peak workspace of one step of max_num_tokens tokens: residual stream, QKV, the MLP's
    up-projection (both SwiGLU halves), plus fp32 logits of the sequences sampled."""
    moe = moe_shape(model)
    inter = moe.expert_intermediate * max(moe.experts_per_token, 1) if moe.is_moe else None
    inter = max(inter or 0, model.intermediate_size)
    n_up = 2 if model.mlp_kind == "swiglu" else 1
    kv = 0 if getattr(model, "mla", None) is not None else 2 * model.kv_size
    per_token = 3 * model.hidden_size + (model.q_size + kv + n_up * inter) / sc.tp
    logits = min(sc.max_num_seqs, sc.max_num_tokens) * model.vocab_size / sc.tp * LOGIT_BYTES
    return sc.max_num_tokens * per_token * ACT_BYTES + logits


@dataclass(frozen=True)
class Capacity:
    """HBM of one GPU of a replica and the KV cache it leaves."""

    hbm_bytes: float
    weight_bytes: float
    activation_bytes: float
    reserved_bytes: float
    kv_cache_bytes: float
    kv_bytes_per_token: int
    kv_tokens: int
    tokens_per_sequence: int  # I + O rounded up to whole KV blocks
    max_batch_kv: int  # sequences the KV cache holds at their full length
    max_batch: int  # the above capped by the scheduler's max_num_seqs

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def capacity(model: ModelConfig, gpu: GPUProfile, sc: Scenario) -> Capacity:
    """KV capacity and max batch of one replica (every rank holds the same share)."""
    moe = moe_shape(model)
    if sc.ep > 1 and not moe.is_moe:
        raise ServeInputError(f"ep={sc.ep} needs an MoE model; {model.name} is dense (use ep=1)")
    if moe.is_moe and moe.num_experts % sc.ep:
        raise ServeInputError(
            f"ep={sc.ep} does not divide the {moe.num_experts} experts of {model.name}"
        )
    hbm = gpu.hbm_gib * GIB
    reserved = gpu.runtime_reserved_gib * GIB
    weights = weight_bytes(model, sc.tp, sc.precision)
    act = activation_bytes(model, sc)
    free = hbm - reserved - weights - act
    if free <= 0:
        need = (weights + act + reserved) / GIB
        raise ServeInputError(
            f"{model.name} in {sc.precision} at tp={sc.tp} needs {need:.1f} GiB per GPU "
            f"(weights {weights / GIB:.1f} GiB) but {gpu.name} has {gpu.hbm_gib:g} GiB; "
            "raise --tp or use a smaller --precision"
        )
    kv_cache = free * sc.kv_fraction
    per_token = kv_bytes_per_token(model, sc.tp, sc.kv_dtype)
    kv_tokens = int(kv_cache // per_token)
    blocks = math.ceil((sc.input_len + sc.output_len) / KV_BLOCK_TOKENS)
    per_seq = blocks * KV_BLOCK_TOKENS
    max_kv = kv_tokens // per_seq
    if max_kv < 1:
        raise ServeInputError(
            f"one sequence of {sc.input_len}+{sc.output_len} tokens needs "
            f"{per_seq * per_token / GIB:.2f} GiB of KV cache per GPU but only "
            f"{kv_cache / GIB:.2f} GiB is left after the weights; raise --tp or shorten it"
        )
    return Capacity(
        hbm_bytes=hbm,
        weight_bytes=weights,
        activation_bytes=act,
        reserved_bytes=reserved,
        kv_cache_bytes=kv_cache,
        kv_bytes_per_token=per_token,
        kv_tokens=kv_tokens,
        tokens_per_sequence=per_seq,
        max_batch_kv=max_kv,
        max_batch=min(max_kv, sc.max_num_seqs),
    )
