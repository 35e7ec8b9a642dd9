"""Block-quantized weights kept as their file holds them (GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).

A weight W [out, in] is cut along `in` into blocks of `block` columns; each block has a scale s
and either a stored min m (W = code * s + m: Q4_1, Q4_K) or a fixed zero point z
(W = (code - z) * s: Q4_0 z=8, Q8_0 z=128 over codes shifted to unsigned, Q6_K z=32). Codes
are unsigned, 4-bit ones two per byte (even column in the low nibble, as
`llmopt.compress.quant.formats.pack_codes`). Scales and mins stay fp16 where the file has fp16
(Q4_0/Q4_1/Q8_0: the same bytes as the file); K-quants' 6/8-bit sub-scales times the fp16
super-block scale are kept as their exact fp32 products.

`dequantize()` reproduces the `gguf` package's dequantization bit for bit; `forward`
dequantizes on the fly (row tiles, so no full fp32 copy is held), so the eager model,
calibration and exports run on these modules; the fused CPU kernels read the codes directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BlockFormat:
    """How one GGML block type maps onto codes, scales and mins."""

    name: str
    bits: int  # code width in storage: 4 (two per byte) or 8
    block: int  # columns per scale
    scale_dtype: torch.dtype
    has_mins: bool  # W = code * scale + min; else W = (code - zero) * scale
    zero: float = 0.0


BLOCK_FORMATS = {
    f.name: f
    for f in (
        BlockFormat("q4_0", 4, 32, torch.float16, False, 8.0),
        BlockFormat("q4_1", 4, 32, torch.float16, True),
        BlockFormat("q8_0", 8, 32, torch.float16, False, 128.0),
        BlockFormat("q4_k", 4, 32, torch.float32, True),
        BlockFormat("q6_k", 8, 16, torch.float32, False, 32.0),
    )
}


def block_format(name: str) -> BlockFormat:
    try:
        return BLOCK_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown block format {name!r}; valid: {', '.join(sorted(BLOCK_FORMATS))}"
        ) from None


class _PackedBuffers(nn.Module):
    """codes / scales / mins buffers whose dtypes `.to(dtype)` must not change."""

    def _init_buffers(self, rows: int, cols: int, fmt: BlockFormat) -> None:
        if cols % fmt.block:
            raise ValueError(
                f"{fmt.name}: {cols} columns are not a multiple of the block size {fmt.block}"
            )
        self.fmt = fmt
        packed = cols // 2 if fmt.bits == 4 else cols
        self.register_buffer("codes", torch.zeros(rows, packed, dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(rows, cols // fmt.block, dtype=fmt.scale_dtype))
        mins = torch.zeros(rows, cols // fmt.block, dtype=fmt.scale_dtype) if fmt.has_mins else None
        self.register_buffer("mins", mins)
        self.out_dtype = torch.float32

    def _apply(self, fn, recurse=True):
        """Devices move; the format's dtypes stay (`.to(bf16)` sets the output dtype only)."""
        kept = {name: getattr(self, name) for name in ("codes", "scales", "mins")}
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

    def dequantize_rows(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        codes = self.unpacked_codes(rows).float()
        n, cols = codes.shape
        blocks = codes.view(n, cols // self.fmt.block, self.fmt.block)
        scale = self.scales[rows].float().unsqueeze(-1)
        if self.fmt.has_mins:
            w = blocks * scale + self.mins[rows].float().unsqueeze(-1)
        else:
            w = (blocks - self.fmt.zero) * scale
        return w.view(n, cols).to(dtype)

    def packed_nbytes(self) -> int:
        """Bytes of the stored codes, scales and mins."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.codes, self.scales, self.mins)
            if t is not None
        )


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
        embed.codes, embed.scales, embed.mins = head.codes, head.scales, head.mins
        return embed

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize_rows(slice(None), dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)
        codes = self.codes[flat]
        if self.fmt.bits == 4:
            codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(flat.numel(), -1)
        n, cols = codes.shape
        blocks = codes.float().view(n, cols // self.fmt.block, self.fmt.block)
        scale = self.scales[flat].float().unsqueeze(-1)
        if self.fmt.has_mins:
            rows = blocks * scale + self.mins[flat].float().unsqueeze(-1)
        else:
            rows = (blocks - self.fmt.zero) * scale
        return rows.view(*tokens.shape, cols).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.fmt.name}"
