"""Mixture-of-experts and multi-head-latent-attention shapes, and the HF config keys that
announce them.

The planner counts parameters and FLOPs of Mixtral, Qwen3-MoE, DeepSeek-V3 and GPT-OSS from
these shapes without building anything; llmopt's model builds the MoE block they describe
(`llmopt.models.experts`) for the architectures whose spec names experts. `moe_keys` finds the
MoE keys of a `config.json` whatever its `architectures` entry claims, so a MoE model is never
read as a dense one. Pure data: no torch, and no import of `llmopt.models.config` (which
imports this module), so the counting functions take any object with ModelConfig's shape
fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmopt.errors import LlmoptError

# Keys whose presence (with more than one expert) makes a HF config a MoE model.
EXPERT_COUNT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
# Keys only MoE configs carry; with no expert count they mean a layout llmopt cannot read.
MOE_ONLY_KEYS = (
    "num_experts_per_tok",
    "experts_per_token",
    "moe_intermediate_size",
    "n_shared_experts",
    "shared_expert_intermediate_size",
    "moe_layer_freq",
    "first_k_dense_replace",
    "decoder_sparse_step",
    "moe_k",
    "moe_topk",
)


class MoEConfigError(LlmoptError, ValueError):
    """A mixture-of-experts shape that is inconsistent or that llmopt cannot read."""


def _positive(obj: object, *names: str, allow_zero: tuple[str, ...] = ()) -> None:
    for name in names:
        v = getattr(obj, name)
        low = 0 if name in allow_zero else 1
        if v is None and name not in allow_zero:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            kind = "a non-negative" if low == 0 else "a positive"
            raise MoEConfigError(f"{name}={v!r} must be {kind} integer")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of a MoE transformer.

    `moe_layers` blocks (the last ones; None = every block) replace the dense MLP by
    `num_experts` experts of hidden size `expert_ffn_hidden`, of which each token uses `top_k`,
    plus `shared_experts` always-on experts of `shared_ffn_hidden` each (DeepSeek, Qwen2-MoE).
    `mtp_layers` are DeepSeek-V3's multi-token-prediction modules (each one more MoE block and
    one more output layer per token).

    The routing fields are what llmopt's MoE block (`llmopt.models.experts`) computes; the
    planner reads none of them. `score`: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3) of the
    router logits; `norm_topk`: the top-k weights renormalised to sum 1; `route_scale`: the
    routed output's factor (DeepSeek-V3's routed_scaling_factor). `num_groups`/`topk_groups`:
    DeepSeek's group-limited routing (each token picks among the experts of its best
    `topk_groups` groups, groups scored by their two best experts). `expert_bias`: the
    aux-loss-free balancing bias (added to the scores for the choice only), moved by
    `bias_update_rate` per optimizer step against each expert's load. `shared_gate`: Qwen2-MoE's
    sigmoid gate on the shared expert. `aux_loss_coef` / `z_loss_coef`: the Switch/GShard
    load-balancing loss and the router z-loss. `capacity_factor`: None routes dropless; a factor
    c caps every expert at ceil(c * tokens * top_k / num_experts) tokens per micro-batch and
    rank, dropping the lowest-scored assignments beyond it. `force_balance` (benchmarks only,
    Megatron's --moe-router-force-load-balancing): token t's k-th choice is expert
    (t * top_k + k) mod num_experts, so every expert gets the same tokens whatever the scores.
    """

    num_experts: int
    top_k: int
    expert_ffn_hidden: int
    moe_layers: int | None = None
    shared_experts: int = 0
    shared_ffn_hidden: int | None = None
    mtp_layers: int = 0
    score: str = "softmax"
    norm_topk: bool = True
    route_scale: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    expert_bias: bool = False
    shared_gate: bool = False
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    capacity_factor: float | None = None
    bias_update_rate: float = 0.0
    force_balance: bool = False

    def __post_init__(self) -> None:
        _positive(self, "num_experts", "top_k", "expert_ffn_hidden", "moe_layers")
        _positive(self, "shared_experts", "mtp_layers", allow_zero=("shared_experts", "mtp_layers"))
        if self.shared_ffn_hidden is not None:
            _positive(self, "shared_ffn_hidden")
        if self.num_experts < 2:
            raise MoEConfigError(f"num_experts={self.num_experts} must be at least 2")
        if self.top_k > self.num_experts:
            raise MoEConfigError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        check_routing(self)

    @property
    def shared_hidden(self) -> int:
        return self.expert_ffn_hidden if self.shared_ffn_hidden is None else self.shared_ffn_hidden


