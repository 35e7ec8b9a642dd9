"""Functions that take a model and return a quantized copy (the input model is never touched).

`quantize_model` deep-copies the model, runs the chosen method block by block and swaps each
selected `nn.Linear` for a `QuantLinear`. The copy's `compression_metadata`
(`llmopt.models.packed.metadata`) carries `quant_config` (a `QuantConfig`) and `quant_report`
(per-layer details: AWQ's α and scales, GPTQ's losses), which `save_quantized` writes next to
the weights.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from llmopt.compress.quant.calibration import check_calibration_tokens
from llmopt.compress.quant.progress import layer_progress
from llmopt.compress.quant.rtn import rtn_quantize
from llmopt.compress.quant.targets import block_linears, replace_with_packed, selected_names
from llmopt.errors import UsageError
from llmopt.models.packed.metadata import compression_metadata, set_compression_metadata
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.quant.linear import QuantLinear, retie_head
from llmopt.models.spec import spec_for


def _quantize_rtn(model: nn.Module, config: QuantConfig, progress: bool) -> dict[str, Any]:
    spec = spec_for(model)
    blocks = spec.named_blocks(model)
    with layer_progress(len(blocks), "RTN", progress) as advance:
        for _, block in blocks:
            for name, linear in block_linears(block, spec, config).items():
                packed = rtn_quantize(linear.weight, config.bits, config.group_size, config.sym)
                replace_with_packed(block, name, packed, config)
            advance()
    return {}


def quantize_model(
    model: nn.Module,
    method: str = "rtn",
    bits: int = 4,
    group_size: int = 128,
    *,
    sym: bool = False,
    config: QuantConfig | None = None,
    calib_tokens: torch.Tensor | None = None,
    progress: bool = False,
    **options: Any,
) -> nn.Module:
    """A quantized copy of `model` (RTN, AWQ or GPTQ); `model` itself is left unchanged.

    AWQ and GPTQ need `calib_tokens` [n, T] (see `calibration.calibration_tokens`). Extra
    keyword `options` are `QuantConfig` fields (e.g. `gptq_act_order=True`).
    """
    if config is None:
        config = QuantConfig(method=method, bits=bits, group_size=group_size, sym=sym, **options)
    spec = spec_for(model)
    selected_names(spec, config)  # unknown module names fail before any work
    if config.needs_calibration:
        check_calibration_tokens(calib_tokens, config.method)
    param = next(model.parameters())
    dtype = param.dtype
    start = time.perf_counter()
    qmodel = copy.deepcopy(model).eval()
    if compression_metadata(qmodel).quantized:
        raise UsageError("model is already quantized; quantize the full-precision model")
    qmodel.float()
    with torch.no_grad():
        if config.method == "rtn":
            report = _quantize_rtn(qmodel, config, progress)
        elif config.method == "awq":
            from llmopt.compress.quant.awq import awq_quantize

            report = awq_quantize(qmodel, config, calib_tokens.to(param.device), progress)
        else:
            from llmopt.compress.quant.gptq import gptq_quantize

            report = gptq_quantize(qmodel, config, calib_tokens.to(param.device), progress)
        if config.quantize_lm_head:
            head = spec.top_module(qmodel, "head")
            packed = rtn_quantize(head.weight, config.bits, config.group_size, config.sym)
            replace_with_packed(qmodel, spec.head, packed, config)
    _cast_float_params(qmodel, dtype)
    report["seconds"] = time.perf_counter() - start
    prior = compression_metadata(qmodel)
    set_compression_metadata(qmodel, prior.replace(quant_config=config, quant_report=report))
    return qmodel


def _cast_float_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Return non-quantized parameters to the caller's dtype (packed buffers stay as they are)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                setattr(module, name, nn.Parameter(p.data.to(dtype), requires_grad=False))
    retie_head(model)


def quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def model_nbytes(model: nn.Module) -> dict[str, int]:
    """Bytes held: quantized linears (packed), the fp16 size of those same linears, the rest,
    and any derived kernel layouts built so far."""
    seen: set[int] = set()
    packed = fp16_equiv = other = kernel = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            packed += module.packed_nbytes()
            fp16_equiv += 2 * module.in_features * module.out_features
            kernel += module.kernel_nbytes()
            continue
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            other += t.numel() * t.element_size()
    return {
        "quant_linear_bytes": packed,
        "quant_linear_fp16_bytes": fp16_equiv,
        "other_bytes": other,
        "kernel_cache_bytes": kernel,
    }
