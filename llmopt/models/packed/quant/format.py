"""The one packed weight format every quantizer produces.

A weight W [out, in] is cut along `in` into groups of `group_size` columns (the last group may
be shorter when `in` is not a multiple, e.g. SmolLM2's 576 with g128; `group_size=-1` means
one group per output row). Each group has an fp16 scale s and an integer zero point z, and each
weight a code q in [0, 2^bits - 1] with W ~ (q - z) * s.

Storage: codes of bits <= 4 are packed two per byte (even column in the low nibble), 8-bit codes
one per byte; scales fp16 [out, groups]; zero points uint8 [out, groups]. 3-bit codes use the
4-bit container (no 3-bit bit-stream packing), so W3 costs the same bytes as W4.

Scales are rounded to fp16 *before* codes are chosen, so what is stored reproduces exactly the
dequantised weights the quantizer evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.errors import LlmoptError

VALID_BITS = (2, 3, 4, 8)
VALID_GROUP_SIZES = (-1, 32, 64, 128)


class QuantFormatError(LlmoptError, ValueError):
    """A quantization setting or packed tensor that the format cannot hold."""


def check_bits_group(bits: int, group_size: int) -> None:
    """Reject unsupported settings early, listing the valid choices."""
    if bits not in VALID_BITS:
        raise QuantFormatError(
            f"bits={bits!r} is not supported; valid choices: {', '.join(map(str, VALID_BITS))}"
        )
    if group_size not in VALID_GROUP_SIZES:
        raise QuantFormatError(
            f"group_size={group_size!r} is not supported; valid choices: "
            f"{', '.join(map(str, VALID_GROUP_SIZES))} (-1 = one group per output channel)"
        )


def num_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


def effective_group(in_features: int, group_size: int) -> int:
    return in_features if group_size == -1 else group_size


def _grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> ([out, groups, gs] zero-padded, validity mask of the same shape)."""
    out_f, in_f = w.shape
    gs = effective_group(in_f, group_size)
    groups = num_groups(in_f, group_size)
    pad = groups * gs - in_f
    mask = torch.ones(in_f, dtype=torch.bool, device=w.device)
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
        mask = torch.nn.functional.pad(mask, (0, pad))
    return w.reshape(out_f, groups, gs), mask.reshape(1, groups, gs)


def compute_qparams(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    max_abs: torch.Tensor | None = None,
    shrink: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (scale fp32 with fp16-representable values, integer zero as float) [out, G].

    `max_abs` [out, G] optionally clips the range (AWQ's clipping search): the group's values
    are clamped to [-max_abs, max_abs] first. `shrink` scales the range [min, max] toward 0
    (GPTQ's range search).
    """
    check_bits_group(bits, group_size)
    maxq = 2**bits - 1
    grouped, mask = _grouped(w.float(), group_size)
    wmax = torch.where(mask, grouped, -torch.inf).amax(-1)
    wmin = torch.where(mask, grouped, torch.inf).amin(-1)
    if max_abs is not None:
        wmax = torch.minimum(wmax, max_abs)
        wmin = torch.maximum(wmin, -max_abs)
    wmax, wmin = wmax * shrink, wmin * shrink
    if sym:
        absmax = torch.maximum(wmax.abs(), wmin.abs())
        scale = absmax / (2 ** (bits - 1) - 1)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        scale = (wmax - wmin) / maxq
        scale = _fp16_scale(scale)
        zero = torch.clamp(torch.round(-wmin / scale), 0, maxq)
        return scale, zero
    return _fp16_scale(scale), zero


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    scale = scale.clamp(min=1e-7).half().float()
    return torch.where(scale > 0, scale, torch.full_like(scale, 2.0**-24))


def quantize_codes(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """Codes uint8 [out, in] for given per-group params."""
    out_f, in_f = w.shape
    gs = effective_group(in_f, group_size)
    s = scale.repeat_interleave(gs, dim=1)[:, :in_f]
    z = zero.repeat_interleave(gs, dim=1)[:, :in_f]
    q = torch.clamp(torch.round(w.float() / s) + z, 0, 2**bits - 1)
    return q.to(torch.uint8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [out, in] -> packed uint8 ([out, ceil(in/2)] for bits <= 4)."""
    if bits == 8:
        return codes.contiguous()
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_codes(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of `pack_codes`."""
    if bits == 8:
        return qweight
    low, high = qweight & 0x0F, qweight >> 4
    return torch.stack([low, high], dim=-1).reshape(qweight.shape[0], -1)[:, :in_features]


@dataclass
class PackedWeight:
    """One quantized weight matrix in the packed format."""

    qweight: torch.Tensor  # uint8 [out, in/2] (bits <= 4) or [out, in] (bits 8)
    scales: torch.Tensor  # fp16 [out, groups]
    zeros: torch.Tensor  # uint8 [out, groups]
    bits: int
    group_size: int
    in_features: int

    def __post_init__(self) -> None:
        check_bits_group(self.bits, self.group_size)
        out_f = self.scales.shape[0]
        groups = num_groups(self.in_features, self.group_size)
        packed_in = self.in_features if self.bits == 8 else -(-self.in_features // 2)
        expect = {
            "qweight": ((out_f, packed_in), torch.uint8),
            "scales": ((out_f, groups), torch.float16),
            "zeros": ((out_f, groups), torch.uint8),
        }
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise QuantFormatError(
                    f"{name} has shape {tuple(t.shape)} {t.dtype}; expected {shape} {dtype} for "
                    f"{self.bits}-bit, group_size={self.group_size}, in_features={self.in_features}"
                )

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    def codes(self) -> torch.Tensor:
        return unpack_codes(self.qweight, self.bits, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_codes(self.codes(), self.scales, self.zeros, self.group_size, dtype=dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))


def dequantize_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    out_f, in_f = codes.shape
    gs = effective_group(in_f, group_size)
    s = scales.float().repeat_interleave(gs, dim=1)[:, :in_f]
    z = zeros.float().repeat_interleave(gs, dim=1)[:, :in_f]
    return ((codes.float() - z) * s).to(dtype)


def pack_weight(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool = False,
    scale: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
) -> PackedWeight:
    """Round-to-nearest into the packed format (params computed unless given)."""
    check_bits_group(bits, group_size)
    if w.dim() != 2:
        raise QuantFormatError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    if scale is None or zero is None:
        scale, zero = compute_qparams(w, bits, group_size, sym)
    codes = quantize_codes(w, scale, zero, bits, group_size)
    return PackedWeight(
        qweight=pack_codes(codes, bits),
        scales=scale.half(),
        zeros=zero.to(torch.uint8),
        bits=bits,
        group_size=group_size,
        in_features=w.shape[1],
    )


def fake_quantize(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool = False,
    max_abs: torch.Tensor | None = None,
) -> torch.Tensor:
    """quantize -> dequantize in the weight's dtype (what the searches score)."""
    scale, zero = compute_qparams(w, bits, group_size, sym, max_abs=max_abs)
    codes = quantize_codes(w, scale, zero, bits, group_size)
    return dequantize_codes(codes, scale, zero, group_size, dtype=w.dtype)
