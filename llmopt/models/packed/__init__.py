"""Runtime weight formats kept as the file holds them (GGUF block quantization).

`BlockQuantLinear` / `BlockQuantEmbedding` hold codes, scales and mins; they dequantize on the
fly in the eager forward and are read directly by the fused CPU kernels
(`llmopt.infer.fast`). `packed_gguf_modules` makes them from a GGUF file for
`llmopt.models.load_model(path, dtype="auto")`.
"""

from llmopt.models.packed.block import (
    BLOCK_FORMATS,
    BlockFormat,
    BlockQuantEmbedding,
    BlockQuantLinear,
    block_format,
)
from llmopt.models.packed.load import packed_gguf_modules

__all__ = [
    "BLOCK_FORMATS",
    "BlockFormat",
    "BlockQuantEmbedding",
    "BlockQuantLinear",
    "block_format",
    "packed_gguf_modules",
]
