"""Weight quantization to packed INT4/INT8 (RTN, AWQ, GPTQ), files, and AutoAWQ export.

Imports are lazy: `from llmopt.compress.quant import X` loads only X's module. The runtime
format (`QuantLinear`, packed codes, quantized directories) lives in `llmopt.models.packed.quant`;
its names are handed on here for callers of the quantization API.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PackedWeight",
    "QuantConfig",
    "QuantFormatError",
    "QuantLinear",
    "QuantFileError",
    "calibration_tokens",
    "export_autoawq",
    "load_quantized_model",
    "model_nbytes",
    "quantize_model",
    "save_quantized",
]

_WHERE = {
    "PackedWeight": "llmopt.models.packed.quant.format",
    "QuantFormatError": "llmopt.models.packed.quant.format",
    "QuantConfig": "llmopt.models.packed.quant.config",
    "QuantLinear": "llmopt.models.packed.quant.linear",
    "QuantFileError": "llmopt.models.packed.quant.directory",
    "calibration_tokens": "llmopt.compress.quant.calibration",
    "export_autoawq": "llmopt.compress.quant.autoawq",
    "load_quantized_model": "llmopt.models.packed.quant.directory",
    "model_nbytes": "llmopt.compress.quant.apply",
    "quantize_model": "llmopt.compress.quant.apply",
    "save_quantized": "llmopt.compress.quant.io",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_WHERE[name])
    return getattr(module, name)
