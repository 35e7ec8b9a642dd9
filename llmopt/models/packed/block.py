"""Block-quantized weights kept as their file holds them (GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).

A weight W [out, in] is cut along `in` into blocks of `block` columns; each block has a scale s
and either a stored min m (W = code * s + m: Q4_1, Q4_K) or a fixed zero point z
(W = (code - z) * s: Q4_0 z=8, Q8_0 z=128 over codes shifted to unsigned, Q6_K z=32). Codes
are unsigned, 4-bit ones two per byte (even column in the low nibble, as
`llmopt.models.packed.quant.format.pack_codes`). Scales and mins stay as the file has them: fp16
per block (Q4_0/Q4_1/Q8_0), or the K-quants' two levels, integer sub-block scales (and mins)
times an fp16 scale per 256-column super-block: s = sub * super, m = -sub_min * super_min
(Q4_K), whose fp32 products are exact. Q6_K's 6-bit codes are kept one per byte.

`dequantize()` reproduces the `gguf` package's dequantization bit for bit; `forward`
dequantizes on the fly (row tiles, so no full fp32 copy is held), so the eager model,
calibration and exports run on these modules; the fused CPU kernels read the codes directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.errors import UsageError


@dataclass(frozen=True)
class BlockFormat:
    """How one GGML block type maps onto codes, scales and mins."""

    name: str
    bits: int  # code width in storage: 4 (two per byte) or 8
    block: int  # columns per scale
    scale_dtype: torch.dtype  # of the per-block scales (and mins)
    has_mins: bool  # W = code * scale + min; else W = (code - zero) * scale
    zero: float = 0.0
    super_block: int = 0  # K-quants: columns per fp16 super-scale (scales are sub-scales)


BLOCK_FORMATS = {
    f.name: f
    for f in (
        BlockFormat("q4_0", 4, 32, torch.float16, False, 8.0),
        BlockFormat("q4_1", 4, 32, torch.float16, True),
        BlockFormat("q8_0", 8, 32, torch.float16, False, 128.0),
        BlockFormat("q4_k", 4, 32, torch.uint8, True, super_block=256),
        BlockFormat("q6_k", 8, 16, torch.int8, False, 32.0, super_block=256),
    )
}


def block_format(name: str) -> BlockFormat:
    try:
        return BLOCK_FORMATS[name]
    except KeyError:
        raise UsageError(
            f"unknown block format {name!r}; valid: {', '.join(sorted(BLOCK_FORMATS))}"
        ) from None


BUFFERS = ("codes", "scales", "mins", "super_scales", "super_mins")


class _PackedBuffers(nn.Module):
    """codes / scales / mins (/ super-block scales) whose dtypes `.to(dtype)` must not change."""

    def _init_buffers(self, rows: int, cols: int, fmt: BlockFormat) -> None:
        unit = max(fmt.block, fmt.super_block)
        if cols % unit:
            raise UsageError(f"{fmt.name}: {cols} columns are not a multiple of {unit}")
        self.fmt = fmt
        packed = cols // 2 if fmt.bits == 4 else cols
        groups = cols // fmt.block
        self.register_buffer("codes", torch.zeros(rows, packed, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(rows, groups, dtype=fmt.scale_dtype))
        mins = torch.zeros(rows, groups, dtype=fmt.scale_dtype) if fmt.has_mins else None
        self.register_buffer("mins", mins)
        supers = cols // fmt.super_block if fmt.super_block else 0
        half = torch.float16
        self.register_buffer(
            "super_scales", torch.zeros(rows, supers, dtype=half) if supers else None
        )
        self.register_buffer(
            "super_mins", torch.zeros(rows, supers, dtype=half) if supers and fmt.has_mins else None
        )
        self.out_dtype = torch.float32

    def _apply(self, fn, recurse=True):
        """Devices move; the format's dtypes stay (`.to(bf16)` sets the output dtype only)."""
        kept = {name: getattr(self, name) for name in BUFFERS}
        super()._apply(fn, recurse)
        self.out_dtype = fn(torch.zeros(0, device=kept["codes"].device)).dtype
        device = self.codes.device
        for name, tensor in kept.items():
            if tensor is not None:
                setattr(self, name, tensor.to(device))
        return self

    def unpacked_codes(self, rows: slice = slice(None)) -> torch.Tensor:
        """uint8 codes [rows, cols], one per weight."""
        codes = self.codes[rows]
        if self.fmt.bits == 8:
            return codes
        return torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(codes.shape[0], -1)

    def _expand(self, sub: torch.Tensor, sup: torch.Tensor | None) -> torch.Tensor:
        values = sub.float()
        if sup is None:
            return values
        per = self.fmt.super_block // self.fmt.block
        return values * sup.float().repeat_interleave(per, dim=1)  # exact: small int x fp16

    def scale_values(self, rows=slice(None)) -> torch.Tensor:
        """fp32 scale of every block [rows, cols / block]."""
        sup = None if self.super_scales is None else self.super_scales[rows]
        return self._expand(self.scales[rows], sup)

    def min_values(self, rows=slice(None)) -> torch.Tensor | None:
        """fp32 min of every block (W = code * scale + min), None for zero-point formats."""
        if self.mins is None:
            return None
        if self.super_mins is None:
            return self.mins[rows].float()
        return -self._expand(self.mins[rows], self.super_mins[rows])

    def _dequantize(self, codes: torch.Tensor, rows) -> torch.Tensor:
        n, cols = codes.shape
        blocks = codes.float().view(n, cols // self.fmt.block, self.fmt.block)
        scale = self.scale_values(rows).unsqueeze(-1)
        mins = self.min_values(rows)
        if mins is not None:
            return (blocks * scale + mins.unsqueeze(-1)).view(n, cols)
        return ((blocks - self.fmt.zero) * scale).view(n, cols)

    def dequantize_rows(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        return self._dequantize(self.unpacked_codes(rows), rows).to(dtype)

    def packed_nbytes(self) -> int:
        """Bytes of the stored codes, scales and mins."""
        tensors = (getattr(self, name) for name in BUFFERS)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class BlockQuantLinear(_PackedBuffers):
    """y = x W^T + b with W held as block codes (see the module docstring)."""

    tile_rows = 4096  # rows dequantized at a time by the eager forward

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._init_buffers(out_features, in_features, block_format(fmt))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize_rows(slice(None), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        if n <= self.tile_rows:
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        parts = [
            F.linear(x, self.dequantize_rows(slice(r, min(r + self.tile_rows, n)), x.dtype))
            for r in range(0, n, self.tile_rows)
        ]
        out = torch.cat(parts, dim=-1)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.fmt.name}, bias={self.bias is not None}"
        )


class BlockQuantEmbedding(_PackedBuffers):
    """Token embeddings held as block codes: a lookup dequantizes only the rows it reads.

    `tie(head)` shares a `BlockQuantLinear`'s codes (a tied head and embedding are one tensor
    in the file and stay one in memory).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: str) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._init_buffers(num_embeddings, embedding_dim, block_format(fmt))

    @classmethod
    def tied_to(cls, head: BlockQuantLinear) -> BlockQuantEmbedding:
        embed = cls(head.out_features, head.in_features, head.fmt.name)
        for name in BUFFERS:
            setattr(embed, name, getattr(head, name))
        return embed

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize_rows(slice(None), dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)
        codes = self.codes[flat]
        if self.fmt.bits == 4:
            codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(flat.numel(), -1)
        rows = self._dequantize(codes, flat)
        return rows.view(*tokens.shape, rows.shape[-1]).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt.name}"
