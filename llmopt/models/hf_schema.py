"""The types of the HF files a model directory holds (`config.json`, `generation_config.json`,
`tokenizer_config.json`, `model.safetensors.index.json`), checked before any value is used.

Other tools write these files and add keys freely, so unknown keys are kept (config.json keys
that change the math are refused by `ModelConfig.from_hf_config`); a known key of the wrong
type is refused with the file, the key and the value, instead of a KeyError or TypeError later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.config_files import (
    BOOL,
    FLOAT,
    INT,
    INT_LIST,
    LIST,
    NONE,
    STR,
    STR_LIST,
    TABLE,
    ConfigFileError,
    check_fields,
    check_value,
    inside,
    read_json,
)

HF_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
HF_CONFIG = {
    **dict.fromkeys(HF_REQUIRED, INT),
    "num_key_value_heads": (INT, NONE),
    "max_position_embeddings": INT,
    "head_dim": (INT, NONE),
    "rope_theta": FLOAT,
    "rope_scaling": (TABLE, NONE),
    "rms_norm_eps": FLOAT,
    "tie_word_embeddings": BOOL,
    "attention_bias": BOOL,
    "use_sliding_window": BOOL,
    "sliding_window": (INT, NONE),
    "bos_token_id": (INT, NONE),
    "eos_token_id": (INT, INT_LIST, NONE),
    "architectures": (STR_LIST, NONE),
    "model_type": STR,
    "quantization_config": (TABLE, NONE),
}
GENERATION_CONFIG = {"eos_token_id": (INT, INT_LIST, NONE), "bos_token_id": (INT, NONE)}
TOKENIZER_CONFIG = {
    "add_bos_token": BOOL,
    "chat_template": (STR, LIST, NONE),
    "bos_token": (STR, TABLE, NONE),
    "eos_token": (STR, TABLE, NONE),
}
INDEX_FILE = "model.safetensors.index.json"


def check_hf_config(hf: dict[str, Any], where: str) -> None:
    """Refuse a config.json dict that lacks a shape key or holds a wrongly typed value."""
    check_fields(where, hf, HF_CONFIG, required=HF_REQUIRED, unknown="keep")


def read_hf_json(path: Path, what: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A HF JSON file (an object) whose known keys have the types of `schema`."""
    data = read_json(path, what)
    check_fields(str(path), data, schema, unknown="keep")
    return data


def read_index(directory: Path) -> list[Path] | None:
    """The shard files the safetensors index lists, in order; None if there is no index.
    A shard name must stay inside the directory (no `../`, no absolute path)."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return None
    data = read_json(index, "safetensors index")
    where = str(index)
    weight_map = data.get("weight_map")
    check_value(where, "weight_map", weight_map, TABLE)
    if not weight_map:
        raise ConfigFileError(f"{where}: weight_map is empty")
    files: dict[Path, None] = {}
    for name, shard in weight_map.items():
        files[inside(directory, shard, where, f"weight_map[{name!r}]")] = None
    return list(files)
