"""HF `config.json` keys of the mixture-of-experts architectures (Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V3): their experts, routing and (DeepSeek) latent attention, read into
`MoEConfig` / `MLAConfig` and written back, with what a layout cannot express refused by
name. `moe_layout` (the shapes alone, recognised by their keys) is also the planner's reader
(`llmopt.models.moe_hf`). No torch, no `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from llmopt.models.errors import ConfigError
from llmopt.models.moe import MLAConfig, MoEConfig, MoEConfigError, moe_keys
from llmopt.models.spec import ModelSpec

# ---- shapes ----
_MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def hf_int(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    v = hf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise MoEConfigError(f"{key}={v!r} must be a non-negative integer")
    return v


def _top_k(hf: dict[str, Any]) -> int:
    for key in ("num_experts_per_tok", "experts_per_token"):
        if key in hf:
            return hf_int(hf, key)
    raise MoEConfigError("MoE config has no num_experts_per_tok (experts each token uses)")


def moe_layout(hf: dict[str, Any]) -> tuple[MoEConfig, MLAConfig | None]:
    """The expert (and latent-attention) shapes of a MoE config.json, recognised by its keys."""
    layers = hf_int(hf, "num_hidden_layers")
    if "n_routed_experts" in hf and "moe_intermediate_size" in hf:  # DeepSeek
        dense = hf_int(hf, "first_k_dense_replace", 0)
        if hf_int(hf, "moe_layer_freq", 1) != 1:
            raise MoEConfigError(f"moe_layer_freq={hf['moe_layer_freq']} is not supported; use 1")
        mla = None
        if all(k in hf for k in _MLA_KEYS):
            q = hf.get("q_lora_rank")
            mla = MLAConfig(*(hf_int(hf, k) for k in _MLA_KEYS), q_lora_rank=q)
        moe = MoEConfig(
            num_experts=hf_int(hf, "n_routed_experts"),
            top_k=_top_k(hf),
            expert_ffn_hidden=hf_int(hf, "moe_intermediate_size"),
            moe_layers=layers - dense,
            shared_experts=hf_int(hf, "n_shared_experts", 0),
            mtp_layers=hf_int(hf, "num_nextn_predict_layers", 0),
        )
        return moe, mla
    count = "num_experts" if "num_experts" in hf else "num_local_experts"
    if count in hf and "moe_intermediate_size" in hf:  # Qwen-MoE (transformers 5: local)
        step = hf_int(hf, "decoder_sparse_step", 1)
        only = set(hf.get("mlp_only_layers") or [])
        n_moe = sum(1 for i in range(layers) if i not in only and (i + 1) % max(step, 1) == 0)
        shared = hf_int(hf, "shared_expert_intermediate_size", 0)
        moe = MoEConfig(
            num_experts=hf_int(hf, count),
            top_k=_top_k(hf),
            expert_ffn_hidden=hf_int(hf, "moe_intermediate_size"),
            moe_layers=n_moe,
            shared_experts=1 if shared else 0,
            shared_ffn_hidden=shared or None,
        )
        return moe, None
    if "num_local_experts" in hf and "moe_intermediate_size" not in hf:  # Mixtral, GPT-OSS
        moe = MoEConfig(
            num_experts=hf_int(hf, "num_local_experts"),
            top_k=_top_k(hf),
            expert_ffn_hidden=hf_int(hf, "intermediate_size"),
        )
        return moe, None
    raise MoEConfigError(
        f"unknown mixture-of-experts layout (keys {sorted(moe_keys(hf))}); llmopt plans the "
        "Mixtral/GPT-OSS (num_local_experts), Qwen-MoE (num_experts + moe_intermediate_size) "
        "and DeepSeek (n_routed_experts + moe_intermediate_size) layouts"
    )


# What each MoE architecture's block has besides the routed experts: shared experts (at most
# one MLP, `n_shared_experts` wide for DeepSeek), Qwen2-MoE's sigmoid gate on it, and the
# routing HF's modules implement (DeepSeek-V3: sigmoid scores, a balancing bias, groups).
_MOE_ARCH = {
    "mixtral": {"shared": False, "gate": False, "sigmoid": False},
    "qwen2_moe": {"shared": True, "gate": True, "sigmoid": False},
    "qwen3_moe": {"shared": False, "gate": False, "sigmoid": False},
    "deepseek_v3": {"shared": True, "gate": False, "sigmoid": True},
}


def _flag(hf: dict[str, Any], key: str, default: bool) -> bool:
    v = hf.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{key}={v!r} must be true or false")
    return v


def _float(hf: dict[str, Any], key: str, default: float) -> float:
    v = hf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ConfigError(f"{key}={v!r} must be a finite number")
    return float(v)


def refuse_moe_keys(hf: dict[str, Any], spec: ModelSpec) -> None:
    """Refuse MoE settings llmopt's MoE block does not implement for this architecture."""
    name = spec.hf_architectures[0]
    if _float(hf, "router_jitter_noise", 0.0):
        raise ConfigError(
            f"router_jitter_noise={hf['router_jitter_noise']} is not supported for {name}; "
            "llmopt routes without jitter (0.0)"
        )
    if "qkv_bias" in hf and _flag(hf, "qkv_bias", spec.attention_bias) != spec.attention_bias:
        raise ConfigError(
            f"qkv_bias={hf['qkv_bias']} is not supported for {name}; llmopt implements "
            f"{spec.attention_bias}"
        )
    for key, value in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if spec.latent_attention and hf.get(key, value) != value:
            raise ConfigError(
                f"{key}={hf[key]!r} is not supported for {name}; llmopt implements {value!r}"
            )
    if (
        spec.latent_attention
        and hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]
    ):
        raise ConfigError(
            f"num_key_value_heads={hf['num_key_value_heads']} differs from num_attention_heads="
            f"{hf['num_attention_heads']}: latent attention expands keys for every head"
        )
    layers = hf_int(hf, "num_hidden_layers")
    step = hf_int(hf, "decoder_sparse_step", 1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ConfigError(f"mlp_only_layers={only!r} must be a list of layer indices")
    sparse = [i for i in range(layers) if i not in only and (i + 1) % max(step, 1) == 0]
    if sparse != list(range(layers - len(sparse), layers)):
        raise ConfigError(
            f"decoder_sparse_step={step}, mlp_only_layers={only} make layers {sparse} sparse; "
            "llmopt builds MoE blocks for the last layers only (dense first layers, then MoE)"
        )


def moe_config(hf: dict[str, Any], spec: ModelSpec) -> tuple[MoEConfig, MLAConfig | None]:
    """The MoEConfig (shapes and routing) and MLAConfig of a MoE architecture's config.json."""
    try:
        moe, mla = moe_layout(hf)
        arch = _MOE_ARCH[spec.architecture]
        routing: dict[str, Any] = {"norm_topk": _flag(hf, "norm_topk_prob", arch["sigmoid"])}
        if spec.architecture == "mixtral":
            routing["norm_topk"] = True  # Mixtral renormalises its top-2 always
        if arch["gate"] and moe.shared_experts:
            routing["shared_gate"] = True
        if arch["sigmoid"]:  # DeepSeek-V3 (HF's defaults where a key is missing)
            routing.update(
                score="sigmoid",
                expert_bias=True,
                route_scale=_float(hf, "routed_scaling_factor", 2.5),
                num_groups=hf_int(hf, "n_group", 8),
                topk_groups=hf_int(hf, "topk_group", 4),
            )
        if _flag(hf, "output_router_logits", False):  # HF adds the aux loss only then
            routing["aux_loss_coef"] = _float(hf, "router_aux_loss_coef", 0.001)
        if moe.shared_experts and not arch["shared"]:
            raise ConfigError(f"{spec.hf_architectures[0]} has no shared experts")
        if moe.moe_layers == hf_int(hf, "num_hidden_layers"):
            routing["moe_layers"] = None  # every block: the default
        if mla is not None:
            mla = dataclasses.replace(mla, rope_interleave=_flag(hf, "rope_interleave", True))
        return dataclasses.replace(moe, **routing), mla
    except MoEConfigError as exc:
        raise ConfigError(str(exc)) from None


def moe_hf_keys(config: Any, spec: ModelSpec) -> dict[str, Any]:
    """The HF config.json keys of a MoE architecture's experts, routing and latent attention."""
    m: MoEConfig = config.moe
    _check_hf_moe(config, spec)
    dense = config.num_layers - (config.num_layers if m.moe_layers is None else m.moe_layers)
    aux = {"output_router_logits": bool(m.aux_loss_coef), "router_aux_loss_coef": m.aux_loss_coef}
    if spec.architecture == "mixtral":
        if m.expert_ffn_hidden != config.intermediate_size:
            raise ConfigError(
                f"HF Mixtral's experts are intermediate_size={config.intermediate_size} wide; "
                f"this model's are expert_ffn_hidden={m.expert_ffn_hidden}: no HF equivalent"
            )
        return {"num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k, **aux}
    common = {"num_experts_per_tok": m.top_k, "moe_intermediate_size": m.expert_ffn_hidden,
              "norm_topk_prob": m.norm_topk, **aux}  # fmt: skip
    if spec.latent_attention:
        mla: MLAConfig = config.mla
        return {
            **common,
            "n_routed_experts": m.num_experts,
            "n_shared_experts": m.shared_experts,
            "first_k_dense_replace": dense,
            "n_group": m.num_groups,
            "topk_group": m.topk_groups,
            "routed_scaling_factor": m.route_scale,
            "num_nextn_predict_layers": m.mtp_layers,
            "kv_lora_rank": mla.kv_lora_rank,
            "q_lora_rank": mla.q_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "rope_interleave": mla.rope_interleave,
        }
    keys = {**common, "num_experts": m.num_experts, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(dense))}  # fmt: skip
    if spec.architecture == "qwen2_moe":
        keys["shared_expert_intermediate_size"] = m.shared_experts * m.shared_hidden
        keys["qkv_bias"] = config.attention_bias
    return keys


def check_moe(config: Any, spec: ModelSpec) -> None:
    """A MoE architecture's config has experts, and latent attention where the architecture
    has it (what HF's layout cannot hold is refused when writing it: `moe_hf_keys`)."""
    if config.moe is None:
        raise ConfigError(
            f"architecture {spec.architecture!r} is a mixture of experts: config.moe is required"
        )
    if spec.latent_attention and config.mla is None:
        raise ConfigError(f"architecture {spec.architecture!r} needs config.mla (latent attention)")


def _check_hf_moe(config: Any, spec: ModelSpec) -> None:
    """Refuse experts or routing the architecture's HF config and modules cannot express.
    Training-only settings (loss coefficients, capacity factor, bias rate) are not refused:
    HF's forward routes dropless, which is how a capacity-trained model is served."""
    m: MoEConfig = config.moe
    name = spec.hf_architectures[0]
    arch = _MOE_ARCH[spec.architecture]
    one = spec.architecture != "deepseek_v3"  # DeepSeek's shared MLP is n experts wide
    if m.shared_experts and not arch["shared"] or (one and m.shared_experts > 1):
        raise ConfigError(f"shared_experts={m.shared_experts} has no {name} equivalent")
    if not one and m.shared_ffn_hidden not in (None, m.expert_ffn_hidden):
        raise ConfigError(f"shared_ffn_hidden={m.shared_ffn_hidden} has no {name} equivalent")
    if m.shared_gate != (arch["gate"] and bool(m.shared_experts)):
        raise ConfigError(f"shared_gate={m.shared_gate} has no {name} equivalent")
    if arch["sigmoid"]:
        if m.score != "sigmoid" or not m.expert_bias:
            raise ConfigError(f"{name} routes by biased sigmoid scores; this model has "
                              f"score={m.score!r}, expert_bias={m.expert_bias}")  # fmt: skip
    elif m.score != "softmax" or m.num_groups != 1 or m.expert_bias or m.route_scale != 1.0:
        raise ConfigError(
            f"{name} routes by softmax over all experts without bias or scale; this model has "
            f"score={m.score!r}, num_groups={m.num_groups}, expert_bias={m.expert_bias}, "
            f"route_scale={m.route_scale}: no HF equivalent"
        )
    if spec.architecture == "mixtral" and not m.norm_topk:
        raise ConfigError("HF Mixtral renormalises the top-k weights: norm_topk must be true")
