"""HF `config.json` keys that change the forward pass, per architecture.

`ModelConfig.from_hf_config` reads the Llama keys itself; this module refuses math-changing
keys an architecture does not implement (reading past them would give a wrong model) and maps
the ones it does implement (Gemma 2's soft-capping, query scale and alternating sliding
windows; the experts and routing of the MoE architectures) to `ModelConfig` fields and back.
It imports no torch and no `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from llmopt.models.errors import ConfigError
from llmopt.models.moe import MLAConfig, MoEConfig, MoEConfigError, moe_keys
from llmopt.models.spec import ModelSpec

# keys whose non-default value changes the forward pass; reading past them gives a wrong model
_MATH_KEYS: dict[str, tuple[Any, ...]] = {
    "mlp_bias": (False,),
    "partial_rotary_factor": (1, 1.0),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "query_pre_attn_scalar": (None,),
    "no_rope_layers": (None,),
    "use_qk_norm": (None, False),
    "use_bidirectional_attention": (None, False),
}
# HF activation names of each `ModelSpec.gate_activation`
_ACTIVATIONS = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh",)}
# keys an architecture reads into ModelConfig fields (so they are not refused)
_FIELD_KEYS = {
    "attn_softcap": "attn_logit_softcapping",
    "final_softcap": "final_logit_softcapping",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
}
_DEFAULT_FULL_EVERY = 2  # transformers 4's Gemma 2 (no layer_types): layers 0, 2, ... slide


def refuse_math_keys(hf: dict[str, Any], spec: ModelSpec) -> None:
    """Raise on settings llmopt's model does not implement for this architecture."""
    name = spec.hf_architectures[0]
    moe = moe_keys(hf)
    if moe and not spec.experts:  # whatever `architectures` says: never read experts as dense
        raise ConfigError(
            f"mixture-of-experts keys {moe} in a {name} config, which has no MoE block "
            "(llmopt builds Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3; `llmopt plan` reads "
            "any MoE config)"
        )
    if spec.experts:
        refuse_moe_keys(hf, spec)
    read = {_FIELD_KEYS[f] for f in spec.config_fields if f in _FIELD_KEYS}
    for key, allowed in _MATH_KEYS.items():
        if key in hf and key not in read and hf[key] not in allowed:
            raise ConfigError(
                f"{key}={hf[key]!r} is not supported for {name}; llmopt "
                f"implements only {' / '.join(map(repr, allowed))}"
            )
    acts = _ACTIVATIONS[spec.gate_activation]
    for key in ("hidden_act", "hidden_activation"):
        if hf.get(key) is not None and hf[key] not in acts:
            raise ConfigError(
                f"{key}={hf[key]!r} is not supported for {name}; llmopt implements "
                f"{' / '.join(map(repr, acts))}"
            )
    if hf.get("attention_bias") and not spec.attention_bias:
        raise ConfigError(
            f"attention_bias=True is not supported for {name} (it also "
            "biases o_proj); llmopt implements q/k/v biases for qwen2 only"
        )
    if "full_attention_every" in spec.config_fields:
        return  # layer_types are read by `hf_fields`
    layer_types = set(hf.get("layer_types") or [])
    uniform = [{"full_attention"}]
    if spec.sliding_window and hf.get("sliding_window"):
        uniform.append({"sliding_attention"})  # every layer windowed: what sliding_window means
    if layer_types and layer_types not in uniform:
        raise ConfigError(
            f"layer_types={sorted(layer_types)} is not supported for {name}; llmopt "
            "implements one attention kind for all layers"
        )


def _positive(value: Any, key: str) -> int | float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be a positive finite number or null")
    if value <= 0:
        raise ConfigError(f"{key}={value!r} must be a positive finite number or null")
    return value  # as written: HF validates query_pre_attn_scalar as an int


def full_attention_every(layer_types: list[str], key: str = "layer_types") -> int:
    """n such that layers n-1, 2n-1, ... attend to all keys and the others to the window."""
    kinds = set(layer_types)
    if not kinds <= {"full_attention", "sliding_attention"} or "full_attention" not in kinds:
        raise ConfigError(
            f"{key}={sorted(kinds)} is not supported; llmopt implements sliding layers with a "
            "full-attention layer every n-th layer"
        )
    every = layer_types.index("full_attention") + 1
    expected = [layer_kind(i, every) for i in range(len(layer_types))]
    if every < 2 or layer_types != expected:
        raise ConfigError(
            f"{key}={layer_types} is not a periodic pattern of sliding layers ending in one "
            "full-attention layer; llmopt implements only that pattern"
        )
    return every


def layer_kind(index: int, every: int | None) -> str:
    """HF's layer type of layer `index` when every `every`-th layer is full attention."""
    full = every is not None and (index + 1) % every == 0
    return "full_attention" if full else "sliding_attention"


