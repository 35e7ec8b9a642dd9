"""Quantized model directories: `llmopt_quant.safetensors` + `llmopt_quant.json` (+ tokenizer).

`llmopt_quant.json` records the model config, the quantization config, every quantized
module's shape, and the SHA-256 of the weights file; loading checks all of them, so a
truncated, corrupted or mismatched file fails with one line naming the problem instead of
producing a silently wrong model. `llmopt.compress.quant.io.save_quantized` writes them.

Neither `config.json` nor `model.safetensors` is written: transformers
loads any `model.safetensors` (with a default config when config.json is absent) and initialises
every linear whose packed tensors it does not know at random. Without both names every
transformers loader raises instead. Portable outputs are the exports (`export_autoawq`).
Directories written before this change (`model.safetensors`) still load: the marker names its
weights file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.config_files import BOOL, INT, check_fields
from llmopt.errors import LlmoptError
from llmopt.models.config import ModelConfig
from llmopt.models.llama import RotaryEmbedding, Transformer
from llmopt.models.packed.format import DirectoryFormat
from llmopt.models.packed.markers import read_marker, verify_weights
from llmopt.models.packed.metadata import CompressionMetadata, set_compression_metadata
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.quant.format import check_bits_group
from llmopt.models.packed.quant.linear import QuantLinear, retie_head
from llmopt.models.spec import spec_for

MARKER = "llmopt_quant.json"
WEIGHTS = "llmopt_quant.safetensors"
LEGACY_WEIGHTS = "model.safetensors"  # directories written before `weights_file` existed
FORMAT_NAME = "llmopt-quant"
FORMAT_VERSION = 1


class QuantFileError(LlmoptError, ValueError):
    """A quantized directory that is corrupted, incomplete or inconsistent."""


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
    set_compression_metadata(
        model, CompressionMetadata(quant_config=quant_config, quant_report=meta.get("report", {}))
    )
    return model


QUANT_DIRECTORY = DirectoryFormat("quant", MARKER, load_quantized_model)
