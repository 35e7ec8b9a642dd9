"""A model's weights as plain dense tensors, whatever its linears hold.

Float exports (HF safetensors, GGUF, ONNX) store dense weights: a `QuantLinear` is
dequantised to exactly the weight it computes with, so an export of a quantized model
reproduces that model, not the float model it came from.
"""

from __future__ import annotations

import torch
from torch import nn

_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SHORT = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # the API's older names


def float_dtype(name: str) -> torch.dtype:
    """A dtype named as torch names it (the CLI's one vocabulary); the Python API also takes
    the short names fp32/fp16/bf16 it used to."""
    from llmopt.export.output import choice

    name = _SHORT.get(name, name)
    return _FLOAT_DTYPES[choice(name, tuple(_FLOAT_DTYPES), "dtype")]


def dense_state_dict(
    model: nn.Module, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Our parameter names -> dense tensors in `dtype` (a tied head included once, as its name)."""
    from llmopt.compress.quant.linear import QuantLinear

    state: dict[str, torch.Tensor] = {}
    quantized = {name for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            state[f"{name}.weight"] = module.packed().dequantize(torch.float32).to(dtype)
            if module.bias is not None:
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
