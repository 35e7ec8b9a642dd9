"""Export to AutoAWQ's "GEMM" checkpoint layout, which vLLM, TGI and transformers load.

Per quantized linear (4-bit only, in_features a multiple of the group size):
- `qweight` int32 [in, out/8]: codes transposed to [in, out]; 8 consecutive output columns
  per int32, column 8c + ORDER[i] in bits 4i..4i+3 (ORDER = 0, 2, 4, 6, 1, 3, 5, 7);
- `qzeros` int32 [in/group, out/8]: integer zero points packed the same way;
- `scales` fp16 [in/group, out];
so W[o, i] = (q[i, o] - z[i // group, o]) * s[i // group, o]. Names carry HF's `model.` prefix
and `config.json` gets AutoAWQ's `quantization_config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.artifacts import OutputPathError, atomic_write, atomic_write_json
from llmopt.models.hf import ours_to_hf
from llmopt.models.packed.quant.format import QuantFormatError
from llmopt.models.packed.quant.hf import AWQ_ORDER
from llmopt.models.packed.quant.linear import QuantLinear
from llmopt.models.spec import spec_for


def pack_awq_int32(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit values -> int32 [rows, cols/8] in AWQ's interleaved nibble order."""
    rows, cols = values.shape
    if cols % 8:
        raise QuantFormatError(f"AutoAWQ packs 8 output channels per int32; got {cols} channels")
    v = values.to(torch.int64).reshape(rows, cols // 8, 8)[:, :, list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    packed = (v << shifts).sum(-1)  # disjoint bit fields: sum == bitwise or
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def check_autoawq_compatible(model: nn.Module, bits: int, group_size: int) -> None:
    """Fail before any calibration when AutoAWQ's GEMM layout cannot hold the result.

    It holds 4-bit weights only and has no short last group, so every quantized linear's
    input width must be a multiple of the group size.
    """
    if bits != 4:
        raise QuantFormatError(f"AutoAWQ's GEMM layout holds 4-bit weights only; got bits={bits}")
    if group_size == -1:
        return
    spec = spec_for(model)
    widths = sorted(
        {
            module.in_features
            for _, block in spec.named_blocks(model)
            for _, module in spec.named_block_modules(block, spec.block_linears)
        }
    )
    bad = [w for w in widths if w % group_size]
    if bad:
        raise QuantFormatError(
            f"AutoAWQ needs every input width divisible by the group size {group_size}; this "
            f"model has widths {bad}; choose a group size that divides "
            f"{', '.join(map(str, bad))} (or -1)"
        )


def awq_tensors(layer: QuantLinear) -> dict[str, torch.Tensor]:
    if layer.bits != 4:
        raise QuantFormatError(
            f"AutoAWQ GEMM holds 4-bit weights only; this model is {layer.bits}-bit"
        )
    group = layer.in_features if layer.group_size == -1 else layer.group_size
    if layer.in_features % group:
        raise QuantFormatError(
            f"AutoAWQ needs in_features divisible by the group size: a layer has "
            f"in_features={layer.in_features} with group_size={layer.group_size}; quantize with "
            "a group size that divides it (e.g. 64 or 32 for SmolLM2's 576)"
        )
    codes = layer.packed().codes()  # [out, in]
    return {
        "qweight": pack_awq_int32(codes.t().contiguous()),
        "qzeros": pack_awq_int32(layer.zeros.t().contiguous()),
        "scales": layer.scales.t().contiguous().half(),
    }


KIND = "quantize:autoawq"  # llmopt.output_dir


def export_autoawq(
    model: nn.Module, directory: str | Path, tokenizer: Any = None, *, overwrite: bool = False
) -> Path:
    """Write `model.safetensors` + `config.json` in AutoAWQ's GEMM layout."""
    from safetensors.torch import save_file

    from llmopt.models.features import require_llama_checkpoint
    from llmopt.models.packed.metadata import compression_metadata

    config = compression_metadata(model).quant_config
    if config is None:
        raise QuantFormatError("model is not quantized: quantize it first")
    require_llama_checkpoint(model.config, "AutoAWQ export")
    directory = Path(directory)
    state: dict[str, torch.Tensor] = {}
    quantized = set()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            prefix = ours_to_hf(name)
            for key, tensor in awq_tensors(module).items():
                state[f"{prefix}.{key}"] = tensor
            if module.bias is not None:
                state[f"{prefix}.bias"] = module.bias.detach().half()
            quantized.add(name)
    if not quantized:
        raise QuantFormatError("model has no quantized linear layers to export")
    head = spec_for(model).head
    tied = model.config.tie_embeddings and head not in quantized
    for name, tensor in model.state_dict().items():
        module_name = name.rsplit(".", 1)[0]
        if module_name in quantized or (tied and name == f"{head}.weight"):
            continue
        state[ours_to_hf(name)] = tensor.detach().half().contiguous()
    hf = model.config.to_hf_config()
    hf["torch_dtype"] = "float16"
    hf["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": config.group_size,
        "zero_point": True,  # zero points are always stored (8 when symmetric)
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    from llmopt.output_dir import output_directory

    try:  # an old export intact until this one is whole; the user's files never replaced
        with output_directory(directory, KIND, overwrite=overwrite) as staging:
            atomic_write(
                staging / "model.safetensors",
                lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}),
            )
            atomic_write_json(staging / "config.json", hf, indent=2)
            if tokenizer is not None:
                tokenizer.save(staging)
    except OutputPathError as exc:
        raise QuantFormatError(str(exc)) from exc
    return Path(directory)
