"""GPTQ checkpoint, "v1" layout (AutoGPTQ, GPTQModel, transformers, vLLM, TGI).

Per quantized linear, with p = 32 / bits codes per int32 (bits 2, 4 or 8):
- `qweight` int32 [in / p, out]: codes packed along the input axis, row r*p + j in bits
  j*bits..(j+1)*bits-1 of word r;
- `qzeros` int32 [groups, out / p]: zero points minus one (the v1 convention), packed along
  the output axis the same way;
- `scales` fp16 [groups, out]; `g_idx` int32 [in]: the group of each input column;
so W[o, i] = (q[i, o] - (qz[g_idx[i], o] + 1)) * s[g_idx[i], o]. Our groups are contiguous
runs of input columns (GPTQ's act-order only changes the visiting order, not the grouping),
so g_idx = i // group and `desc_act` is false: kernels need no column permutation.
v1 cannot hold a zero point of 0 (it would be stored as -1); such a layer is refused.
"""

from __future__ import annotations

import json
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

GPTQ_BITS = (2, 4, 8)
# Formats whose consumers want a symmetric grid: vLLM's Marlin kernels (gptq_marlin, and
# compressed-tensors' W4A16/W8A16 Marlin path) take symmetric weights only; an asymmetric
# GPTQ checkpoint falls back to slower kernels or is refused. `llmopt quantize` defaults to
# symmetric for these formats (asymmetric for its own format, whose tables are in
# docs/benchmarks/quant.md).
SYMMETRIC_FORMATS = ("gptq", "compressed-tensors")


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned [rows, cols] codes -> int32 [rows / (32/bits), cols], packed along rows."""
    per = 32 // bits
    rows, cols = values.shape
    if rows % per:
        raise ExportError(f"GPTQ packs {per} values per int32; got a dimension of {rows}")
    v = values.to(torch.int64).reshape(rows // per, per, cols)
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    packed = (v << shifts).sum(1)  # disjoint bit fields
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_rows` (int64 codes)."""
    per = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    values = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def gptq_tensors(name: str, layer: Any) -> dict[str, torch.Tensor]:
    bits = layer.bits
    if bool((layer.zeros == 0).any()):
        raise ExportError(
            f"{name} has a zero point of 0, which GPTQ's v1 layout cannot store (it keeps "
            "zero - 1); quantize with --sym or export another format"
        )
    group = layer.in_features if layer.group_size == -1 else layer.group_size
    g_idx = torch.arange(layer.in_features, dtype=torch.int32) // group
    return {
        "qweight": pack_rows(layer.packed().codes().t(), bits),
        # [groups, out / p]: pack the transposed zeros along what becomes the output axis
        "qzeros": pack_rows(layer.zeros.to(torch.int64) - 1, bits).t().contiguous(),
        "scales": layer.scales.t().contiguous().half(),
        "g_idx": g_idx,
    }


def dequantize_gptq(tensors: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """W [out, in] from one layer's v1 tensors, honouring any g_idx (the documented format)."""
    codes = unpack_rows(tensors["qweight"], bits)  # [in, out]
    zeros = unpack_rows(tensors["qzeros"].t().contiguous(), bits).t() + 1  # [groups, out]
    g_idx = tensors["g_idx"].long()
    scales = tensors["scales"].float()
    return ((codes - zeros[g_idx]).float() * scales[g_idx]).t()


KIND = "quantize:gptq"  # llmopt.output_dir: written by `llmopt quantize --format`


def export_gptq(
    model: nn.Module,
    out: str | Path,
    tokenizer: Any = None,
    *,
    dtype: str = "float16",
    source: str | Path | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a GPTQ v1 directory (model.safetensors, config.json, quantize_config.json).
    `overwrite`: an `out` holding other files gets only this export's files replaced."""
    from llmopt.artifacts import atomic_write_text
    from llmopt.models.packed.metadata import compression_metadata
    from llmopt.models.spec import spec_for

    out = check_output(out, source, KIND, overwrite)
    layers = quantized_layers(model)
    bits, group = uniform_setting(layers)
    if bits not in GPTQ_BITS:
        raise ExportError(f"GPTQ export holds bits {GPTQ_BITS}; this model is {bits}-bit")
    sym = all(bool((m.zeros == 1 << (bits - 1)).all()) for m in layers.values())
    qcfg = compression_metadata(model).quant_config
    config = {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": False,
        "static_groups": False,
        "sym": sym,
        "true_sequential": True,
        "damp_percent": float(getattr(qcfg, "gptq_damp", 0.01) or 0.01),
        # GPTQ's flag for a quantized head is named after HF's head module (the spec's name)
        spec_for(model).head: spec_for(model).head in layers,
        "pack_dtype": "int32",
    }
    with staged_directory(out, KIND, overwrite) as stage:
        write_quantized_directory(
            model, stage, gptq_tensors, config, tokenizer, dtype, max_shard_size
        )
        atomic_write_text(stage / "quantize_config.json", json.dumps(config, indent=2))
    return out
