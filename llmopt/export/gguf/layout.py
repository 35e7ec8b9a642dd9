"""How llama.cpp lays out each registered architecture: names, fused tensors, hyperparameters.

What llama.cpp's `convert_hf_to_gguf.py` does per architecture, for our models:
- the architecture it writes: Mistral is written as `llama` (llama.cpp has no `mistral`
  text architecture; the converter registers MistralForCausalLM under LlamaModel);
- Llama and Mistral Q/K rows permuted for llama.cpp's RoPE (the spec's `gguf_permuted_qk`);
- Phi-3's q/k/v fused into `attn_qkv` and gate/up into `ffn_up` (the spec's `hf_fused`);
- Gemma 2's sandwich norms (`post_attention_norm`, `ffn_norm` before the MLP, `post_ffw_norm`)
  with weights w + 1, which our Gemma 2 already holds (the loaders added the spec's
  `norm_weight_offset`), its soft-caps and every-other-layer sliding window;
- Llama 3.1's RoPE rescaling as a `rope_freqs` tensor of per-frequency divisors.
The per-architecture tables (architecture names, our module -> tensor kind) live with the
models in `llmopt.models.gguf_names`; every tensor name is checked against the `gguf`
package's list for the architecture, so a name llama.cpp would not load is refused here rather
than by llama.cpp.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from llmopt.export.output import ExportError
from llmopt.models.gguf_names import (
    BLOCK_NORM_TENSORS,
    BLOCK_TENSORS,
    LLAMA_CPP_ARCH,
    NOT_EXPORTED,
    ROPE_PERMUTED,
    TOP_TENSORS,
    rope_divisors,
)


def llama_cpp_arch(architecture: str) -> str:
    if architecture in NOT_EXPORTED:
        raise ExportError(
            f"GGUF export of {architecture!r} is not supported: {NOT_EXPORTED[architecture]}; "
            f"export it as safetensors (`llmopt export --format hf`) or ONNX instead"
        )
    if architecture not in LLAMA_CPP_ARCH:
        raise ExportError(
            f"architecture {architecture!r} has no llama.cpp name; GGUF export supports "
            f"{', '.join(sorted(LLAMA_CPP_ARCH))}"
        )
    return LLAMA_CPP_ARCH[architecture]


class _Names:
    """Our tensor names -> GGUF names for one architecture, checked against gguf's table."""

    def __init__(self, spec: Any, arch: str) -> None:
        from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

        self.spec = spec
        self.arch = arch
        by_name = {name: key for key, name in MODEL_ARCH_NAMES.items()}
        self.allowed = {TENSOR_NAMES[t] for t in MODEL_TENSORS[by_name[arch]]}
        self.tensor_names = TENSOR_NAMES
        self.kinds = MODEL_TENSOR
        block = {**BLOCK_TENSORS, **BLOCK_NORM_TENSORS[spec.block_kind]}
        self.block = {module: getattr(MODEL_TENSOR, kind) for module, kind in block.items()}
        self.top = {
            getattr(spec, attr): getattr(MODEL_TENSOR, k) for attr, k in TOP_TENSORS.items()
        }

    def kind(self, name: str) -> str:
        """The MODEL_TENSOR member name of one of our block tensors ('' for top-level ones)."""
        module = name.rsplit(".", 1)[0]
        inner = module.split(".", 2)[2] if module.startswith(f"{self.spec.blocks}.") else ""
        return self.block[inner].name if inner in self.block else ""

    def __call__(self, name: str) -> str:
        module, leaf = name.rsplit(".", 1)
        index = None
        if module in self.top:
            kind = self.top[module]
        else:
            prefix, _, rest = module.partition(".")
            index, _, inner = rest.partition(".")
            if prefix != self.spec.blocks or inner not in self.block:
                raise ExportError(f"tensor {name!r} has no GGUF name in llama.cpp's {self.arch}")
            kind = self.block[inner]
        template = self.tensor_names[kind]
        if template not in self.allowed:
            raise ExportError(
                f"llama.cpp's {self.arch} architecture has no {template!r} tensor (from {name!r})"
            )
        return f"{template.format(bid=index)}.{leaf}"


def gguf_tensors(
    state: dict[str, torch.Tensor], config: Any, spec: Any
) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in PyTorch's [out, in] order) in llama.cpp's layout."""
    from llmopt.models.gguf import permute_rope_rows

    arch = llama_cpp_arch(spec.architecture)
    names = _Names(spec, arch)
    fused = {part: group for group in spec.hf_fused for part in group.parts}
    divisors = rope_divisors(config)
    if divisors is not None:
        rope = names.tensor_names[names.kinds.ROPE_FREQS]
        if rope not in names.allowed:
            raise ExportError(f"llama.cpp's {arch} cannot hold RoPE rescaling (rope_freqs)")
    for name, tensor in state.items():
        module, leaf = name.rsplit(".", 1)
        prefix, _, rest = module.partition(".")
        index, _, inner = rest.partition(".")
        group = fused.get(inner) if prefix == spec.blocks else None
        if group is not None:
            if inner != group.parts[0]:
                continue  # written with the group's first part
            pieces = [state[f"{prefix}.{index}.{part}.{leaf}"] for part in group.parts]
            tensor, name = torch.cat(pieces, 0), f"{prefix}.{index}.{group.name}.{leaf}"
        array = tensor.float().numpy()
        heads = ROPE_PERMUTED.get(names.kind(name))
        if spec.gguf_permuted_qk and heads is not None:
            array = permute_rope_rows(array, getattr(config, heads))
        if name == f"{spec.embedding}.weight" and divisors is not None:
            yield f"{names.tensor_names[names.kinds.ROPE_FREQS]}.weight", divisors
        yield names(name), array


def check_representable(config: Any, spec: Any) -> None:
    """Refuse what llama.cpp's graph for the architecture would compute differently."""
    arch = llama_cpp_arch(spec.architecture)
    if arch == "gemma2":
        if not config.tie_embeddings:
            raise ExportError("llama.cpp's gemma2 ties the output head to the embedding")
        every = config.full_attention_every
        if config.sliding_window is not None and every not in (None, 2):
            raise ExportError(
                f"llama.cpp's gemma2 alternates sliding and full attention every 2 layers; "
                f"this model has full_attention_every={every}"
            )
        # llama.cpp scales queries by 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for 46 layers
        expected = (
            config.hidden_size / config.num_heads if config.num_layers == 46 else config.head_dim
        )
        scalar = config.query_pre_attn_scalar or config.head_dim
        if not math.isclose(scalar, expected):
            raise ExportError(
                f"llama.cpp's gemma2 scales queries by 1/sqrt({expected:g}); this model's "
                f"query_pre_attn_scalar is {scalar:g}"
            )


def add_hyperparameters(writer: Any, config: Any, spec: Any) -> None:
    """The `{arch}.*` keys llama.cpp reads for the architecture."""
    arch = llama_cpp_arch(spec.architecture)
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
    if arch == "gemma2" or config.head_dim != config.hidden_size // config.num_heads:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch == "gemma2":
        if config.attn_softcap is not None:
            writer.add_attn_logit_softcapping(config.attn_softcap)
        if config.final_softcap is not None:
            writer.add_final_logit_softcapping(config.final_softcap)
    if arch == "gemma2":  # without the key llama.cpp assumes Gemma 2's 4096
        writer.add_sliding_window(config.sliding_window or config.max_seq_len)
    if arch == "phi3":  # 0: no window (llama.cpp tells Phi-4 apart that way)
        writer.add_sliding_window(config.sliding_window or 0)
        writer.add_rope_scaling_orig_ctx_len(config.max_seq_len)