SCORES = ("softmax", "sigmoid")


def _number(obj: object, name: str, low: float, inclusive: bool = True) -> None:
    v = getattr(obj, name)
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v < low or (v == low and not inclusive):
        bound = f">= {low:g}" if inclusive else f"> {low:g}"
        raise MoEConfigError(f"{name}={v!r} must be a finite number {bound}")


def check_routing(m: MoEConfig) -> None:
    """Refuse routing settings the MoE block cannot run, naming the value and the valid ones."""
    if m.score not in SCORES:
        raise MoEConfigError(f"score={m.score!r} is not a router scoring; choose {SCORES}")
    for name in ("norm_topk", "expert_bias", "shared_gate", "force_balance"):
        if not isinstance(getattr(m, name), bool):
            raise MoEConfigError(f"{name}={getattr(m, name)!r} must be true or false")
    _positive(m, "num_groups", "topk_groups")
    if m.num_experts % m.num_groups:
        raise MoEConfigError(
            f"num_groups={m.num_groups} does not divide num_experts={m.num_experts}"
        )
    if m.topk_groups > m.num_groups:
        raise MoEConfigError(f"topk_groups={m.topk_groups} exceeds num_groups={m.num_groups}")
    per_group = m.num_experts // m.num_groups
    if m.num_groups > 1 and (per_group < 2 or m.top_k > m.topk_groups * per_group):
        raise MoEConfigError(
            f"group-limited routing needs >= 2 experts per group and top_k={m.top_k} <= "
            f"topk_groups*experts per group = {m.topk_groups * per_group}"
        )
    _number(m, "route_scale", 0.0, inclusive=False)
    for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        _number(m, name, 0.0)
    if m.capacity_factor is not None:
        _number(m, "capacity_factor", 0.0, inclusive=False)
    if m.bias_update_rate and not m.expert_bias:
        raise MoEConfigError(
            f"bias_update_rate={m.bias_update_rate} needs expert_bias=true (the balancing bias)"
        )


def is_moe_layer(m: Any, layer_idx: int) -> bool:
    """Whether block `layer_idx` of model config `m` has experts (the last `moe_layers`)."""
    return getattr(m, "moe", None) is not None and layer_idx >= m.num_layers - num_moe_layers(m)


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: queries through a rank-`q_lora_rank` bottleneck
    (None: a plain projection), keys and values through a shared rank-`kv_lora_rank` latent,
    a decoupled RoPE part of `qk_rope_head_dim` per head (`rope_interleave`: its pairs stored
    interleaved, as DeepSeek's checkpoints do; llmopt's model reads it, the planner does not)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        _positive(
            self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "q_lora_rank",
        )  # fmt: skip


def moe_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """The MoE keys of a HF config that are set (expert counts above 1, other MoE-only keys not
    null/zero): empty for a dense model."""
    found = {k: hf[k] for k in EXPERT_COUNT_KEYS if k in hf and hf[k] not in (None, 0, 1)}
    found.update({k: hf[k] for k in MOE_ONLY_KEYS if hf.get(k) not in (None, 0)})
    return found


# ---- counts (the planner's FLOPs and memory read these; `m` is a ModelConfig) ----


def n_mlp(m: Any) -> int:
    """Weight matrices of one MLP (SwiGLU: gate, up, down; GELU: up, down)."""
    return 3 if m.mlp == "swiglu" else 2


