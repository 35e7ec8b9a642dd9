"""The model directory formats `load_model` reads besides HF and GGUF: each is a marker file and
a loader, declared beside the model where the format is defined (`llmopt.models.packed`), and
listed here; HF directories whose config.json declares a `quantization_config.quant_method`
(AWQ, GPTQ) have their own loader. The packages that write these directories
(`llmopt.compress`) stand above the model and are never imported by it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmopt.models.packed.format import DirectoryFormat
from llmopt.models.packed.quant.directory import QUANT_DIRECTORY
from llmopt.models.packed.quant.hf import load_hf_quantized
from llmopt.models.packed.sparse.directory import PRUNE_DIRECTORY

FORMATS: dict[str, DirectoryFormat] = {fmt.kind: fmt for fmt in (QUANT_DIRECTORY, PRUNE_DIRECTORY)}
# quantization_config.quant_method -> the loader of such HF directories
QUANT_METHODS: dict[str, Callable] = {"awq": load_hf_quantized, "gptq": load_hf_quantized}


def directory_format(directory: Path) -> DirectoryFormat | None:
    """The format whose marker file `directory` holds, if any."""
    for fmt in FORMATS.values():
        if (directory / fmt.marker).is_file():
            return fmt
    return None


def get_directory_format(kind: str) -> DirectoryFormat:
    return FORMATS[kind]


def registered_markers() -> list[str]:
    return [fmt.marker for fmt in FORMATS.values()]


def quantization_loader(method: str) -> Callable:
    """The loader of HF directories with this quant_method; unknown ones fail naming the known."""
    if method not in QUANT_METHODS:
        known = ", ".join(sorted(QUANT_METHODS)) or "none"
        raise ValueError(
            f"quantization_config.quant_method={method!r} cannot be loaded; llmopt reads: {known}"
        )
    return QUANT_METHODS[method]