def hf_fields(hf: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """The ModelConfig fields beyond Llama's that this architecture reads from `hf`."""
    fields: dict[str, Any] = {}
    if spec.experts:
        fields["moe"] = moe_config(hf, spec)
    for field, key in _FIELD_KEYS.items():
        if field in spec.config_fields:
            fields[field] = _positive(hf.get(key), key)
    if "full_attention_every" in spec.config_fields and hf.get("sliding_window"):
        types = hf.get("layer_types")
        fields["full_attention_every"] = (
            full_attention_every(list(types)) if types else _DEFAULT_FULL_EVERY
        )
    return fields


def hf_keys(config: Any, spec: ModelSpec) -> dict[str, Any]:
    """HF config.json keys of the fields `hf_fields` reads (for `to_hf_config`)."""
    # pad_token_id: HF's per-architecture defaults (Phi-3: 32000) can lie outside a small vocab
    keys: dict[str, Any] = {
        "hidden_act": _ACTIVATIONS[spec.gate_activation][0],
        "pad_token_id": None,
    }
    if spec.gate_activation != "silu":
        keys["hidden_activation"] = keys["hidden_act"]
    for field, key in _FIELD_KEYS.items():
        if field in spec.config_fields:
            keys[key] = getattr(config, field)
    if "query_pre_attn_scalar" in spec.config_fields and config.query_pre_attn_scalar is None:
        keys["query_pre_attn_scalar"] = config.head_dim  # HF's default scale 1/sqrt(head_dim)
    if "full_attention_every" in spec.config_fields:
        every = config.full_attention_every if config.sliding_window else 1
        keys["layer_types"] = [layer_kind(i, every) for i in range(config.num_layers)]
    if spec.experts:
        keys.update(moe_hf_keys(config, spec))
    return keys


def check_fields(config: Any, spec: ModelSpec) -> None:
    """Refuse architecture fields set on an architecture without them, or with bad values."""
    if spec.experts:
        check_moe(config, spec)
    for field in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
        value = getattr(config, field)
        if value is not None and field not in spec.config_fields:
            raise ConfigError(
                f"{field}={value!r} is not supported for architecture {spec.architecture!r}"
            )
        _positive(value, field)
    every = config.full_attention_every
    if every is None:
        return
    if "full_attention_every" not in spec.config_fields:
        raise ConfigError(
            f"full_attention_every={every!r} is not supported for architecture "
            f"{spec.architecture!r}"
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 2:
        raise ConfigError(f"full_attention_every={every!r} must be an integer >= 2 or None")
    if config.sliding_window is None:
        raise ConfigError(f"full_attention_every={every} needs a sliding_window")


# ---- mixture of experts ----
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


# What each MoE architecture's block has besides the routed experts, and its HF router keys.
_MOE_ARCH = {
    "mixtral": {"shared": False, "gate": False},
    "qwen2_moe": {"shared": True, "gate": True},
    "qwen3_moe": {"shared": False, "gate": False},
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


def moe_config(hf: dict[str, Any], spec: ModelSpec) -> MoEConfig:
    """The MoEConfig (shapes and routing) of a MoE architecture's config.json."""
    try:
        moe, _ = moe_layout(hf)
        arch = _MOE_ARCH[spec.architecture]
        routing: dict[str, Any] = {"norm_topk": _flag(hf, "norm_topk_prob", False)}
        if spec.architecture == "mixtral":
            routing["norm_topk"] = True  # Mixtral renormalises its top-2 always
        if arch["gate"] and moe.shared_experts:
            routing["shared_gate"] = True
        if _flag(hf, "output_router_logits", False):  # HF adds the aux loss only then
            routing["aux_loss_coef"] = _float(hf, "router_aux_loss_coef", 0.001)
        if moe.shared_experts and not arch["shared"]:
            raise ConfigError(f"{spec.hf_architectures[0]} has no shared experts")
        if moe.moe_layers == hf_int(hf, "num_hidden_layers"):
            routing["moe_layers"] = None  # every block: the default
        return dataclasses.replace(moe, **routing)
    except MoEConfigError as exc:
        raise ConfigError(str(exc)) from None


def moe_hf_keys(config: Any, spec: ModelSpec) -> dict[str, Any]:
    """The HF config.json keys of a MoE architecture's experts and routing."""
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
    keys = {
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.expert_ffn_hidden,
        "norm_topk_prob": m.norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(dense)),
        **aux,
    }
    if spec.architecture == "qwen2_moe":
        keys["shared_expert_intermediate_size"] = m.shared_experts * m.shared_hidden
        keys["qkv_bias"] = config.attention_bias
    return keys


def check_moe(config: Any, spec: ModelSpec) -> None:
    """A MoE architecture's config has experts (what HF's layout cannot hold is refused when
    writing it: `moe_hf_keys`)."""
    if config.moe is None:
        raise ConfigError(
            f"architecture {spec.architecture!r} is a mixture of experts: config.moe is required"
        )


def _check_hf_moe(config: Any, spec: ModelSpec) -> None:
    """Refuse experts or routing the architecture's HF config and modules cannot express.
    Training-only settings (loss coefficients, capacity factor, bias rate) are not refused:
    HF's forward routes dropless, which is how a capacity-trained model is served."""
    m: MoEConfig = config.moe
    name = spec.hf_architectures[0]
    arch = _MOE_ARCH[spec.architecture]
    if m.shared_experts and not arch["shared"] or m.shared_experts > 1:
        raise ConfigError(
            f"shared_experts={m.shared_experts} has no {name} equivalent "
            f"({'one shared expert' if arch['shared'] else 'no shared experts'})"
        )
    if m.shared_gate != (arch["gate"] and bool(m.shared_experts)):
        raise ConfigError(f"shared_gate={m.shared_gate} has no {name} equivalent")
    if m.score != "softmax" or m.num_groups != 1 or m.expert_bias or m.route_scale != 1.0:
        raise ConfigError(
            f"{name} routes by softmax over all experts without bias or scale; this model has "
            f"score={m.score!r}, num_groups={m.num_groups}, expert_bias={m.expert_bias}, "
            f"route_scale={m.route_scale}: no HF equivalent"
        )
    if spec.architecture == "mixtral" and not m.norm_topk:
        raise ConfigError("HF Mixtral renormalises the top-k weights: norm_topk must be true")