def attention_params(m: Any) -> int:
    """Weights of one block's attention projections (GQA or MLA)."""
    h, a = m.hidden_size, m.num_heads
    mla: MLAConfig | None = getattr(m, "mla", None)
    if mla is None:
        return 2 * h * m.num_heads * m.head_dim + 2 * h * m.num_kv_heads * m.head_dim
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    q = h * a * qk if mla.q_lora_rank is None else mla.q_lora_rank * (h + a * qk)
    kv = h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv += mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv + a * mla.v_head_dim * h


def attention_core_dim(m: Any) -> int:
    """heads·(query-key dim + value dim): full (non-causal) attention costs 2·s·this FLOPs per
    token forward (QKᵀ and ·V)."""
    mla: MLAConfig | None = getattr(m, "mla", None)
    if mla is None:
        return 2 * m.num_heads * m.head_dim
    return m.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)


def num_moe_layers(m: Any) -> int:
    moe: MoEConfig | None = getattr(m, "moe", None)
    if moe is None:
        return 0
    return m.num_layers if moe.moe_layers is None else moe.moe_layers


def mlp_params(m: Any) -> dict[str, float]:
    """MLP weights per block averaged over the blocks: dense MLPs, routed experts (all of them),
    routed experts a token uses (top_k), shared experts and the router."""
    dense = n_mlp(m) * m.hidden_size * m.intermediate_size
    moe: MoEConfig | None = getattr(m, "moe", None)
    if moe is None:
        return {"dense": float(dense), "experts": 0.0, "active": 0.0, "shared": 0.0, "router": 0.0}
    frac = num_moe_layers(m) / m.num_layers
    expert = n_mlp(m) * m.hidden_size * moe.expert_ffn_hidden
    shared = moe.shared_experts * n_mlp(m) * m.hidden_size * moe.shared_hidden
    return {
        "dense": (1 - frac) * dense,
        "experts": frac * moe.num_experts * expert,
        "active": frac * moe.top_k * expert,
        "shared": frac * shared,
        "router": frac * m.hidden_size * moe.num_experts,
    }


def mtp_params(m: Any) -> float:
    """DeepSeek-V3 MTP module weights besides its block: the 2h→h projection and two norms
    (the embedding and output layer are shared with the main model)."""
    moe: MoEConfig | None = getattr(m, "moe", None)
    return 0.0 if moe is None else moe.mtp_layers * (2 * m.hidden_size**2 + 2 * m.hidden_size)


def mtp_block_params(m: Any) -> float:
    """Weights a token's GEMMs use in one MTP module: a MoE block (attention, router, top_k
    routed and the shared experts) and the 2h->h projection."""
    moe: MoEConfig | None = getattr(m, "moe", None)
    if moe is None:
        return 0.0
    h = m.hidden_size
    ffn = moe.top_k * moe.expert_ffn_hidden + moe.shared_experts * moe.shared_hidden
    return attention_params(m) + n_mlp(m) * h * ffn + h * moe.num_experts + 2 * h * h


def parameter_counts(m: Any) -> dict[str, int]:
    """Total and active (per token) parameters, embedding and output layer included; each MTP
    module counts one more MoE block."""
    h = m.hidden_size
    mp = mlp_params(m)
    moe: MoEConfig | None = getattr(m, "moe", None)
    attn = attention_params(m) + 2 * h
    total = m.num_layers * (attn + mp["dense"] + mp["experts"] + mp["shared"] + mp["router"])
    active = m.num_layers * (attn + mp["dense"] + mp["active"] + mp["shared"] + mp["router"])
    if moe is not None and moe.mtp_layers:
        expert = n_mlp(m) * h * moe.expert_ffn_hidden
        shared = moe.shared_experts * n_mlp(m) * h * moe.shared_hidden + h * moe.num_experts
        total += moe.mtp_layers * (attn + moe.num_experts * expert + shared)
        active += moe.mtp_layers * (attn + moe.top_k * expert + shared)
    emb = m.vocab_size * h
    rest = emb + (0 if m.tie_embeddings else emb) + h + mtp_params(m)
    return {"total": round(total + rest), "active": round(active + rest)}
