"""HF `config.json` -> the planner's `ModelConfig`, MoE layouts included.

`ModelConfig.from_hf_config` (what the trainer loads) refuses MoE keys, because llmopt's model
is dense. The planner only counts shapes, so it reads the three MoE layouts in use, recognised
by their keys, not by the `architectures` name (a Mixtral relabelled as Mistral is still
Mixtral):

- Mixtral / GPT-OSS: `num_local_experts` experts of `intermediate_size` in every block;
- Qwen-MoE (Qwen2-MoE, Qwen3-MoE): `num_experts` of `moe_intermediate_size`, optional shared
  expert, `decoder_sparse_step` / `mlp_only_layers`;
- DeepSeek-V2/V3: `n_routed_experts` of `moe_intermediate_size`, `n_shared_experts`, the first
  `first_k_dense_replace` blocks dense, MLA attention, `num_nextn_predict_layers` MTP modules.

Any other combination of MoE keys is refused with the keys named: never planned as dense.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.config_files import read_json
from llmopt.models.config import ModelConfig
from llmopt.models.moe import MLAConfig, MoEConfig, MoEConfigError, moe_keys

_MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _int(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    v = hf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise MoEConfigError(f"{key}={v!r} must be a non-negative integer")
    return v


def _top_k(hf: dict[str, Any]) -> int:
    for key in ("num_experts_per_tok", "experts_per_token"):
        if key in hf:
            return _int(hf, key)
    raise MoEConfigError("MoE config has no num_experts_per_tok (experts each token uses)")


def _layout(hf: dict[str, Any]) -> tuple[MoEConfig, MLAConfig | None]:
    layers = _int(hf, "num_hidden_layers")
    if "n_routed_experts" in hf and "moe_intermediate_size" in hf:  # DeepSeek
        dense = _int(hf, "first_k_dense_replace", 0)
        if _int(hf, "moe_layer_freq", 1) != 1:
            raise MoEConfigError(f"moe_layer_freq={hf['moe_layer_freq']} is not supported; use 1")
        mla = None
        if all(k in hf for k in _MLA_KEYS):
            q = hf.get("q_lora_rank")
            mla = MLAConfig(*(_int(hf, k) for k in _MLA_KEYS), q_lora_rank=q)
        moe = MoEConfig(
            num_experts=_int(hf, "n_routed_experts"),
            top_k=_top_k(hf),
            expert_ffn_hidden=_int(hf, "moe_intermediate_size"),
            moe_layers=layers - dense,
            shared_experts=_int(hf, "n_shared_experts", 0),
            mtp_layers=_int(hf, "num_nextn_predict_layers", 0),
        )
        return moe, mla
    if "num_experts" in hf and "moe_intermediate_size" in hf:  # Qwen-MoE
        step = _int(hf, "decoder_sparse_step", 1)
        only = set(hf.get("mlp_only_layers") or [])
        n_moe = sum(1 for i in range(layers) if i not in only and (i + 1) % max(step, 1) == 0)
        shared = _int(hf, "shared_expert_intermediate_size", 0)
        moe = MoEConfig(
            num_experts=_int(hf, "num_experts"),
            top_k=_top_k(hf),
            expert_ffn_hidden=_int(hf, "moe_intermediate_size"),
            moe_layers=n_moe,
            shared_experts=1 if shared else 0,
            shared_ffn_hidden=shared or None,
        )
        return moe, None
    if "num_local_experts" in hf and "moe_intermediate_size" not in hf:  # Mixtral, GPT-OSS
        moe = MoEConfig(
            num_experts=_int(hf, "num_local_experts"),
            top_k=_top_k(hf),
            expert_ffn_hidden=_int(hf, "intermediate_size"),
        )
        return moe, None
    raise MoEConfigError(
        f"unknown mixture-of-experts layout (keys {sorted(moe_keys(hf))}); llmopt plans the "
        "Mixtral/GPT-OSS (num_local_experts), Qwen-MoE (num_experts + moe_intermediate_size) "
        "and DeepSeek (n_routed_experts + moe_intermediate_size) layouts"
    )


def moe_from_hf(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """The planner's ModelConfig of a MoE HF config (raises MoEConfigError for other layouts)."""
    moe, mla = _layout(hf)
    heads = _int(hf, "num_attention_heads")
    h = _int(hf, "hidden_size")
    head_dim = hf.get("head_dim") or (h // heads if h % heads == 0 else None)
    if head_dim is None and mla is not None:
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    return ModelConfig(
        name=name or hf.get("_name_or_path", "") or str((hf.get("architectures") or ["moe"])[0]),
        vocab_size=_int(hf, "vocab_size"),
        hidden_size=h,
        # DeepSeek's dense blocks; elsewhere the dense width only matters for dense blocks
        intermediate_size=_int(hf, "intermediate_size"),
        num_layers=_int(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        max_seq_len=hf.get("max_position_embeddings", 4096),
        head_dim=head_dim,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=moe,
        mla=mla,
    )


def planner_config_from_hf(
    path_or_dict: str | Path | dict[str, Any], name: str = ""
) -> ModelConfig:
    """A config.json (file, directory or dict) for planning: MoE layouts as MoE, the rest as
    `ModelConfig.from_hf_config` reads them."""
    hf = path_or_dict
    if not isinstance(hf, dict):
        path = Path(path_or_dict)
        path = path / "config.json" if path.is_dir() else path
        hf = read_json(path, "HF config")  # names the file on every error
        if not moe_keys(hf):
            return ModelConfig.from_hf_config(path, name=name)
    if moe_keys(hf):
        return moe_from_hf(hf, name)
    return ModelConfig.from_hf_config(hf, name=name)
