"""What an architecture computes or stores beyond the Llama block, for code that reimplements it.

Most of llmopt runs a model through its own modules (the pipeline, tensor parallelism, FP8,
quantization, drafts), which carry every architecture's math. A few consumers re-derive the
forward pass (the fused C++ decode step, the paged batch runner, the ONNX graph) or write
checkpoints under HF names themselves; they call `require_llama_block` /
`require_llama_checkpoint` so a model they cannot represent is refused, never run wrongly.
"""

from __future__ import annotations

from typing import Any

from llmopt.errors import LlmoptError
from llmopt.models.spec import get_spec


class UnsupportedArchitectureError(LlmoptError, ValueError):
    """A consumer that implements only the Llama block was given a model with more."""


def decoder_features(config: Any, windows: bool = False) -> tuple[str, ...]:
    """The forward-pass features of `config` that a plain Llama block lacks (empty: none).
    `windows`: the consumer implements one sliding window for all layers (Mistral, Phi-3)."""
    spec = get_spec(config.architecture)
    found = []
    if config.sliding_window is not None and not windows:
        found.append(f"sliding-window attention (window {config.sliding_window})")
    if spec.qk_norm:
        found.append("per-head q/k RMSNorm")
    if spec.block_kind != "pre_norm":
        found.append(f"{spec.block_kind} block norms")
    if spec.scaled_embedding:
        found.append("sqrt(hidden)-scaled embeddings")
    if spec.gate_activation != "silu":
        found.append(f"{spec.gate_activation} gated MLP")
    if config.attn_softcap is not None:
        found.append("attention soft-capping")
    if config.final_softcap is not None:
        found.append("final-logit soft-capping")
    if config.query_pre_attn_scalar is not None:
        found.append("query_pre_attn_scalar")
    if config.full_attention_every is not None:
        found.append("per-layer sliding windows")
    if getattr(config, "moe", None) is not None:
        found.append("mixture-of-experts feed-forward")
    if getattr(config, "mla", None) is not None:
        found.append("multi-head latent attention")
    return tuple(found)


def checkpoint_features(config: Any) -> tuple[str, ...]:
    """How the architecture's HF checkpoint differs from our state dict (empty: not at all)."""
    spec = get_spec(config.architecture)
    found = [f"fused {g.name}" for g in spec.hf_fused]
    if spec.norm_weight_offset:
        found.append(f"norm weights stored minus {spec.norm_weight_offset:g}")
    return tuple(found)


def require_llama_block(config: Any, consumer: str, windows: bool = False) -> None:
    """Raise when `consumer` (which implements the Llama block) cannot run this config."""
    found = decoder_features(config, windows)
    if found:
        raise UnsupportedArchitectureError(
            f"{consumer} implements the Llama block; architecture {config.architecture!r} adds "
            f"{', '.join(found)} (use the eager model)"
        )


def require_llama_checkpoint(config: Any, consumer: str) -> None:
    """Raise when `consumer` writes tensors under plain HF names and the layout differs."""
    found = checkpoint_features(config)
    if found:
        raise UnsupportedArchitectureError(
            f"{consumer} writes the Llama checkpoint layout; architecture "
            f"{config.architecture!r} has {', '.join(found)}"
        )
