"""Write quantized model directories (`llmopt_quant.safetensors` + `llmopt_quant.json` + tokenizer);
`llmopt.models.packed.quant.directory` reads them back and describes the format.

The directory is built in a temporary sibling (the marker written last) and swapped into place
whole (`llmopt.artifacts.atomic_directory`): a previous output stays intact until the new one
is complete, and a directory is never half a model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.artifacts import OutputPathError, atomic_write, atomic_write_json, sha256_file
from llmopt.models.packed.metadata import compression_metadata
from llmopt.models.packed.quant.directory import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MARKER,
    WEIGHTS,
    QuantFileError,
)
from llmopt.models.packed.quant.linear import QuantLinear
from llmopt.models.spec import spec_for
from llmopt.output_dir import output_directory


def _jsonable(value: Any) -> Any:
    """The JSON-friendly part of a report (tensors and non-finite floats dropped)."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items() if not torch.is_tensor(v)}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


KIND = "quantize:llmopt"  # llmopt.output_dir


def save_quantized(
    model: nn.Module,
    directory: str | Path,
    tokenizer: Any = None,
    float_dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a quantized model (from `quantize_model`) so `load_model(directory)` restores it.
    An existing `directory` must be an earlier quantize output unless `overwrite` (then only
    this output's files are replaced; `llmopt.output_dir`).

    `float_dtype` optionally stores the unquantized tensors (embeddings, norms) in a smaller
    dtype; by default they keep their dtype and a round trip gives identical logits.
    """
    from safetensors.torch import save_file

    config = compression_metadata(model).quant_config
    if config is None:
        raise QuantFileError("model has no quant_config: quantize it with quantize_model first")
    directory = Path(directory)
    spec = spec_for(model)
    tied = model.config.tie_embeddings and not isinstance(
        spec.top_module(model, "head"), QuantLinear
    )
    state = {}
    for name, tensor in model.state_dict().items():
        if tied and name == f"{spec.head}.weight":
            continue
        if float_dtype is not None and tensor.is_floating_point() and "scales" not in name:
            tensor = tensor.to(float_dtype)
        state[name] = tensor.detach().contiguous().cpu()
    modules = {
        name: {
            "in_features": m.in_features,
            "out_features": m.out_features,
            "bits": m.bits,
            "group_size": m.group_size,
            "bias": m.bias is not None,
        }
        for name, m in model.named_modules()
        if isinstance(m, QuantLinear)
    }
    try:
        with output_directory(directory, KIND, overwrite=overwrite) as staging:
            weights = staging / WEIGHTS
            atomic_write(weights, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
            if tokenizer is not None:
                tokenizer.save(staging)
            meta = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "model_config": model.config.to_dict(),
                "quant_config": config.to_dict(),
                "modules": modules,
                "weights_file": WEIGHTS,
                "weights_sha256": sha256_file(weights),
                "float_dtype": str(float_dtype or next(iter(_float_params(model)), torch.float32)),
                "report": _jsonable(compression_metadata(model).quant_report),
            }
            _write_json(staging / MARKER, meta)  # last: marks the directory complete
    except OutputPathError as exc:
        raise QuantFileError(str(exc)) from exc
    return directory


def _float_params(model: nn.Module):
    return (p.dtype for p in model.parameters() if p.is_floating_point())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_json(path, data, indent=2)
