"""The fused layout of a model: its weights regrouped for the C++ forward, read through its spec.

Applied by a function, never by editing the model: `fused_layout(model)` walks the blocks
through the architecture's `ModelSpec` (fused groups, row-parallel outputs, block and head
norms) and the modules' own attributes (each attention core's window, scale and soft-cap), so
every registered architecture maps onto one C++ block with switches:
- q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), one sliding window or per-layer windows
  (Mistral, Phi-3, Gemma 2), sandwich norms, sqrt(hidden)-scaled embeddings, GeGLU / GELU MLPs,
  attention and final-logit soft-capping, query_pre_attn_scalar (Gemma 2).
Each projection becomes kernel weights (`tiles.py`): parts of a fused group that share a
format are concatenated into one; parts that do not (e.g. a GGUF mixing Q4_K and Q6_K) stay
separate segments of the same projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.infer.fast.tiles import (
    CODED,
    KernelWeight,
    coded_view,
    coded_weight,
    float_weight,
    int8_rows,
)
from llmopt.models.spec import ModelSpec, spec_for

MLP_SILU_GATED, MLP_GELU_GATED, MLP_GELU = 0, 1, 2


class UnsupportedModelError(LlmoptError, ValueError):
    """The model holds a layer kind the fused kernels do not implement."""


@dataclass
class LayerLayout:
    norms: list[torch.Tensor]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: list[KernelWeight]
    o: list[KernelWeight]
    up: list[KernelWeight]
    down: list[KernelWeight]
    window: int  # 0: every key


@dataclass
class FusedLayout:
    shape: dict[str, Any]
    embed: KernelWeight
    blocks: list[LayerLayout]
    final_norm: torch.Tensor
    head: list[KernelWeight]
    cos: torch.Tensor
    sin: torch.Tensor
    kinds: list[str] = field(default_factory=list)  # weight formats of the block projections

    def nbytes_per_token(self) -> int:
        """Bytes one token reads: every projection once, norms, the head, one embedding row."""
        total = sum(
            w.nbytes()
            for layer in self.blocks
            for part in (layer.qkv, layer.o, layer.up, layer.down)
            for w in part
        )
        for layer in self.blocks:
            norms = [*layer.norms, layer.q_norm, layer.k_norm]
            total += sum(t.numel() * 4 for t in norms if t is not None)
        total += sum(w.nbytes() for w in self.head) + self.final_norm.numel() * 4
        return total + self.embed.nbytes() // self.embed.n


def _check_module(module: nn.Module, what: str) -> None:
    from llmopt.models.layers import SoftcappedLinear

    if type(module) in (nn.Linear, SoftcappedLinear):
        return
    if coded_view(module) is not None or hasattr(module, "dequantize"):
        return
    raise UnsupportedModelError(
        f"fused kernels read nn.Linear, QuantLinear or packed GGUF weights; {what} is "
        f"{type(module).__name__}"
    )


def _float_of(module: nn.Module) -> torch.Tensor:
    if hasattr(module, "dequantize"):
        return module.dequantize(torch.float32)
    return module.weight.detach()


def projection(modules: list[nn.Module], what: str) -> list[KernelWeight]:
    """Kernel weights computing `modules` (linears reading one input), outputs concatenated."""
    for module in modules:
        _check_module(module, what)
    segments: list[KernelWeight] = []
    pending: list = []  # coded views waiting to be fused
    for module in modules:
        view = coded_view(module)
        if view is not None and (not pending or pending[0].key() == view.key()):
            pending.append(view)
            continue
        if pending:
            segments.append(coded_weight(pending))
            pending = []
        if view is not None:
            pending = [view]
            continue
        bias = getattr(module, "bias", None)
        segments.append(
            float_weight(_float_of(module), None if bias is None else bias.detach().float())
        )
    if pending:
        segments.append(coded_weight(pending))
    return _merge_float(segments)


def _merge_float(segments: list[KernelWeight]) -> list[KernelWeight]:
    """Adjacent float segments of one dtype become one weight (one GEMM instead of several)."""
    merged: list[KernelWeight] = []
    for seg in segments:
        prev = merged[-1] if merged else None
        if prev is not None and seg.kind != CODED and prev.kind == seg.kind:
            bias = None
            if prev.bias is not None or seg.bias is not None:
                bias = torch.cat([
                    prev.bias if prev.bias is not None else torch.zeros(prev.n),
                    seg.bias if seg.bias is not None else torch.zeros(seg.n),
                ])  # fmt: skip
            merged[-1] = float_weight(torch.cat([prev.w, seg.w]), bias)
        else:
            merged.append(seg)
    return merged


def _one(spec: ModelSpec, block: nn.Module, prefix: str, names: tuple[str, ...]) -> nn.Module:
    for name in names:
        if name.startswith(prefix + "."):
            module = spec.block_module(block, name)
            if module is not None:
                return module
    raise UnsupportedModelError(f"spec {spec.architecture!r} has no linear under {prefix!r}")


def _ffn_kind(model: nn.Module, spec: ModelSpec) -> int:
    if model.config.mlp_kind == "gelu":
        return MLP_GELU
    if spec.gate_activation == "gelu_tanh":
        return MLP_GELU_GATED
    if spec.gate_activation == "silu":
        return MLP_SILU_GATED
    raise UnsupportedModelError(f"gate activation {spec.gate_activation!r} is not implemented")


def _layer(model: nn.Module, spec: ModelSpec, block: nn.Module, index: int) -> LayerLayout:
    fused = {g.name: g.parts for g in spec.fused}
    where = f"layer {index}"
    norms = [spec.block_module(block, name) for name in spec.block_norms]
    if any(n is None for n in norms):
        raise UnsupportedModelError(f"{where} lacks one of the norms {spec.block_norms}")
    qkv = [m for _, m in spec.named_block_modules(block, fused["qkv"])]
    if len(qkv) != 3:
        raise UnsupportedModelError(f"{where} lacks one of {fused['qkv']}")
    up = [m for _, m in spec.named_block_modules(block, fused["gate_up"])]
    head_norms = dict(spec.named_block_modules(block, spec.head_norms))
    core = spec.block_module(block, spec.attention_core)
    window = getattr(core, "window", None)
    return LayerLayout(
        norms=[n.weight.detach().float().contiguous() for n in norms],
        q_norm=_norm_weight(head_norms, "q_norm"),
        k_norm=_norm_weight(head_norms, "k_norm"),
        qkv=projection(qkv, f"{where} qkv"),
        o=projection([_one(spec, block, spec.attention, spec.row_parallel)], f"{where} o"),
        up=projection(up, f"{where} gate/up"),
        down=projection([_one(spec, block, spec.feed_forward, spec.row_parallel)], f"{where} down"),
        window=int(window) if window else 0,
    )


def _norm_weight(found: dict[str, nn.Module], suffix: str) -> torch.Tensor | None:
    for name, module in found.items():
        if name.endswith(suffix):
            return module.weight.detach().float().contiguous()
    return None


def fused_layout(model: nn.Module, int8_head: bool = False) -> FusedLayout:
    """Everything the C++ forward needs, read through `spec_for(model)` (module docstring)."""
    spec = spec_for(model)
    cfg = model.config
    beyond = [
        what
        for what, field in (
            ("mixture-of-experts feed-forwards", "moe"),
            ("multi-head latent attention", "mla"),
        )  # fmt: skip
        if getattr(cfg, field, None) is not None
    ]
    if beyond:
        raise UnsupportedModelError(
            f"fused kernels implement dense feed-forwards and grouped-query attention; "
            f"architecture {cfg.architecture!r} has {' and '.join(beyond)} (the eager runner "
            "serves it)"
        )
    blocks = spec.blocks_of(model)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) != cfg.num_layers:
        raise UnsupportedModelError("fused kernels run whole models, not pipeline stages")
    top = {name: spec.top_module(model, name) for name in ("embedding", "final_norm", "head")}
    if any(m is None for m in top.values()):
        raise UnsupportedModelError("fused kernels need the embedding, final norm and head")
    attn = spec.block_module(blocks[0], spec.attention)
    core = spec.block_module(blocks[0], spec.attention_core)
    layers = [_layer(model, spec, block, i) for i, block in enumerate(blocks)]
    head_module = top["head"]
    _check_module(head_module, "the head")
    if int8_head and coded_view(head_module) is None:  # a coded head stays as it is
        head = [coded_weight([int8_rows(_float_of(head_module))])]
    else:
        head = projection([head_module], "the head")
    embed = _embedding(top["embedding"], head_module, head)
    scale = getattr(core, "scale", None)
    shape = {
        "hidden": cfg.hidden_size,
        "heads": attn.num_heads,
        "kv_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "inter": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
        "eps": float(cfg.rms_norm_eps),
        "sandwich": spec.block_kind == "sandwich",
        "ffn": _ffn_kind(model, spec),
        "embed_scale": math.sqrt(cfg.hidden_size) if spec.scaled_embedding else 1.0,
        "attn_scale": float(scale) if scale is not None else 0.0,
        "attn_softcap": float(getattr(core, "softcap", None) or 0.0),
        "final_softcap": float(cfg.final_softcap or 0.0),
    }
    kinds = sorted(
        {w.name for layer in layers for p in (layer.qkv, layer.o, layer.up, layer.down) for w in p}
    )
    rotary = model.rotary
    return FusedLayout(
        shape=shape,
        embed=embed,
        blocks=layers,
        final_norm=top["final_norm"].weight.detach().float().contiguous(),
        head=head,
        cos=rotary.cos.float().contiguous(),
        sin=rotary.sin.float().contiguous(),
        kinds=kinds,
    )


def _embedding(module: nn.Module, head_module: nn.Module, head: list[KernelWeight]) -> KernelWeight:
    """The lookup table; a coded head holding the same codes is shared, not copied."""
    codes = getattr(module, "codes", None)
    if codes is not None and getattr(head_module, "codes", None) is codes and len(head) == 1:
        if head[0].kind == CODED and head[0].name == module.fmt.name:
            return head[0]
    view = coded_view(module)
    if view is not None:
        return coded_weight([view])
    if hasattr(module, "dequantize"):
        return float_weight(module.dequantize(torch.float32), None)
    return float_weight(module.weight, None)
