"""Our module names -> the GGUF tensor kinds llama.cpp's converter writes them as, per
architecture (the writer's side; `llmopt.models.gguf` holds the reader's table).

Kinds are `gguf.constants.MODEL_TENSOR` member names; the exporter formats them with the
`gguf` package's own name table and checks each against the architecture's tensor list.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# our architecture -> what llama.cpp's converter writes as general.architecture (Mistral is
# registered under its LlamaModel: llama.cpp has no `mistral` text architecture)
LLAMA_CPP_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
}
# registered architectures the GGUF writer does not lay out yet, and why (llama.cpp reads
# these as stacked `ffn_*_exps` tensors, and DeepSeek's latent attention as `attn_kv_a_mqa`...)
NOT_EXPORTED = {
    "mixtral": "the routed experts are not yet written as llama.cpp's stacked ffn_*_exps",
    "qwen2_moe": "the routed and shared experts are not yet written as llama.cpp's ffn_*_exps",
    "qwen3_moe": "the routed experts are not yet written as llama.cpp's stacked ffn_*_exps",
    "deepseek_v3": "latent attention and routed experts are not yet laid out as llama.cpp's",
}
# spec attribute of a top-level module -> kind
TOP_TENSORS = {"embedding": "TOKEN_EMBD", "final_norm": "OUTPUT_NORM", "head": "OUTPUT"}
# block-level module -> kind (fused modules: Phi-3's, gate rows first in `ffn_up`)
BLOCK_TENSORS = {
    "input_layernorm": "ATTN_NORM",
    "self_attn.q_proj": "ATTN_Q",
    "self_attn.k_proj": "ATTN_K",
    "self_attn.v_proj": "ATTN_V",
    "self_attn.o_proj": "ATTN_OUT",
    "self_attn.q_norm": "ATTN_Q_NORM",
    "self_attn.k_norm": "ATTN_K_NORM",
    "self_attn.qkv_proj": "ATTN_QKV",
    "mlp.gate_proj": "FFN_GATE",
    "mlp.up_proj": "FFN_UP",
    "mlp.gate_up_proj": "FFN_UP",
    "mlp.down_proj": "FFN_DOWN",
}
# the norms by block kind: Llama's second norm feeds the MLP; Gemma 2's sandwich
BLOCK_NORM_TENSORS = {
    "pre_norm": {"post_attention_layernorm": "FFN_NORM"},
    "sandwich": {
        "post_attention_layernorm": "ATTN_POST_NORM",
        "pre_feedforward_layernorm": "FFN_NORM",
        "post_feedforward_layernorm": "FFN_POST_NORM",
    },
}
# kinds whose rows llama.cpp's converter permutes for its RoPE (spec.gguf_permuted_qk)
ROPE_PERMUTED = {"ATTN_Q": "num_heads", "ATTN_K": "num_kv_heads"}


def rope_divisors(config: Any) -> np.ndarray | None:
    """llama.cpp's `rope_freqs` tensor: base / scaled inverse frequency per pair (Llama 3.1's
    rescaling; llama.cpp divides each base frequency by it), or None without rescaling."""
    from llmopt.models.layers import rope_frequencies

    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return None
    base = rope_frequencies(config.replace(rope_scaling=None))
    return (base / rope_frequencies(config)).numpy().astype(np.float32)
