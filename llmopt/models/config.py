"""Model configuration: one validated dataclass for the Llama family (and GPT-3-style shapes).

The config is pure data: the planner reads it to count parameters and FLOPs without ever
allocating weights (a 405B config costs nothing), and `llmopt.models.llama.Transformer` builds
a plain PyTorch model from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from llmopt.config_files import read_json
from llmopt.models.errors import ConfigError
from llmopt.models.hf_arch import check_fields, hf_fields, hf_keys, refuse_math_keys
from llmopt.models.hf_schema import check_hf_config
from llmopt.models.moe import MLAConfig, MoEConfig, parameter_counts
from llmopt.models.spec import (
    ModelSpec,
    UnknownArchitectureError,
    get_spec,
    registered_architectures,
    spec_for_hf,
)

MlpKind = Literal["swiglu", "gelu"]
_LLAMA3_KEYS = frozenset(
    {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
)

__all__ = ["ConfigError", "ModelConfig", "hf_rope"]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a decoder-only transformer.

    `head_dim` defaults to hidden_size // num_heads. `rope_scaling` follows HF's dict
    convention (only `rope_type="llama3"` changes the frequencies; others are rejected).
    `architecture` names the registered `ModelSpec` (module names every transformation
    reads); `sliding_window` (Mistral) limits each query to the last that many keys.
    `eos_token_ids` lists every id that ends generation when there are several (Llama 3's
    generation_config.json); `stop_token_ids` is what decoding loops should read. `moe`/`mla`
    describe routed experts and latent attention (the model builds experts for the MoE
    architectures; the planner counts any).
    Gemma 2's fields: `attn_softcap`/`final_softcap` (cap * tanh(x / cap) on attention scores
    / logits), `query_pre_attn_scalar` (scores scaled by its -1/2 power, not head_dim's) and
    `full_attention_every` (with a window: layers n-1, 2n-1, ... see every key).
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_seq_len: int = 4096
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_bias: bool = False
    mlp: MlpKind = "swiglu"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    sliding_window: int | None = None
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    full_attention_every: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        ids = self.eos_token_ids
        if not isinstance(ids, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise ConfigError(f"eos_token_ids={ids!r} must be a list of non-negative integers")
        object.__setattr__(self, "eos_token_ids", tuple(ids))
        if self.architecture not in registered_architectures():
            raise ConfigError(
                f"architecture={self.architecture!r} is not registered; choose one of "
                f"{', '.join(registered_architectures())}"
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int)
            or isinstance(self.sliding_window, bool)
            or self.sliding_window <= 0
        ):
            raise ConfigError(
                f"sliding_window={self.sliding_window!r} must be a positive integer or None"
            )
        check_fields(self, get_spec(self.architecture))
        if self.sliding_window is not None and not get_spec(self.architecture).sliding_window:
            raise ConfigError(
                f"sliding_window={self.sliding_window} is not supported for architecture "
                f"{self.architecture!r}; architectures with sliding-window attention: "
                + ", ".join(a for a in registered_architectures() if get_spec(a).sliding_window)
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_seq_len"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads != 0:
                raise ConfigError(
                    f"num_heads={self.num_heads} does not divide hidden_size={self.hidden_size}"
                    " (set head_dim explicitly for such models)"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0 or self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim={self.head_dim} must be a positive even number (RoPE)")
        if self.mlp not in ("swiglu", "gelu"):
            raise ConfigError(f"mlp={self.mlp!r} is not supported; choose 'swiglu' or 'gelu'")
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 0:
            raise ConfigError(f"rope_theta={self.rope_theta} must be positive")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ConfigError(
                    f"rope_scaling type {kind!r} is not supported; supported: 'llama3', 'default'"
                )
            if kind == "llama3":
                needed = _LLAMA3_KEYS - set(self.rope_scaling)
                if needed:
                    raise ConfigError(f"llama3 rope_scaling lacks {sorted(needed)}")
                for key in _LLAMA3_KEYS:
                    value = self.rope_scaling[key]
                    if (
                        isinstance(value, bool)
                        or not isinstance(value, int | float)
                        or not (math.isfinite(value) and value > 0)
                    ):
                        raise ConfigError(
                            f"rope_scaling {key}={value!r} must be a positive finite number"
                        )

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every token id that ends generation (all EOS ids, else the single eos_token_id)."""
        if self.eos_token_ids:
            return self.eos_token_ids
        return () if self.eos_token_id is None else (self.eos_token_id,)

    @property
    def mlp_kind(self) -> MlpKind:
        """The MLP's activation ("swiglu" / "gelu"): `mlp` read under a name that cannot be
        mistaken for a block's MLP module outside llmopt.models."""
        return self.mlp

    # ---- derived sizes (used by the planner; no tensors involved) ----
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_parameters(self) -> int:
        """Parameters of one transformer block (attention + MLP + two norms)."""
        h = self.hidden_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        n_mlp = 3 if self.mlp == "swiglu" else 2
        mlp = n_mlp * h * self.intermediate_size
        spec = get_spec(self.architecture)
        return attn + mlp + len(spec.block_norms) * h + 2 * spec.qk_norm * self.head_dim

    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_parameters(self) -> int:
        """Total parameters, counting a tied embedding/head once."""
        if self.moe is not None or self.mla is not None:
            return parameter_counts(self)["total"]
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        return (
            self.embedding_parameters()
            + self.num_layers * self.layer_parameters()
            + self.hidden_size  # final norm
            + head
        )

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with changes; a head_dim that was derived is derived again from new dims."""
        derived = self.hidden_size % self.num_heads == 0 and (
            self.head_dim == self.hidden_size // self.num_heads
        )
        if derived and "head_dim" not in changes:
            changes["head_dim"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown config keys {sorted(unknown)}; valid keys: {sorted(known)}")
        nested = {"moe": MoEConfig, "mla": MLAConfig}  # to_dict() wrote them as tables
        data = {k: nested[k](**v) if k in nested and isinstance(v, dict) else v
                for k, v in data.items()}  # fmt: skip
        return cls(**data)

    @classmethod
    def from_hf_config(
        cls, path_or_dict: str | Path | dict[str, Any], name: str = ""
    ) -> ModelConfig:
        """Build from a HF `config.json` (Llama, Mistral, Qwen2, SmolLM families)."""
        where, hf = "HF config", path_or_dict
        if not isinstance(path_or_dict, dict):
            path = Path(path_or_dict)
            path = path / "config.json" if path.is_dir() else path
            where, hf = str(path), read_json(path, "HF config")
        archs = hf.get("architectures")
        if archs is None or isinstance(archs, list) and all(isinstance(a, str) for a in archs):
            _hf_spec(hf)  # an unknown architecture is the first thing to say, before its keys
        check_hf_config(hf, where)
        spec = _hf_spec(hf)
        refuse_math_keys(hf, spec)
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids: list[int] = []
        if isinstance(eos, list):
            eos_ids, eos = (eos, eos[0]) if len(eos) > 1 else ([], eos[0] if eos else None)
        if hf.get("use_sliding_window"):
            raise ConfigError(
                "use_sliding_window=True (per-layer windows above max_window_layers) is not "
                f"supported for {spec.hf_architectures[0]}"
            )
        # Qwen2 configs carry a `sliding_window` that is off unless use_sliding_window is set
        window = hf.get("sliding_window") if spec.sliding_window else None
        theta, scaling = hf_rope(hf)
        return cls(
            name=name or hf.get("_name_or_path", "") or spec.hf_architectures[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            max_seq_len=hf.get("max_position_embeddings", 4096),
            head_dim=hf.get("head_dim"),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", spec.attention_bias)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            eos_token_ids=tuple(eos_ids),
            architecture=spec.architecture,
            sliding_window=window,
            **hf_fields(hf, spec),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent HF `config.json` dict for this config's architecture."""
        spec = get_spec(self.architecture)
        if self.attention_bias and not spec.attention_bias:
            raise ConfigError(
                f"attention_bias=True has no HF {spec.hf_architectures[0]} equivalent (HF would "
                "also bias o_proj); use architecture='qwen2' for q/k/v biases"
            )
        cfg: dict[str, Any] = {
            "architectures": [spec.hf_architectures[0]],
            "model_type": spec.hf_model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or self.eos_token_id,
            "torch_dtype": "float32",
            **hf_keys(self, spec),
        }
        if spec.attention_bias:
            cfg["use_sliding_window"] = False
        else:
            cfg["attention_bias"] = False
            cfg["mlp_bias"] = False
        if spec.sliding_window:
            cfg["sliding_window"] = self.sliding_window
        return cfg


