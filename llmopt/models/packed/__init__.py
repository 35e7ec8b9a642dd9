"""Runtime weight formats: modules that hold weights packed, and the directories that store them.

- GGUF block quantization: `BlockQuantLinear` / `BlockQuantEmbedding` hold codes, scales and
  mins; they dequantize on the fly in the eager forward and are read directly by the fused CPU
  kernels (`llmopt.infer.fast`). `packed_gguf_modules` makes them from a GGUF file for
  `llmopt.models.load_model(path, dtype="auto")`.
- `quant/`: group-wise INT-n codes (`format`), `QuantLinear`, the `QuantConfig` that describes a
  quantized model, `llmopt_quant.json` directories and HF AWQ/GPTQ checkpoints.
- `sparse/`: packed N:M values + indices (`format`), `SparseLinear`, the `PruneConfig` /
  `Sparsity` that describe a pruned model, and `llmopt_prune.json` directories.
- `markers`: the one reader of a compressed directory's marker file.
- `metadata`: `CompressionMetadata`, what quantization/pruning did to a model (configs, masks,
  reports), with its one reader `compression_metadata` and writer `set_compression_metadata`.

The algorithms that produce these (`llmopt.compress`) stand above the model; the model, its
loader, training (QLoRA), export and inference read them from here.
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
