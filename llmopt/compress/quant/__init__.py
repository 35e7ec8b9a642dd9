"""Weight quantization to packed INT4/INT8 (RTN, AWQ, GPTQ), files, and AutoAWQ export.

Imports are lazy: `from llmopt.compress.quant import X` loads only X's module.
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
    "PackedWeight": "formats",
    "QuantFormatError": "formats",
    "QuantConfig": "config",
    "QuantLinear": "linear",
    "QuantFileError": "io",
    "calibration_tokens": "calibration",
    "export_autoawq": "autoawq",
    "load_quantized_model": "io",
    "model_nbytes": "apply",
    "quantize_model": "apply",
    "save_quantized": "io",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f"{__name__}.{_WHERE[name]}")
    return getattr(module, name)
