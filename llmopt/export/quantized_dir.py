"""Shared by the packed-integer exports (GPTQ, compressed-tensors): a HF directory whose
quantized linears hold format-specific tensors and whose config.json says how to read them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.export.output import ExportError
from llmopt.export.tensors import DEFAULT_MAX_SHARD_SIZE, checked, float_dtype, save_safetensors


def quantized_layers(model: nn.Module) -> dict[str, Any]:
    """Our module name -> QuantLinear; refuses a model with none."""
    from llmopt.models.packed.quant.linear import QuantLinear

    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not layers:
        raise ExportError("model has no quantized linear layers: quantize it first")
    return layers


def uniform_setting(layers: dict[str, Any]) -> tuple[int, int]:
    """The one (bits, group_size) every quantized layer uses: both formats store one setting
    for the whole model."""
    settings = {(m.bits, m.group_size) for m in layers.values()}
    if len(settings) != 1:
        raise ExportError(f"layers are quantized with different (bits, group) {sorted(settings)}")
    return settings.pop()


def write_quantized_directory(
    model: nn.Module,
    directory: Path,
    layer_tensors: Callable[[str, Any], dict[str, torch.Tensor]],
    quantization_config: dict[str, Any],
    tokenizer: Any,
    dtype: str,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Safetensors (sharded past `max_shard_size`) + config.json (+ generation_config,
    tokenizer) into `directory`."""
    from llmopt.artifacts import atomic_write_text
    from llmopt.export.hf import generation_config
    from llmopt.models.features import require_llama_checkpoint
    from llmopt.models.hf import ours_to_hf
    from llmopt.models.spec import spec_for

    require_llama_checkpoint(model.config, "the quantized directory export")
    torch_dtype = float_dtype(dtype)
    layers = quantized_layers(model)
    state: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        prefix = ours_to_hf(name)
        for key, tensor in layer_tensors(name, layer).items():
            state[f"{prefix}.{key}"] = tensor.contiguous()
        if layer.bias is not None:
            state[f"{prefix}.bias"] = layer.bias.detach().to(torch_dtype)
    head = f"{spec_for(model).head}.weight"
    tied = model.config.tie_embeddings and spec_for(model).head not in layers
    floats = {}
    for name, tensor in model.state_dict().items():
        if name.rsplit(".", 1)[0] in layers or (tied and name == head):
            continue
        floats[name] = tensor.detach().to("cpu", torch_dtype)
    for name, tensor in checked(floats).items():
        state[ours_to_hf(name)] = tensor.contiguous()
    save_safetensors(state, directory, max_shard_size)
    hf = model.config.to_hf_config()
    hf["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    hf["quantization_config"] = quantization_config
    atomic_write_text(directory / "config.json", json.dumps(hf, indent=2))
    atomic_write_text(
        directory / "generation_config.json", json.dumps(generation_config(model.config), indent=2)
    )
    if tokenizer is not None:
        tokenizer.save(directory)