def _hf_spec(hf: dict[str, Any]) -> ModelSpec:
    """The registered spec of a HF config (by `architectures`, else `model_type`)."""
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    try:
        return spec_for_hf(archs[0], hf.get("model_type"))
    except UnknownArchitectureError as exc:
        raise ConfigError(str(exc)) from None


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be a finite number")
    return float(value)


def hf_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a HF config in either layout.

    transformers 5 writes `rope_parameters` ({rope_theta, rope_type, scaling keys}) and no
    top-level `rope_theta`; transformers 4 writes `rope_theta` + `rope_scaling`. Both are read;
    when both are present they must agree. A missing theta means HF's default of 10000.
    """
    params = hf.get("rope_parameters")
    legacy_theta = hf.get("rope_theta")
    legacy_scaling = hf.get("rope_scaling")
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError(f"rope_parameters={params!r} must be a dict")
        if params and all(isinstance(v, dict) for v in params.values()):
            distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
            if len(distinct) > 1:
                raise ConfigError(
                    f"per-layer-type rope_parameters for {sorted(params)} differ; llmopt "
                    "implements one RoPE for all layers"
                )
            params = next(iter(params.values()))
        theta = _number(params.get("rope_theta", legacy_theta or 10000.0), "rope_theta")
        if legacy_theta is not None and _number(legacy_theta, "rope_theta") != theta:
            raise ConfigError(
                f"rope_theta={legacy_theta} contradicts rope_parameters.rope_theta={theta}"
            )
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = _number(10000.0 if legacy_theta is None else legacy_theta, "rope_theta")
        scaling = dict(legacy_scaling or {})
    partial = scaling.pop("partial_rotary_factor", 1.0)  # Phi-3 writes it here
    if partial not in (1, 1.0):
        raise ConfigError(
            f"partial_rotary_factor={partial!r} is not supported; llmopt rotates the whole head"
        )
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        extra = sorted(set(scaling) - {"rope_type"})
        if extra:
            raise ConfigError(f"rope_type 'default' takes no scaling keys; got {extra}")
        return theta, None
    return theta, scaling
