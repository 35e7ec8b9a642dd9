"""GGUF export (llama.cpp, Ollama, LM Studio): F16, Q8_0, Q4_0, Q4_1 and Q4_K weights.

Tensor names and the Q/K row permutation are the inverse of `llmopt.models.gguf` (the reader),
so a file round-trips through our loader and loads in llama.cpp, which rotates adjacent pairs
and therefore expects llama-architecture Q/K rows interleaved. Norms and biases stay F32; a
matrix whose rows Q4_K's 256-value super-blocks do not tile is stored Q5_0 (llama.cpp's own
fallback), and one whose rows are not a multiple of 32 is stored F16. The tokenizer goes into
`tokenizer.ggml.*`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from llmopt.export.output import check_output, choice, write_with
from llmopt.export.tensors import checked, dense_state_dict

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q4_k")
_FILE_TYPES = {
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
    "q4_1": "MOSTLY_Q4_1",
    "q4_k": "MOSTLY_Q4_K_M",
}
# llama.cpp's token types
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5


def _gguf_names() -> tuple[dict[str, str], dict[str, str]]:
    """Our names -> GGUF names, inverted from the reader's tables (one source of truth)."""
    from llmopt.models import gguf as reader

    top = {ours: g for g, ours in reader._GLOBAL_NAMES.items()}
    block = {ours: g for g, ours in reader._BLOCK_NAMES.items()}
    return top, block


def gguf_name(name: str, blocks: str) -> str:
    top, block = _gguf_names()
    if name in top:
        return top[name]
    prefix, rest = name.split(".", 1)
    index, rest = rest.split(".", 1)
    module, leaf = rest.rsplit(".", 1)
    if prefix != blocks or module not in block:
        raise ValueError(f"tensor {name!r} has no GGUF name")
    return f"blk.{index}.{block[module]}.{leaf}"


def _encode(array: np.ndarray, qtype: str) -> tuple[np.ndarray, Any]:
    """(data, raw ggml type or None) for one tensor under the requested file type."""
    import gguf

    if array.ndim == 1 or qtype == "f32":
        return np.ascontiguousarray(array, dtype=np.float32), None
    if qtype == "f16":
        return array.astype(np.float16), None
    if qtype == "q4_k":
        if array.shape[-1] % 256 == 0:
            from llmopt.export.gguf_q4k import quantize_q4_k

            return quantize_q4_k(array), gguf.GGMLQuantizationType.Q4_K
        qtype = "q5_0"  # llama.cpp's fallback for rows K-quant blocks do not tile
    if array.shape[-1] % 32:
        return array.astype(np.float16), None
    kind = getattr(gguf.GGMLQuantizationType, qtype.upper())
    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), kind), kind


def _add_tokenizer(writer: Any, tokenizer: Any, pre: str | None, vocab: int) -> None:
    data = json.loads(tokenizer.backend.to_str())
    bpe = data.get("model", {})
    if bpe.get("type") != "BPE":
        raise ValueError(
            f"GGUF export handles byte-level BPE tokenizers; this one is {bpe.get('type')}"
        )
    size = tokenizer.vocab_size
    if size > vocab:
        raise ValueError(f"the tokenizer has {size} tokens but the model's vocabulary is {vocab}")
    tokens = [tokenizer.id_to_token(i) for i in range(size)]
    types = [_NORMAL] * size
    # embedding rows beyond the tokenizer (padded vocabularies): placeholders, as llama.cpp's
    # converter writes them, so token count == vocab size
    tokens += [f"[PAD{i}]" for i in range(size, vocab)]
    types += [_UNUSED] * (vocab - size)
    for added in data.get("added_tokens", []):
        if added["id"] < size:
            types[added["id"]] = _CONTROL if added.get("special") else _USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or _guess_pre(data))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_add_bos_token(bool(tokenizer.add_bos))
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _guess_pre(data: dict) -> str:
    """llama.cpp's pre-tokenizer name: digits split one by one (SmolLM/StarCoder) or GPT-2's."""
    text = json.dumps(data.get("pre_tokenizer"))
    return "smollm" if '"individual_digits": true' in text else "default"


def export_gguf(
    model: nn.Module,
    out: str | Path,
    tokenizer: Any = None,
    *,
    qtype: str = "f16",
    source: str | Path | None = None,
    tokenizer_pre: str | None = None,
) -> Path:
    """Write one .gguf file; `qtype` is the weight type of the 2-D matrices."""
    import gguf

    from llmopt.models.gguf import permute_rope_rows
    from llmopt.models.spec import spec_for

    choice(qtype, GGUF_TYPES, "gguf type")
    out = check_output(out, source)
    config, spec = model.config, spec_for(model)
    if not spec.gguf_architectures:
        raise ValueError(f"architecture {spec.architecture!r} has no GGUF name")
    arch = spec.gguf_architectures[0]
    state = checked(dense_state_dict(model))

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_name(config.name)
        writer.add_file_type(int(getattr(gguf.LlamaFileType, _FILE_TYPES[qtype])))
        writer.add_vocab_size(config.vocab_size)
        writer.add_context_length(config.max_seq_len)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_heads)
        writer.add_head_count_kv(config.num_kv_heads)
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_dimension_count(config.head_dim)
        if config.head_dim != config.hidden_size // config.num_heads:
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
        if config.sliding_window is not None and spec.sliding_window:
            writer.add_sliding_window(config.sliding_window)
        if tokenizer is not None:
            _add_tokenizer(writer, tokenizer, tokenizer_pre, config.vocab_size)
        for name, tensor in state.items():
            g_name = gguf_name(name, spec.blocks)
            array = tensor.float().numpy()
            part = g_name.split(".")[2] if g_name.startswith("blk.") else ""
            if spec.gguf_permuted_qk and part in ("attn_q", "attn_k"):
                heads = config.num_heads if part == "attn_q" else config.num_kv_heads
                array = permute_rope_rows(array, heads)
            data, raw = _encode(array, qtype)
            if raw is None:
                writer.add_tensor(g_name, data)
            else:
                writer.add_tensor(g_name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write_with(out, write)
    return out
