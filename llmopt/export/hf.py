"""HF transformers directory: safetensors + config.json + tokenizer + generation_config.json.

What `AutoModelForCausalLM.from_pretrained` and vLLM read; files follow the umask. Names and config come from
`llmopt.models.hf` / `ModelConfig.to_hf_config`, so the two directions cannot drift apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from llmopt.export.output import check_output, staged_directory
from llmopt.export.tensors import (
    DEFAULT_MAX_SHARD_SIZE,
    checked,
    dense_state_dict,
    float_dtype,
    save_safetensors,
)


def generation_config(config: Any) -> dict[str, Any]:
    """The generation_config.json transformers reads for default special ids."""
    out: dict[str, Any] = {"_from_model_config": True}
    if config.bos_token_id is not None:
        out["bos_token_id"] = config.bos_token_id
    if config.eos_token_id is not None:  # every id that ends generation (Llama 3: three)
        out["eos_token_id"] = list(config.eos_token_ids) or config.eos_token_id
    return out


def write_hf_files(
    model: nn.Module,
    directory: Path,
    dtype: str,
    tokenizer: Any,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Fill `directory` (which must exist) with the HF files of a dense model."""
    from llmopt.artifacts import atomic_write_text
    from llmopt.models.hf import to_hf_layout

    torch_dtype = float_dtype(dtype)
    state = checked(dense_state_dict(model, torch_dtype))
    hf_state = to_hf_layout(state, model.config)
    save_safetensors(hf_state, directory, max_shard_size)
    hf_config = model.config.to_hf_config()
    hf_config["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    atomic_write_text(directory / "config.json", json.dumps(hf_config, indent=2))
    atomic_write_text(
        directory / "generation_config.json",
        json.dumps(generation_config(model.config), indent=2),
    )
    if tokenizer is not None:
        tokenizer.save(directory)


KIND = "export:hf"  # llmopt.output_dir: what an earlier output of this export records


def export_hf(
    model: nn.Module,
    out: str | Path,
    tokenizer: Any = None,
    *,
    dtype: str = "float32",
    source: str | Path | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a transformers-loadable directory at `out` (quantized linears dequantised);
    weights past `max_shard_size` are sharded with HF's `model.safetensors.index.json`.
    `overwrite`: an `out` holding other files gets only this export's files replaced."""
    out = check_output(out, source, KIND, overwrite)
    float_dtype(dtype)  # validate before any work
    with staged_directory(out, KIND, overwrite) as stage:
        write_hf_files(model, stage, dtype, tokenizer, max_shard_size)
    return out
