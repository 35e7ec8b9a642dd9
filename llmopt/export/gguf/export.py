"""`export_gguf`: one .gguf file that llama.cpp loads as its own converter and quantizer
would have written it.

The architecture, tensor names and hyperparameters follow `layout`, the tokenizer `vocab`,
and each tensor's type `mix` (llama.cpp's recipe for the file type: `q4_k` is Q4_K_M with
its Q6_K tensors and Q5_0/Q8_0 fallbacks). K-quants are encoded by `kquants`, the 32-value
block types by the `gguf` package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from llmopt.export.gguf.layout import (
    add_hyperparameters,
    check_representable,
    gguf_tensors,
    llama_cpp_arch,
)
from llmopt.export.gguf.mix import FILE_TYPES, tensor_types
from llmopt.export.gguf.vocab import add_tokenizer
from llmopt.export.output import check_output, choice, write_with
from llmopt.export.tensors import checked, dense_state_dict

GGUF_TYPES = tuple(FILE_TYPES)


def encode(array: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    """(data, raw ggml type or None for plain float arrays) of one tensor as `kind`."""
    import gguf

    from llmopt.export.gguf.kquants import QUANTIZERS

    if kind == "F32":
        return np.ascontiguousarray(array, dtype=np.float32), None
    if kind == "F16":
        return array.astype(np.float16), None
    raw = getattr(gguf.GGMLQuantizationType, kind)
    if kind in QUANTIZERS:
        return QUANTIZERS[kind](array), raw
    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), raw), raw


def export_gguf(
    model: nn.Module,
    out: str | Path,
    tokenizer: Any = None,
    *,
    qtype: str = "f16",
    source: str | Path | None = None,
    tokenizer_pre: str | None = None,
) -> Path:
    """Write one .gguf file; `qtype` names the llama.cpp file type (`q4_k` = Q4_K_M).

    `tokenizer_pre` overrides the detected llama.cpp pre-tokenizer name of a byte-level BPE
    tokenizer (one whose check-text hash llama.cpp's table lacks)."""
    import gguf

    from llmopt.models.spec import spec_for

    choice(qtype, GGUF_TYPES, "gguf type")
    out = check_output(out, source)
    config, spec = model.config, spec_for(model)
    arch = llama_cpp_arch(spec.architecture)
    check_representable(config, spec)
    tensors = dict(gguf_tensors(checked(dense_state_dict(model)), config, spec))
    types = tensor_types({k: v.shape for k, v in tensors.items()}, qtype, config.num_layers)

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_name(config.name)
        writer.add_file_type(int(getattr(gguf.LlamaFileType, FILE_TYPES[qtype].llama_file_type)))
        add_hyperparameters(writer, config, spec)
        if tokenizer is not None:
            add_tokenizer(writer, tokenizer, tokenizer_pre, config.vocab_size)
        for name, array in tensors.items():
            data, raw = encode(array, types[name])
            writer.add_tensor(name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write_with(out, write)
    return out
