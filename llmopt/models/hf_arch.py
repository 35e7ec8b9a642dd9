"""HF `config.json` keys that change the forward pass, per architecture.

`ModelConfig.from_hf_config` reads the Llama keys itself; this module refuses math-changing
keys an architecture does not implement (reading past them would give a wrong model) and maps
the ones it does implement (Gemma 2's soft-capping, query scale and alternating sliding
windows; the experts and routing of the MoE architectures) to `ModelConfig` fields and back.
It imports no torch and no `ModelConfig`.
"""

from __future__ import annotations

import math
from typing import Any

from llmopt.models.errors import ConfigError
from llmopt.models.hf_experts import check_moe, moe_config, moe_hf_keys, refuse_moe_keys
from llmopt.models.moe import moe_keys
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
        fields["moe"], fields["mla"] = moe_config(hf, spec)
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
