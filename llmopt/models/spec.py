"""ModelSpec: what transformations need to know about an architecture, in one place.

Tensor parallelism, the pipeline split, FP8 conversion, RTN/AWQ/GPTQ, quantized loading, the
fused decode path and the drafts read module names from the spec instead of hard-coding
Llama's attribute names, so adding an architecture is one `register_spec` call beside its model.

Names are dotted paths: top-level ones relative to the model (`embed_tokens`), block-level ones
relative to one block (`self_attn.q_proj`). A block-level name the block does not have (e.g.
`mlp.gate_proj` in a GELU MLP) is skipped by every consumer (`block_module` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the spec is data: the planner reads it without importing torch
    from torch import nn


class UnknownArchitectureError(ValueError):
    """No spec is registered under that architecture name."""


@dataclass(frozen=True)
class ScalingGroup:
    """AWQ: linears that read the output of `prev` (a norm or a linear whose output channels
    can absorb 1/s), and the module (`inspect`) whose output error the scale search minimises.
    `inspect` empty: the error of the linears' own outputs."""

    prev: str
    linears: tuple[str, ...]
    inspect: str = ""


@dataclass(frozen=True)
class FusedGroup:
    """Linears reading the same input that a fused layout concatenates along output rows."""

    name: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    hf_architectures: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()
    # top level (relative to the model)
    embedding: str = "embed_tokens"
    blocks: str = "layers"
    final_norm: str = "norm"
    head: str = "lm_head"
    # inside one block
    attention: str = "self_attn"  # has num_heads / num_kv_heads that TP divides
    mlp: str = "mlp"
    column_parallel: tuple[str, ...] = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    )
    row_parallel: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    block_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    awq_groups: tuple[ScalingGroup, ...] = (
        ScalingGroup(
            "input_layernorm",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn",
        ),
        ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",)),
        ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ScalingGroup("mlp.up_proj", ("mlp.down_proj",)),
    )
    # GPTQ quantizes these groups in order, re-running the block between them
    gptq_order: tuple[tuple[str, ...], ...] = (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    )
    fused: tuple[FusedGroup, ...] = (
        FusedGroup("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        FusedGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj")),
    )
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def block_linears(self) -> tuple[str, ...]:
        """Every linear of a block (FP8 and quantization targets), column-parallel first."""
        return self.column_parallel + self.row_parallel

    # ---- access by name ----
    def blocks_of(self, model: nn.Module) -> nn.ModuleList:
        return getattr(model, self.blocks)

    def block_module(self, block: nn.Module, name: str) -> nn.Module | None:
        """The submodule `name` of a block, or None where this block has none."""
        module: nn.Module | None = block
        for part in name.split("."):
            module = getattr(module, part, None)
            if module is None:
                return None
        return module

    def top_module(self, model: nn.Module, name: str) -> nn.Module | None:
        """embedding / final_norm / head of a (possibly stage-deleted) model, or None."""
        return getattr(model, getattr(self, name), None)


_SPECS: dict[str, ModelSpec] = {}


def register_spec(spec: ModelSpec) -> ModelSpec:
    if spec.architecture in _SPECS:
        raise ValueError(f"architecture {spec.architecture!r} is already registered")
    _SPECS[spec.architecture] = spec
    return spec


def registered_architectures() -> list[str]:
    return sorted(_SPECS)


def get_spec(architecture: str) -> ModelSpec:
    try:
        return _SPECS[architecture]
    except KeyError:
        raise UnknownArchitectureError(
            f"unknown architecture {architecture!r}; registered: {', '.join(sorted(_SPECS))}"
        ) from None


def spec_for(model: nn.Module) -> ModelSpec:
    """The spec of a model built by llmopt (its config names the architecture)."""
    return get_spec(getattr(model.config, "architecture", "llama"))


register_spec(
    ModelSpec(
        "llama",
        hf_architectures=("LlamaForCausalLM",),
        gguf_architectures=("llama",),
    )
)
