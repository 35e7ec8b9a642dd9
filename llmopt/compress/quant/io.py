"""Quantized model directories: `llmopt_quant.safetensors` + `llmopt_quant.json` (+ tokenizer).

`llmopt_quant.json` records the model config, the quantization config, every quantized
module's shape, and the SHA-256 of the weights file; loading checks all of them, so a
truncated, corrupted or mismatched file fails with one line naming the problem instead of
producing a silently wrong model. The directory is built in a temporary sibling (the marker
written last) and swapped into place whole (`llmopt.artifacts.atomic_directory`): a previous
output stays intact until the new one is complete, and a directory is never half a model.

Neither `config.json` nor `model.safetensors` is written: transformers
loads any `model.safetensors` (with a default config when config.json is absent) and initialises
every linear whose packed tensors it does not know at random. Without both names every
transformers loader raises instead. Portable outputs are the exports (`export_autoawq`).
Directories written before this change (`model.safetensors`) still load: the marker names its
weights file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.artifacts import OutputPathError, atomic_write, atomic_write_json
from llmopt.compress import QUANT_MARKER as MARKER
from llmopt.compress.markers import read_marker, sha256_file, verify_weights
from llmopt.compress.quant.config import QuantConfig
from llmopt.compress.quant.formats import check_bits_group
from llmopt.compress.quant.linear import QuantLinear
from llmopt.config_files import BOOL, INT, check_fields
from llmopt.errors import LlmoptError
from llmopt.models.spec import spec_for
from llmopt.output_dir import output_directory

WEIGHTS = "llmopt_quant.safetensors"
LEGACY_WEIGHTS = "model.safetensors"  # directories written before `weights_file` existed
FORMAT_NAME = "llmopt-quant"
FORMAT_VERSION = 1


class QuantFileError(LlmoptError, ValueError):
    """A quantized directory that is corrupted, incomplete or inconsistent."""


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

    config: QuantConfig | None = getattr(model, "quant_config", None)
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
                "report": _jsonable(getattr(model, "quant_report", {})),
            }
            _write_json(staging / MARKER, meta)  # last: marks the directory complete
    except OutputPathError as exc:
        raise QuantFileError(str(exc)) from exc
    return directory


def _float_params(model: nn.Module):
    return (p.dtype for p in model.parameters() if p.is_floating_point())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_json(path, data, indent=2)


# what `save_quantized` records per quantized linear
MODULE_ENTRY = {
    "in_features": INT,
    "out_features": INT,
    "bits": INT,
    "group_size": INT,
    "bias": BOOL,
}


def read_quant_meta(directory: str | Path) -> dict[str, Any]:
    return read_marker(
        directory,
        MARKER,
        FORMAT_NAME,
        FORMAT_VERSION,
        ("model_config", "quant_config", "modules", "weights_sha256"),
        QuantFileError,
        "a quantized model directory",
    )


def load_quantized_model(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> nn.Module:
    """Rebuild a model written by `save_quantized`: QuantLinear layers + float tensors in dtype."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from llmopt.compress.quant.apply import retie_head
    from llmopt.models.config import ModelConfig
    from llmopt.models.llama import RotaryEmbedding, Transformer

    directory = Path(path)
    meta = read_quant_meta(directory)
    weights_name = meta.get("weights_file", LEGACY_WEIGHTS)
    if weights_name not in (WEIGHTS, LEGACY_WEIGHTS):
        raise QuantFileError(f"{MARKER}: weights_file={weights_name!r}; expected {WEIGHTS!r}")
    weights = directory / weights_name
    verify_weights(weights, meta["weights_sha256"], MARKER, QuantFileError)
    try:
        model_config = ModelConfig.from_dict(meta["model_config"])
        quant_config = QuantConfig.from_dict(meta["quant_config"])
    except (TypeError, ValueError) as exc:
        raise QuantFileError(f"{directory / MARKER}: invalid configuration: {exc}") from exc
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise QuantFileError(f"{weights} cannot be read: {exc}") from exc

    with torch.device("meta"):
        model = Transformer(model_config)
    for name, spec in meta["modules"].items():
        check_fields(
            f"{directory / MARKER}: modules[{name!r}]",
            spec,
            MODULE_ENTRY,
            required=tuple(MODULE_ENTRY),
            unknown="keep",
            error=QuantFileError,
        )
        try:
            check_bits_group(spec["bits"], spec["group_size"])
            layer = QuantLinear(
                spec["in_features"],
                spec["out_features"],
                spec["bits"],
                spec["group_size"],
                bias=spec["bias"],
                backend=quant_config.backend,
            )
            model.get_submodule(name)
        except (KeyError, AttributeError, ValueError) as exc:
            raise QuantFileError(f"{MARKER}: bad entry for module {name!r}: {exc}") from exc
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)

    spec = spec_for(model)
    tied = model_config.tie_embeddings and spec.head not in meta["modules"]
    expected = model.state_dict()
    if tied:
        expected.pop(f"{spec.head}.weight", None)
    for name, ref in expected.items():
        if name not in state:
            raise QuantFileError(f"{weights} lacks tensor {name!r} that {MARKER} implies")
        t = state[name]
        if tuple(t.shape) != tuple(ref.shape) or (
            not ref.is_floating_point() and t.dtype != ref.dtype
        ):
            raise QuantFileError(
                f"tensor {name!r} in {weights_name} is {tuple(t.shape)} {t.dtype}, but {MARKER} "
                f"implies {tuple(ref.shape)} {ref.dtype}"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise QuantFileError(f"{weights} holds tensors {MARKER} does not describe: {extra[:4]}")
    for name, t in state.items():
        if t.is_floating_point() and not name.endswith(".scales"):
            state[name] = t.to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    retie_head(model)
    model.rotary = RotaryEmbedding(model_config)
    model = model.to(device).eval()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.invalidate()
    model.quant_config = quant_config
    model.quant_report = meta.get("report", {})
    return model
