"""ModelSpec: what transformations need to know about an architecture, in one place.

Tensor parallelism, the pipeline split, FP8 conversion, RTN/AWQ/GPTQ, quantized loading, the
fused decode path and the drafts read module names from the spec instead of hard-coding
Llama's attribute names, so adding an architecture is one `register_spec` call beside its model.

Names are dotted paths: top-level ones relative to the model (`embed_tokens`), block-level ones
relative to one block (`self_attn.q_proj`). A block-level name the block does not have (e.g.
`mlp.gate_proj` in a GELU MLP) is skipped by every consumer (`block_module` returns None).

A model's architecture is `model.config.architecture` (set by `ModelConfig.from_hf_config` and
the GGUF loader, written back by `to_hf_config`); `spec_for(model)` returns its spec. Llama,
Qwen2, Mistral, Qwen3 and Phi-3 share one module layout (`llmopt.models.llama.Transformer`) and
differ only in the family flags (q/k/v biases, sliding window, GGUF Q/K permutation, Qwen3's
per-head q/k norms, Phi-3's fused checkpoint tensors); Gemma 2 adds the sandwich block of
`llmopt.models.gemma2`. A stage-deleted
model (modules set to None, blocks a ModuleDict subset) is walked with `named_blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmopt.errors import LlmoptError

if TYPE_CHECKING:  # the spec is data: the planner reads it without importing torch
    from torch import nn


class UnknownArchitectureError(LlmoptError, ValueError):
    """No spec is registered under that architecture name."""


@dataclass(frozen=True)
class ScalingGroup:
    """AWQ: linears that read the output of `prev` (a norm or a linear whose output channels
    can absorb 1/s), and the module (`inspect`) whose output error the scale search minimises.
    `inspect` empty: the error of the linears' own outputs. `needs`: modules the block must
    have for the fold to be exact (e.g. a gate that makes up's output enter down linearly)."""

    prev: str
    linears: tuple[str, ...]
    inspect: str = ""
    needs: tuple[str, ...] = ()


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
    hf_model_type: str = ""  # config.json's model_type (default: the architecture name)
    # what distinguishes family members that share the module layout
    attention_bias: bool = False  # q/k/v biases by default (Qwen2)
    sliding_window: bool = False  # attention may be limited to a window of recent keys
    gguf_permuted_qk: bool = True  # llama.cpp's converter permuted Q/K rows (RoPE layout)
    # what the block computes beyond the Llama block (consumers that reimplement the forward
    # read `llmopt.models.features.decoder_features` and refuse what they lack)
    block_kind: str = "pre_norm"  # "sandwich": Gemma 2's norms around attention and MLP too
    scaled_embedding: bool = False  # embeddings multiplied by sqrt(hidden) (Gemma)
    norm_weight_offset: float = 0.0  # HF stores w, the norm multiplies by w + offset (Gemma: 1)
    # checkpoint tensors that fuse our linears along output rows (Phi-3's qkv_proj), split at
    # load and fused again at save; names are block-level, parts in concatenation order
    hf_fused: tuple[FusedGroup, ...] = ()
    # block-level modules the HF checkpoint names differently: (ours, HF's), `*` an index
    # (Mixtral's block_sparse_moe.experts.*.w1 is our mlp.experts.*.gate_proj)
    hf_renames: tuple[tuple[str, str], ...] = ()
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    gate_activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    # ModelConfig fields beyond the Llama ones that this architecture may set
    config_fields: tuple[str, ...] = ()
    # top level (relative to the model)
    embedding: str = "embed_tokens"
    blocks: str = "layers"
    final_norm: str = "norm"
    head: str = "lm_head"
    # inside one block
    attention: str = "self_attn"  # has num_heads / num_kv_heads that TP divides
    attention_core: str = "self_attn.core"  # softmax(QK^T)V alone: selective recompute wraps it
    feed_forward: str = "mlp"  # the block's MLP module (a MoE block where the config has experts)
    feed_forward_norm: str = "post_attention_layernorm"  # the norm whose output it reads
    # mixture of experts (`llmopt.models.experts`): where the routed experts and the router
    # live in a MoE block (empty: the architecture has no MoE blocks)
    experts: str = ""
    router: str = ""
    column_parallel: tuple[str, ...] = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    )
    row_parallel: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    replicated_linears: tuple[str, ...] = ()  # whole on every TP rank (MLA's down projections)
    latent_attention: bool = False  # DeepSeek's multi-head latent attention (`config.mla`)
    block_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    # block norms applied to a branch's output before the residual add (Gemma 2's post-norms):
    # they read the reduced row-parallel output and feed no column-parallel linear
    branch_norms: tuple[str, ...] = ()
    # norms inside attention over each head (Qwen3's q/k norms): replicated weights that
    # tensor parallelism's head split leaves each rank a partial gradient of
    head_norms: tuple[str, ...] = ()
    awq_groups: tuple[ScalingGroup, ...] = (
        ScalingGroup(
            "input_layernorm",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn",
        ),
        ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",)),
        ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ScalingGroup("mlp.up_proj", ("mlp.down_proj",), needs=("mlp.gate_proj",)),
    )
    # AWQ searches no clipping range for these (they feed a softmax through RoPE)
    awq_no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
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

    def __post_init__(self) -> None:
        if not self.hf_model_type:
            object.__setattr__(self, "hf_model_type", self.architecture)

    @property
    def block_linears(self) -> tuple[str, ...]:
        """Every linear of a block (FP8 and quantization targets), column-parallel first."""
        return self.column_parallel + self.row_parallel + self.replicated_linears

    # ---- access by name ----
    def blocks_of(self, model: nn.Module) -> nn.ModuleList:
        return getattr(model, self.blocks)

    def named_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(qualified name, block) of the blocks a model (or a pipeline stage) holds.

        Works for a full ModuleList and for a stage's ModuleDict keyed by original index.
        """
        return [
            (f"{self.blocks}.{key}", block) for key, block in self.blocks_of(model).named_children()
        ]

    def named_block_modules(
        self, block: nn.Module, names: tuple[str, ...]
    ) -> list[tuple[str, nn.Module]]:
        """(name, module) for each of `names` the block has, in the given order. A `*` part
        (`mlp.experts.*.gate_proj`) stands for every child of the container before it, in
        index order: the experts a block (or, under expert parallelism, a rank) holds."""
        found = []
        for name in names:
            for full in self.expand(block, name):
                module = self.block_module(block, full)
                if module is not None:
                    found.append((full, module))
        return found

    def expand(self, block: nn.Module, name: str) -> list[str]:
        """The concrete names a (possibly `*`) block-level name stands for in this block."""
        head, star, tail = name.partition(".*.")
        if not star:
            return [name]
        container = self.block_module(block, head)
        if container is None:
            return []
        keys = sorted((k for k, _ in container.named_children()), key=int)
        return [f"{head}.{k}.{tail}" for k in keys]

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


def spec_for_hf(hf_architecture: str, model_type: str | None = None) -> ModelSpec:
    """The spec of a HF `architectures[0]` (or, failing that, of its `model_type`)."""
    for spec in _SPECS.values():
        if hf_architecture in spec.hf_architectures:
            return spec
    for spec in _SPECS.values():
        if model_type is not None and model_type == spec.hf_model_type:
            return spec
    supported = sorted(a for spec in _SPECS.values() for a in spec.hf_architectures)
    raise UnknownArchitectureError(
        f"unsupported architecture {hf_architecture!r}; supported: {supported}"
    )


def spec_for_gguf(gguf_architecture: str) -> ModelSpec:
    """The spec of a GGUF `general.architecture`."""
    for spec in _SPECS.values():
        if gguf_architecture in spec.gguf_architectures:
            return spec
    supported = sorted(a for spec in _SPECS.values() for a in spec.gguf_architectures)
    raise UnknownArchitectureError(
        f"unsupported architecture {gguf_architecture!r}; supported: {', '.join(supported)}"
    )


def spec_for(model: nn.Module) -> ModelSpec:
    """The spec of a model built by llmopt (its config names the architecture)."""
    return get_spec(getattr(model.config, "architecture", "llama"))


# The three share one module layout (llmopt.models.llama.Transformer builds all of them).
register_spec(
    ModelSpec(
        "llama",
        hf_architectures=("LlamaForCausalLM",),
        gguf_architectures=("llama",),
    )
)
register_spec(
    ModelSpec(
        "qwen2",
        hf_architectures=("Qwen2ForCausalLM",),
        gguf_architectures=("qwen2",),
        attention_bias=True,
        gguf_permuted_qk=False,  # llama.cpp writes Qwen2's Q/K rows unpermuted
    )
)
register_spec(
    ModelSpec(
        "mistral",
        hf_architectures=("MistralForCausalLM",),
        gguf_architectures=("mistral",),
        sliding_window=True,
    )
)
register_spec(
    ModelSpec(
        "qwen3",
        hf_architectures=("Qwen3ForCausalLM",),
        gguf_architectures=("qwen3",),
        gguf_permuted_qk=False,
        qk_norm=True,
        head_norms=("self_attn.q_norm", "self_attn.k_norm"),
    )
)
register_spec(
    ModelSpec(
        "phi3",
        hf_architectures=("Phi3ForCausalLM",),
        sliding_window=True,
        gguf_permuted_qk=False,
        hf_fused=(
            FusedGroup(
                "self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            ),
            FusedGroup("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
        ),
    )
)
_SANDWICH_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
register_spec(
    ModelSpec(
        "gemma2",
        hf_architectures=("Gemma2ForCausalLM",),
        sliding_window=True,
        gguf_permuted_qk=False,
        block_kind="sandwich",
        scaled_embedding=True,
        norm_weight_offset=1.0,
        block_norms=_SANDWICH_NORMS,
        feed_forward_norm="pre_feedforward_layernorm",
        branch_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        awq_groups=(  # the MLP reads pre_feedforward_layernorm (post_attention's is on the branch)
            ScalingGroup(
                "input_layernorm",
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "self_attn",
            ),
            ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",)),
            ScalingGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
            ScalingGroup("mlp.up_proj", ("mlp.down_proj",), needs=("mlp.gate_proj",)),
        ),
        gate_activation="gelu_tanh",
        config_fields=(
            "attn_softcap",
            "final_softcap",
            "query_pre_attn_scalar",
            "full_attention_every",
        ),
    )
)


# Mixture-of-experts architectures: the Llama-family attention (DeepSeek: latent attention)
# with a MoE block (`llmopt.models.experts.MoE`) as the feed-forward of the blocks the config
# makes sparse; the dense names stay listed (DeepSeek's first blocks are dense MLPs).
_FF_IN = ("mlp.gate_proj", "mlp.up_proj", "mlp.experts.*.gate_proj", "mlp.experts.*.up_proj",
          "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")  # fmt: skip
_FF_OUT = ("mlp.down_proj", "mlp.experts.*.down_proj", "mlp.shared_experts.down_proj")


def _moe(attn_in: tuple[str, ...], **fields) -> ModelSpec:
    """A MoE architecture's spec: `attn_in` its attention's column-parallel linears."""
    names = {
        "experts": "mlp.experts",
        "router": "mlp.gate",
        "column_parallel": (*attn_in, *_FF_IN),
        "row_parallel": ("self_attn.o_proj", *_FF_OUT),
        "gptq_order": (attn_in, ("self_attn.o_proj",), _FF_IN, _FF_OUT),
    }
    return register_spec(ModelSpec(**{**names, **fields}))


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MIXTRAL = (("gate", "w1"), ("up", "w3"), ("down", "w2"))
_moe(_QKV, architecture="mixtral", hf_architectures=("MixtralForCausalLM",), sliding_window=True,
     hf_renames=(("mlp.gate", "block_sparse_moe.gate"),
                 *((f"mlp.experts.*.{a}_proj", f"block_sparse_moe.experts.*.{b}") for a, b in _MIXTRAL)))  # fmt: skip
_moe(_QKV, architecture="qwen2_moe", hf_architectures=("Qwen2MoeForCausalLM",),
     attention_bias=True, gguf_permuted_qk=False,
     hf_renames=(("mlp.shared_experts", "mlp.shared_expert"),))  # fmt: skip
_moe(_QKV, architecture="qwen3_moe", hf_architectures=("Qwen3MoeForCausalLM",),
     gguf_permuted_qk=False, qk_norm=True, head_norms=("self_attn.q_norm", "self_attn.k_norm"))  # fmt: skip
# DeepSeek-V3: the low-rank down projections are whole on every TP rank (Megatron's MLA)
_moe(("self_attn.q_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj"),
     architecture="deepseek_v3", hf_architectures=("DeepseekV3ForCausalLM",),
     gguf_permuted_qk=False, latent_attention=True,
     replicated_linears=("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
     awq_groups=(
         ScalingGroup("input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa",
                                          "self_attn.q_proj"), "self_attn"),
         ScalingGroup("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
         ScalingGroup("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
         ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
         ScalingGroup("mlp.up_proj", ("mlp.down_proj",), needs=("mlp.gate_proj",)),
     ))  # fmt: skip
