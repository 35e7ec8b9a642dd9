"""HF `config.json` -> the planner's `ModelConfig`, MoE layouts included.

`ModelConfig.from_hf_config` (what the trainer loads) builds the MoE architectures llmopt's
model implements (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) and refuses MoE keys anywhere
else. The planner only counts shapes, so it reads the three MoE layouts in use, recognised
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
from llmopt.models.hf_experts import hf_int as _int
from llmopt.models.hf_experts import moe_layout as _layout
from llmopt.models.moe import moe_keys


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
