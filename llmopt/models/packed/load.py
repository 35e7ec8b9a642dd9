"""A GGUF file's quantized tensors kept as they are, for `load_model(..., dtype="auto")`: every
Q4_0/Q4_1/Q8_0/Q4_K/Q6_K linear becomes a `BlockQuantLinear`, a quantized token embedding a
`BlockQuantEmbedding` sharing its codes with the head when the file ties them; the loader
loads everything else as fp32. Bytes per token then equal the file's (llama.cpp's).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from llmopt.models.config import ModelConfig
from llmopt.models.gguf import GGUFFile
from llmopt.models.packed.block import BUFFERS, BlockQuantEmbedding, BlockQuantLinear
from llmopt.models.packed.gguf_blocks import GGML_FORMATS, packed_tensors


def _packed_module(gguf_file: GGUFFile, gguf_name: str, ours: str, config) -> nn.Module:
    tensor = gguf_file.tensors[gguf_name]
    cols, rows = (int(d) for d in tensor.shape.tolist())
    fmt, buffers = packed_tensors(tensor.data, tensor.tensor_type.name, rows, cols)
    if ours == "embed_tokens.weight":
        module: nn.Module = BlockQuantEmbedding(rows, cols, fmt.name)
    else:
        module = BlockQuantLinear(cols, rows, fmt.name)
    for name, value in buffers.items():  # Q/K rows back to HF's RoPE layout
        rows_hf = gguf_file.hf_rows(ours, value.numpy(), config)
        getattr(module, name).copy_(torch.from_numpy(np.ascontiguousarray(rows_hf)))
    return module


def packable(gguf_file: GGUFFile, gguf_name: str, final_softcap: float | None) -> bool:
    """Whether a tensor is a quantized 2-D weight of a linear or the embedding we can keep."""
    tensor = gguf_file.tensors[gguf_name]
    kind = tensor.tensor_type.name
    if kind not in GGML_FORMATS or len(tensor.shape) != 2:
        return False
    if kind.endswith("_K") and int(tensor.shape[0]) % 256:
        return False
    ours = gguf_file.our_name(gguf_name)
    if not ours.endswith(".weight") or "norm" in ours:
        return False
    # a soft-capped head (Gemma 2) keeps its float module, which applies the cap
    return not (final_softcap is not None and ours == "lm_head.weight")


def packed_gguf_modules(gguf_file: GGUFFile, config: ModelConfig) -> dict[str, nn.Module]:
    """Qualified module name -> packed module for every quantized weight of `gguf_file` we keep
    (the loader swaps them in: `llmopt.models.assemble.model_from_tensors(modules=...)`)."""
    modules: dict[str, nn.Module] = {}
    for gguf_name in gguf_file.tensors:
        if packable(gguf_file, gguf_name, config.final_softcap):
            ours = gguf_file.our_name(gguf_name)
            modules[ours.removesuffix(".weight")] = _packed_module(
                gguf_file, gguf_name, ours, config
            )
    embed = modules.get("embed_tokens")
    if config.tie_embeddings and isinstance(embed, BlockQuantEmbedding):
        head = BlockQuantLinear(embed.embedding_dim, embed.num_embeddings, embed.fmt.name)
        for name in BUFFERS:
            setattr(head, name, getattr(embed, name))
        modules["lm_head"] = head  # one tensor in the file, one in memory
    return modules
