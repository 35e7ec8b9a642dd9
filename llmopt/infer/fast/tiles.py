"""Weights in the fused kernels' layout: fp32/bf16 rows, or coded 16-row tiles.

Every coded weight is first read as a `CodedView` (W = code * scale + min per group of
columns, codes unsigned) from whatever holds it:
- `BlockQuantLinear` / `BlockQuantEmbedding` (GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks, as loaded),
- `QuantLinear` (llmopt's INT2-4/INT8 with fp16 scales and integer zero points),
- `int8_rows(weight)`: an opt-in per-row INT8 copy of a float head.
Views of linears that read one input and share a format are concatenated along output rows
(fused QKV, gate/up), then tiled: 16 rows per tile, per 32-column block 8 lines of 16 int32
lanes (lane i of line k: the 4 codes of row i at columns 4k..4k+3), 4-bit lines paired into
one byte each (line m low nibble, line m + 4 high), 6-bit ones (Q6_K) likewise plus two planes
of their top 2 bits. Scales/mins become [tiles, groups, 16] (the K-quants' integer sub-scales
too, with their fp16 super-scales as [tiles, k / 256, 16]).
Nothing here edits the model; the kernels get copies in their layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

F32, BF16, CODED = 0, 1, 2
KIND_NAMES = {F32: "fp32", BF16: "bf16", CODED: "coded"}
TILE, BLOCK = 16, 32


@dataclass
class CodedView:
    """A weight as unsigned codes with W = code * scale + min (min = -zero * scale if absent)."""

    codes: torch.Tensor  # uint8 [n, k], one per weight
    bits: int  # container width: 4, 6 (Q6_K) or 8
    group: int  # columns per scale: a multiple of 32, or 16 (Q6_K)
    scales: torch.Tensor  # [n, groups] fp16 or fp32; K-quant sub-scales (uint8 Q4_K, int8 Q6_K)
    mins: torch.Tensor | None  # same shape and dtype family, or None
    zero: float
    bias: torch.Tensor | None
    name: str  # format, for reports (q4_1, int4-g128, ...)
    super_scales: torch.Tensor | None = None  # K-quants: fp16 [n, k / 256] (Q4_K's mins too)
    super_mins: torch.Tensor | None = None

    def key(self) -> tuple:
        """What must agree for views to share one fused weight."""
        mins = None if self.mins is None else self.mins.dtype
        return (self.bits, self.group, self.codes.shape[1], self.scales.dtype, mins, self.zero)


def _is_quant_linear(module: nn.Module) -> bool:
    return hasattr(module, "qweight") and hasattr(module, "bits") and hasattr(module, "zeros")


def _is_block_quant(module: nn.Module) -> bool:
    return hasattr(module, "codes") and hasattr(module, "fmt")


def coded_view(module: nn.Module) -> CodedView | None:
    """The module's weight as codes, or None when it is not coded or the kernels cannot read
    its grouping (columns not a multiple of 32)."""
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach().float()
    if _is_block_quant(module):
        fmt = module.fmt
        codes = module.unpacked_codes()
        if (fmt.block % BLOCK and fmt.block != 16) or codes.shape[1] % BLOCK:
            return None
        if fmt.super_block and fmt.has_mins:  # Q4_K: both levels kept (6-bit subs, fp16)
            return CodedView(codes, fmt.bits, fmt.block, module.scales, module.mins, 0.0, bias,
                             fmt.name, module.super_scales, module.super_mins)  # fmt: skip
        if fmt.super_block:  # Q6_K: 6-bit codes, int8 sub-scales x fp16 super-scales
            return CodedView(codes, 6, fmt.block, module.scales, None, fmt.zero, bias, fmt.name,
                             module.super_scales)  # fmt: skip
        return CodedView(codes, fmt.bits, fmt.block, module.scales, module.mins, fmt.zero, bias,
                         fmt.name)  # fmt: skip
    if _is_quant_linear(module):
        from llmopt.models.packed.quant.format import unpack_codes

        k = module.in_features
        group = k if module.group_size == -1 else module.group_size
        if k % BLOCK or group % BLOCK:
            return None
        codes = unpack_codes(module.qweight, module.bits, k)
        zeros = module.zeros
        if bool((zeros == zeros.flatten()[0]).all()):  # symmetric: one zero point
            mins, zero = None, float(zeros.flatten()[0])
        else:  # -z * s is exact in fp32 (fp16 scale times an integer below 256)
            mins, zero = -(zeros.float() * module.scales.float()), 0.0
        name = f"int{module.bits}-g{module.group_size}"
        return CodedView(codes, 4 if module.bits <= 4 else 8, group, module.scales, mins, zero,
                         bias, name)  # fmt: skip
    return None


def int8_rows(weight: torch.Tensor) -> CodedView:
    """Per-row symmetric INT8 codes of a float weight: (q - 128) * s, s = max|row| / 127."""
    w = weight.detach().float()
    s = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    codes = (torch.round(w / s).clamp(-127, 127) + 128).to(torch.uint8)
    return CodedView(codes, 8, w.shape[1], s, None, 128.0, None, "int8-row")


def tile_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [n, k] -> [tiles, k / 32, 256 (4-bit) | 384 (6-bit) | 512 (8-bit)]: see the
    module docstring; 6-bit codes add two planes holding the top 2 bits of lines 0-3, 4-7."""
    n, k = codes.shape
    tiles = -(-n // TILE)
    if tiles * TILE != n:
        codes = torch.cat([codes, codes.new_zeros(tiles * TILE - n, k)])
    c = codes.view(tiles, TILE, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # [T, B, line, row, 4]
    if bits == 8:
        return c.reshape(tiles, k // BLOCK, -1).contiguous()
    low = (c[:, :, :4] & 0x0F) | ((c[:, :, 4:] & 0x0F) << 4)
    parts = [low.reshape(tiles, k // BLOCK, -1)]
    if bits == 6:
        top = (c >> 4).reshape(tiles, k // BLOCK, 2, 4, TILE * 4)  # [T, B, plane, q, 64]
        planes = (
            top[:, :, :, 0] | top[:, :, :, 1] << 2 | top[:, :, :, 2] << 4 | top[:, :, :, 3] << 6
        )
        parts.append(planes.reshape(tiles, k // BLOCK, -1))
    return torch.cat(parts, dim=-1).contiguous()


def tile_lanes(values: torch.Tensor) -> torch.Tensor:
    """[n, groups] -> [tiles, groups, 16] (padded rows are zero)."""
    n, groups = values.shape
    tiles = -(-n // TILE)
    if tiles * TILE != n:
        values = torch.cat([values, values.new_zeros(tiles * TILE - n, groups)])
    return values.view(tiles, TILE, groups).permute(0, 2, 1).contiguous()


@dataclass
class KernelWeight:
    """One projection's weight in kernel layout (see make_float_linear / make_coded_linear)."""

    kind: int
    n: int
    k: int
    w: torch.Tensor | None = None  # F32 / BF16 rows
    bits: int = 0
    group: int = 0
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    zero: float = 0.0
    bias: torch.Tensor | None = None
    name: str = ""
    super_scales: torch.Tensor | None = None
    super_mins: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes one pass over the weight reads (tiles include their padding rows)."""
        tensors = (self.w, self.codes, self.scales, self.mins, self.bias, self.super_scales,
                   self.super_mins)  # fmt: skip
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def to_cpp(self, kmod: Any) -> Any:
        if self.kind == CODED:
            return kmod.make_coded_linear(
                self.n, self.k, self.bits, self.group, self.codes, self.scales, self.mins,
                self.zero, self.bias, self.super_scales, self.super_mins,
            )  # fmt: skip
        return kmod.make_float_linear(self.w, self.bias)


def coded_weight(views: list[CodedView]) -> KernelWeight:
    """Views sharing a format (`CodedView.key`) concatenated along rows and tiled."""
    first = views[0]
    codes = torch.cat([v.codes for v in views]) if len(views) > 1 else first.codes
    scales = torch.cat([v.scales for v in views])
    mins = None if first.mins is None else torch.cat([v.mins for v in views])
    supers = {}
    for name in ("super_scales", "super_mins"):
        if getattr(first, name) is not None:
            supers[name] = tile_lanes(torch.cat([getattr(v, name) for v in views]))
    bias = None
    if any(v.bias is not None for v in views):
        bias = torch.cat(
            [v.bias if v.bias is not None else torch.zeros(v.codes.shape[0]) for v in views]
        )
    return KernelWeight(
        CODED,
        codes.shape[0],
        codes.shape[1],
        bits=first.bits,
        group=first.group,
        codes=tile_codes(codes, first.bits),
        scales=tile_lanes(scales),
        mins=None if mins is None else tile_lanes(mins),
        zero=first.zero,
        bias=bias,
        name=first.name,
        **supers,
    )


def float_weight(weight: torch.Tensor, bias: torch.Tensor | None, name: str = "") -> KernelWeight:
    """fp32 rows (fp16 and fp32 weights) or bf16 rows; a float32 weight is not copied."""
    w = weight.detach()
    if w.dtype != torch.bfloat16:
        w = w.float()
    kind = BF16 if w.dtype == torch.bfloat16 else F32
    return KernelWeight(kind, w.shape[0], w.shape[1], w=w.contiguous(), bias=bias,
                        name=name or KIND_NAMES[kind])  # fmt: skip
