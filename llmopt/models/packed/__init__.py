"""Runtime weight formats kept as the file holds them (GGUF block quantization).

`BlockQuantLinear` / `BlockQuantEmbedding` hold codes, scales and mins; they dequantize on the
fly in the eager forward and are read directly by the fused CPU kernels
(`llmopt.infer.fast`). `load_packed_gguf` builds a model from a GGUF file with them
(`llmopt.models.load_model(path, dtype="auto")`).
"""

from llmopt.models.packed.block import (
    BLOCK_FORMATS,
    BlockFormat,
    BlockQuantEmbedding,
    BlockQuantLinear,
    block_format,
)
from llmopt.models.packed.load import load_packed_gguf

__all__ = [
    "BLOCK_FORMATS",
    "BlockFormat",
    "BlockQuantEmbedding",
    "BlockQuantLinear",
    "block_format",
    "load_packed_gguf",
]
