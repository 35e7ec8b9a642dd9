"""Packed N:M weights: the N kept values of every group of M (fp16) + their positions as
ceil(log2 M)-bit indices, bit-packed row by row.

For 2:4 that is 2 x 16 bits of values + 2 x 2 bits of indices per 4 weights: 36 of 64 bits,
9/16 of dense fp16. The matmul dequantises (scatters the values back into a dense fp16 weight)
and calls the ordinary dense matmul, so its result is exactly that of the dense pruned weight —
and on a CPU it is no faster than dense (slower, by the scatter): speed from 2:4 needs sparse
tensor cores (see benchmarks/gpu_sparse24.py). The format is about bytes on disk and in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.models.packed.sparse.config import check_nm_shape

VALUE_DTYPE = torch.float16


def index_bits(m: int) -> int:
    """Bits per in-group position: 2 for M=4, 3 for M=8."""
    return max(1, math.ceil(math.log2(m)))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, k] integers < 2**bits -> [rows, ceil(k * bits / 8)] uint8, little-endian bits."""
    rows, k = codes.shape
    if codes.numel() and int(codes.max()) >= 2**bits:
        raise ValueError(f"a code exceeds {bits} bits")
    shifts = torch.arange(bits, dtype=torch.int32, device=codes.device)
    flat = ((codes.to(torch.int32)[..., None] >> shifts) & 1).reshape(rows, k * bits)
    pad = (-flat.shape[1]) % 8
    flat = F.pad(flat, (0, pad)).reshape(rows, -1, 8)
    weights = 1 << torch.arange(8, dtype=torch.int32, device=codes.device)
    return (flat * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of `pack_bits`: [rows, k] int64 codes."""
    rows = packed.shape[0]
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    flat = ((packed.to(torch.int32)[..., None] >> shifts) & 1).reshape(rows, -1)[:, : k * bits]
    weights = 1 << torch.arange(bits, dtype=torch.int64, device=packed.device)
    return (flat.reshape(rows, k, bits).long() * weights).sum(-1)


@dataclass(frozen=True)
class PackedNM:
    """values [out, in*n/m] fp16 and indices [out, bytes] uint8 of an N:M-sparse weight."""

    values: torch.Tensor
    indices: torch.Tensor
    n: int
    m: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.indices.numel()

    def positions(self) -> torch.Tensor:
        """[out, in/m, n] in-group positions of the kept values."""
        groups = self.in_features // self.m
        k = groups * self.n
        codes = unpack_bits(self.indices, index_bits(self.m), k)
        return codes.reshape(self.out_features, groups, self.n)

    def dense(self, dtype: torch.dtype = VALUE_DTYPE) -> torch.Tensor:
        """The dense [out, in] weight (zeros where pruned), exactly the packed values."""
        rows, groups = self.out_features, self.in_features // self.m
        out = torch.zeros(rows, groups, self.m, dtype=dtype, device=self.values.device)
        vals = self.values.reshape(rows, groups, self.n).to(dtype)
        out.scatter_(-1, self.positions(), vals)
        return out.reshape(rows, self.in_features)


def check_fp16_range(values: torch.Tensor) -> None:
    """Refuse NaN/inf and values fp16 cannot hold (they would silently become inf)."""
    if not bool(torch.isfinite(values).all()):
        raise ValueError("weight holds NaN or inf values; refusing to pack it")
    peak = float(values.abs().max()) if values.numel() else 0.0
    if peak > torch.finfo(VALUE_DTYPE).max:
        raise ValueError(f"weight magnitude {peak:g} exceeds the fp16 range of the packed format")


def pack_nm(weight: torch.Tensor, keep: torch.Tensor, n: int, m: int) -> PackedNM:
    """Pack a weight whose keep-mask has exactly n True in every group of m (checked)."""
    rows, cols = weight.shape
    check_nm_shape(cols, m)
    if keep.shape != weight.shape:
        raise ValueError(f"mask {tuple(keep.shape)} does not match weight {tuple(weight.shape)}")
    groups = keep.reshape(rows, cols // m, m)
    counts = groups.sum(-1)
    if not bool((counts == n).all()):
        bad = int((counts != n).sum())
        raise ValueError(f"{bad} groups of {m} do not keep exactly {n} weights: not {n}:{m} sparse")
    # positions of the kept entries, ascending (a stable sort puts True first, in order)
    pos = torch.sort(groups.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :n]
    values = weight.detach().reshape(rows, cols // m, m).gather(-1, pos)
    check_fp16_range(values)
    packed_idx = pack_bits(pos.reshape(rows, -1), index_bits(m))
    return PackedNM(values.reshape(rows, -1).to(VALUE_DTYPE).contiguous(), packed_idx, n, m, cols)


class SparseLinear(nn.Module):
    """A linear layer holding a packed N:M weight; forward = dense matmul of the unpacked
    weight (exact, no CPU speed-up). `cache_dense=True` keeps the unpacked weight."""

    def __init__(
        self, packed: PackedNM, bias: torch.Tensor | None = None, cache_dense: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.n, self.m = packed.n, packed.m
        self.register_buffer("values", packed.values)
        self.register_buffer("indices", packed.indices)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.cache_dense = cache_dense
        self._dense: torch.Tensor | None = None

    def packed(self) -> PackedNM:
        return PackedNM(self.values, self.indices, self.n, self.m, self.in_features)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self._dense is not None and self._dense.dtype == dtype:
            return self._dense
        w = self.packed().dense(VALUE_DTYPE).to(dtype)
        if self.cache_dense:
            self._dense = w
        return w

    def _apply(self, fn, *args, **kwargs):
        self._dense = None  # a cached unpacked weight would stay on the old device/dtype
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dense_weight(x.dtype), bias)

    def packed_nbytes(self) -> int:
        return self.packed().nbytes()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.n}:{self.m} packed fp16"
