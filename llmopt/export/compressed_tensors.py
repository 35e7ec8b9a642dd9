"""compressed-tensors `pack-quantized` (W4A16 / W8A16), the layout llm-compressor writes and
vLLM and transformers read.

Per quantized linear: `weight_packed` int32 [out, ceil(in*bits/32)] holding the codes as a
little-endian bit stream along the input axis (element i at bit i*bits, stored as the signed
code + 2^(bits-1), i.e. exactly our unsigned code); `weight_scale` [out, groups];
`weight_shape` [out, in]; and for asymmetric grids `weight_zero_point` (signed z - 2^(bits-1))
packed the same way along the output axis. W = (q - z) * s as in our format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.export.output import ExportError, check_output, staged_directory
from llmopt.export.quantized_dir import (
    quantized_layers,
    uniform_setting,
    write_quantized_directory,
)
from llmopt.export.tensors import DEFAULT_MAX_SHARD_SIZE


def pack_bitstream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned [rows, cols] codes -> int32 [rows, ceil(cols*bits/32)], element i at bit i*bits."""
    rows, cols = values.shape
    v = values.to(torch.int64)
    padded = -(-cols // 32) * 32
    v = torch.nn.functional.pad(v, (0, padded - cols))
    positions = torch.arange(padded, dtype=torch.int64) * bits
    words = torch.zeros(rows, padded * bits // 32, dtype=torch.int64)
    low = positions % 32
    words.index_add_(1, positions // 32, (v << low) & 0xFFFFFFFF)
    spill = low + bits > 32  # an element split across two words (bits 3, 5, 6, 7)
    if spill.any():
        words.index_add_(1, positions[spill] // 32 + 1, v[:, spill] >> (32 - low[spill]))
    words = words[:, : -(-cols * bits // 32)]
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _layer_tensors(bits: int, sym: bool):
    def tensors(name: str, layer: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {
            "weight_packed": pack_bitstream(layer.packed().codes(), bits),
            "weight_scale": layer.scales.clone(),
            "weight_shape": torch.tensor([layer.out_features, layer.in_features]),
        }
        if not sym:
            out["weight_zero_point"] = pack_bitstream(layer.zeros.t(), bits).t()
        return out

    return tensors


KIND = "quantize:compressed-tensors"  # llmopt.output_dir: written by `llmopt quantize --format`


def export_compressed_tensors(
    model: nn.Module,
    out: str | Path,
    tokenizer: Any = None,
    *,
    dtype: str = "float16",
    source: str | Path | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a compressed-tensors pack-quantized directory of a quantized model.
    `overwrite`: an `out` holding other files gets only this export's files replaced."""
    from llmopt.models.spec import spec_for

    out = check_output(out, source, KIND, overwrite)
    layers = quantized_layers(model)
    bits, group = uniform_setting(layers)
    for name, layer in layers.items():
        if group != -1 and layer.in_features % group:
            raise ExportError(
                f"compressed-tensors groups must divide the input width: {name} has "
                f"in_features={layer.in_features} with group_size={group}"
            )
    mid = 1 << (bits - 1)
    sym = all(bool((m.zeros == mid).all()) for m in layers.values())
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": sym,
        "strategy": "channel" if group == -1 else "group",
        "group_size": None if group == -1 else group,
        "dynamic": False,
        "observer": "minmax",
        "actorder": None,
        "block_structure": None,
    }
    head = spec_for(model).head
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": [] if head in layers else [head],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
    with staged_directory(out, KIND, overwrite) as stage:
        write_quantized_directory(
            model, stage, _layer_tensors(bits, sym), config, tokenizer, dtype, max_shard_size
        )
    return out
