"""A model's weights as plain dense tensors, whatever its linears hold.

Float exports (HF safetensors, GGUF, ONNX) store dense weights: a `QuantLinear` is
dequantised to exactly the weight it computes with, so an export of a quantized model
reproduces that model, not the float model it came from. `save_safetensors` writes any
export's tensors as HF lays them out (sharded with an index past `max_shard_size`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def float_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name of the one vocabulary or an alias (`llmopt.dtypes`); an
    unknown name is an ExportError listing the valid ones."""
    from llmopt.dtypes import DtypeError, torch_dtype
    from llmopt.export.output import ExportError

    try:
        return torch_dtype(name)
    except DtypeError as exc:
        raise ExportError(str(exc)) from None


def dense_state_dict(
    model: nn.Module, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Our parameter names -> dense tensors in `dtype` (a tied head included once, as its name).

    Packed modules (QuantLinear, GGUF blocks kept as the file holds them: anything with
    `dequantize()` in place of a `weight` parameter) are written as their dequantized weight."""
    state: dict[str, torch.Tensor] = {}
    quantized = set()
    for name, module in model.named_modules():
        if callable(getattr(module, "dequantize", None)) and "weight" not in dict(
            module.named_parameters(recurse=False)
        ):
            quantized.add(name)
            state[f"{name}.weight"] = module.dequantize(torch.float32).to(dtype)
            if getattr(module, "bias", None) is not None:
                state[f"{name}.bias"] = module.bias.detach().to(dtype)
    for name, tensor in model.state_dict().items():
        if name.rsplit(".", 1)[0] in quantized:
            continue
        if tensor.is_floating_point():
            state[name] = tensor.detach().to("cpu", dtype).contiguous()
    if getattr(model.config, "tie_embeddings", False):
        from llmopt.models.spec import spec_for

        # re-derived by every consumer from the embedding
        state.pop(f"{spec_for(model).head}.weight", None)
    return state


def checked(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Refuse NaN/inf weights: no runtime would produce anything meaningful from them."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            from llmopt.export.output import ExportError

            raise ExportError(f"tensor {name!r} holds NaN or inf values; refusing to export it")
    return state


DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' `save_pretrained` default


def save_safetensors(
    state: dict[str, torch.Tensor],
    directory: Path,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write `state` as HF does: one `model.safetensors`, or shards of at most
    `max_shard_size` (bytes, or "500MB"/"5GB") named `model-0000k-of-0000n.safetensors`
    plus `model.safetensors.index.json`; every file at the umask's mode. The split is
    huggingface_hub's, so shard boundaries are the ones transformers would choose."""
    import json

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from llmopt.artifacts import atomic_write_text
    from llmopt.export.output import ExportError, write_with
    from llmopt.models.hf_schema import INDEX_FILE

    if isinstance(max_shard_size, str) and max_shard_size.strip().isdigit():
        max_shard_size = int(max_shard_size)
    if isinstance(max_shard_size, int) and max_shard_size <= 0:
        raise ExportError(f"max_shard_size={max_shard_size} must be positive")
    try:
        split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    except ValueError as exc:
        raise ExportError(
            f"max_shard_size={max_shard_size!r} is not a size: give bytes or a number with "
            f"KB, MB, GB or TB (e.g. 2GB) ({exc})"
        ) from None
    meta = {"format": "pt", **(metadata or {})}
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state[name].contiguous() for name in names}
        write_with(directory / filename, lambda tmp, s=shard: save_file(s, str(tmp), metadata=meta))
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        atomic_write_text(directory / INDEX_FILE, json.dumps(index, indent=2))
    return list(split.filename_to_tensors)
