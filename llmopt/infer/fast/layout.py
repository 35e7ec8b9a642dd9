"""The fast decode layout: a plain model's weights regrouped for the C++ decode step.

Applied by a function, never by editing the model: `decoder_weights(model)` reads the blocks
through the architecture's `ModelSpec` (fused groups, row-parallel outputs, norms), concatenates
each fused group (QKV, gate/up) into one weight so a layer is four GEMVs, and converts each
weight to a kernel kind:

- fp32 / fp16 `nn.Linear` -> fp32 rows; bf16 -> bf16 rows (both multiplied by fp32 activations),
- `QuantLinear` 4-bit -> codes repacked two per byte so one AVX2 load splits into two 32-column
  blocks (byte j of each 64-column chunk holds column j low, column 32 + j high); 8-bit -> codes,
- optionally an INT8 head (per-row symmetric codes), 4x fewer bytes than the fp32 tied head.

Everything the kernels need is derived here; the model keeps its own tensors untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.models.features import decoder_features
from llmopt.models.spec import ModelSpec, spec_for

F32, BF16, Q4, Q8 = 0, 1, 2, 3
KIND_NAMES = {F32: "fp32", BF16: "bf16", Q4: "int4", Q8: "int8"}


class UnsupportedModelError(LlmoptError, ValueError):
    """The model has a shape or layer kind the fast decode step does not implement."""


@dataclass
class KernelWeight:
    """One GEMV's operands in kernel layout (see decode.cpp `make_linear`)."""

    kind: int
    w: torch.Tensor
    scales: torch.Tensor | None = None  # fp32 [out, groups] (coded kinds)
    zs: torch.Tensor | None = None  # scale * zero point, fp32 [out, groups]
    bias: torch.Tensor | None = None
    group: int = -1

    def nbytes(self) -> int:
        """Bytes one GEMV reads (weights, scales, zero terms, bias)."""
        tensors = (self.w, self.scales, self.zs, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _is_quant(module: nn.Module) -> bool:
    return hasattr(module, "qweight") and hasattr(module, "bits") and hasattr(module, "scales")


def _float_weight(module: nn.Module) -> torch.Tensor:
    if _is_quant(module):
        return module.dequantize(torch.float32)
    return module.weight.detach()


def _bias(modules: list[nn.Module]) -> torch.Tensor | None:
    biases = [getattr(m, "bias", None) for m in modules]
    if all(b is None for b in biases):
        return None
    outs = [_float_weight(m).shape[0] if b is None else b.numel() for m, b in zip(modules, biases)]
    return torch.cat(
        [torch.zeros(n) if b is None else b.detach().float() for n, b in zip(outs, biases)]
    )


def _coded(modules: list[nn.Module]) -> KernelWeight | None:
    """Fused codes of QuantLinears sharing bits and group size, or None if not kernel-able."""
    from llmopt.compress.quant.formats import unpack_codes

    first = modules[0]
    same = all(_is_quant(m) for m in modules) and all(
        (m.bits, m.group_size, m.in_features) == (first.bits, first.group_size, first.in_features)
        for m in modules
    )
    k, group = first.in_features, first.group_size
    if not same or k % 64 or (group != -1 and group % 64):
        return None
    codes = torch.cat([unpack_codes(m.qweight, m.bits, k) for m in modules])
    scales = torch.cat([m.scales.float() for m in modules])
    zs = scales * torch.cat([m.zeros.float() for m in modules])
    if first.bits <= 4:
        chunks = codes.view(codes.shape[0], k // 64, 2, 32)
        w = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(codes.shape[0], k // 2)
        kind = Q4
    else:
        w, kind = codes, Q8
    return KernelWeight(kind, w.contiguous(), scales, zs, _bias(modules), group)


def kernel_weight(modules: list[nn.Module]) -> KernelWeight:
    """The GEMV for `modules` (linears reading one input) concatenated along output rows."""
    for m in modules:  # other wrappers (FP8, tensor-parallel) keep weights we cannot read
        if type(m) is not nn.Linear and not _is_quant(m):
            raise UnsupportedModelError(
                f"fast decode reads nn.Linear or QuantLinear, not {type(m).__name__}"
            )
    if any(_is_quant(m) for m in modules):
        coded = _coded(modules)
        if coded is not None:
            return coded
        # mixed or kernel-incompatible codes: exact dequantized fp32 rows instead
        w = torch.cat([_float_weight(m).float() for m in modules])
        return KernelWeight(F32, w.contiguous(), bias=_bias(modules))
    parts = [_float_weight(m) for m in modules]
    w = parts[0] if len(parts) == 1 else torch.cat(parts)  # a single weight is not copied
    if w.dtype == torch.bfloat16:
        return KernelWeight(BF16, w.contiguous(), bias=_bias(modules))
    return KernelWeight(F32, w.float().contiguous(), bias=_bias(modules))


def int8_rows(weight: torch.Tensor) -> KernelWeight:
    """Per-row symmetric INT8 codes of a weight (q - 128) * s, s = max|row| / 127."""
    w = weight.detach().float()
    s = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    codes = (torch.round(w / s).clamp(-127, 127) + 128).to(torch.uint8)
    return KernelWeight(Q8, codes.contiguous(), s, s * 128, None, -1)


def _role(spec: ModelSpec, prefix: str, names: tuple[str, ...]) -> str:
    for name in names:
        if name.startswith(prefix + "."):
            return name
    raise UnsupportedModelError(f"spec {spec.architecture!r} has no linear under {prefix!r}")


def decoder_weights(model: nn.Module, int8_head: bool = False) -> dict[str, Any]:
    """Everything the C++ decoder needs, read through `spec_for(model)`."""
    spec = spec_for(model)
    cfg = model.config
    extra = decoder_features(cfg)
    if extra:
        raise UnsupportedModelError(
            f"fast decode implements the Llama block; architecture {cfg.architecture!r} adds "
            f"{', '.join(extra)}"
        )
    if cfg.mlp_kind != "swiglu":
        raise UnsupportedModelError(
            f"fast decode implements SwiGLU MLPs, not mlp_kind={cfg.mlp_kind!r}"
        )
    fused = {g.name: g.parts for g in spec.fused}
    if set(fused) != {"qkv", "gate_up"}:
        raise UnsupportedModelError(
            f"fast decode needs fused groups 'qkv' and 'gate_up', spec has {sorted(fused)}"
        )
    o_name = _role(spec, spec.attention, spec.row_parallel)
    down_name = _role(spec, spec.feed_forward, spec.row_parallel)
    blocks = spec.blocks_of(model)
    attn = spec.block_module(blocks[0], spec.attention)
    layers: dict[str, list] = {"qkv": [], "o": [], "gate_up": [], "down": [], "in": [], "post": []}
    in_norm, post_norm = spec.block_norms
    for block in blocks:
        parts = {}
        for key, names in (("qkv", fused["qkv"]), ("gate_up", fused["gate_up"])):
            mods = [spec.block_module(block, n) for n in names]
            if any(m is None for m in mods):
                raise UnsupportedModelError(f"block lacks one of {names}")
            parts[key] = kernel_weight(mods)
        layers["qkv"].append(parts["qkv"])
        layers["gate_up"].append(parts["gate_up"])
        layers["o"].append(kernel_weight([spec.block_module(block, o_name)]))
        layers["down"].append(kernel_weight([spec.block_module(block, down_name)]))
        layers["in"].append(spec.block_module(block, in_norm).weight.detach())
        layers["post"].append(spec.block_module(block, post_norm).weight.detach())
    embed = spec.top_module(model, "embedding").weight.detach()
    if embed.dtype not in (torch.float32, torch.bfloat16):
        embed = embed.float()
    head_module = spec.top_module(model, "head")
    head = int8_rows(_float_weight(head_module)) if int8_head else kernel_weight([head_module])
    return {
        "heads": attn.num_heads,
        "kv_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "eps": float(cfg.rms_norm_eps),
        "embed": embed.contiguous(),
        "final_norm": spec.top_module(model, "final_norm").weight.detach(),
        "layers": layers,
        "head": head,
    }


def weight_bytes_per_token(weights: dict[str, Any]) -> int:
    """Bytes the fast step reads per token: every GEMV once, norms, one embedding row."""
    layers = weights["layers"]
    total = sum(w.nbytes() for key in ("qkv", "o", "gate_up", "down") for w in layers[key])
    total += sum(t.numel() * t.element_size() for t in layers["in"] + layers["post"])
    embed = weights["embed"]
    return total + weights["head"].nbytes() + embed.shape[1] * embed.element_size()
