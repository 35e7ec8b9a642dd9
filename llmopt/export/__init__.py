"""Exports: llmopt models (quantized or not) in the layouts other runtimes load.

One module per format; each `export_*` takes a model and an output path, builds the result
aside and renames it into place. Imports are lazy: `from llmopt.export import export_gguf`
loads only the GGUF writer.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ExportError": "llmopt.export.output",
    "dense_state_dict": "llmopt.export.tensors",
    "export_hf": "llmopt.export.hf",
    "export_gguf": "llmopt.export.gguf",
    "GGUF_TYPES": "llmopt.export.gguf",
    "export_onnx": "llmopt.export.onnx",
    "export_gptq": "llmopt.export.gptq",
    "export_compressed_tensors": "llmopt.export.compressed_tensors",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'llmopt.export' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
