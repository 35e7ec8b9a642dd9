"""`QuantLinear`: a drop-in `nn.Linear` replacement that computes from packed weights.

Backends (`backend="auto"` picks per call; measurements in docs/benchmarks/quant.md):
- ``int4pack``: bits <= 4, torch's CPU kernel `_weight_int4pack_mm_for_cpu` (tile-wise
  dequantisation inside the matmul). Needs out_features % 16 == 0; `in` is zero-padded to a
  multiple of the group (the padded weights meet zero activations, so they contribute nothing).
- ``int8pack``: bits 8 per-channel, `_weight_int8pack_mm` plus a rank-1 correction for the zero
  point: y = (x (q-128)^T) s + (128 - z) s sum(x).
- ``dequant``: any format; dequantises `tile_rows` output rows at a time and multiplies in the
  input's dtype, so no full-precision copy of the weight is ever held.

Both kernels are fast on CPU only with bfloat16 activations (fp32/fp16 inputs fall to slow
reference loops, 100-1000x slower), so they run in bf16: activations and the kernel's copy of
the scales are rounded to bf16, accumulation is fp32. "auto" uses a kernel for small batches of
rows (decode: <= `kernel_max_rows`) and exact dequantisation in the input dtype for prefill and
evaluation, where the matmul dominates and dequantising costs little.

The packed buffers (`qweight`, `scales`, `zeros`) are the saved state; kernel layouts are
derived from them lazily and are not saved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.models.packed.quant.format import (
    PackedWeight,
    QuantFormatError,
    check_bits_group,
    dequantize_codes,
    num_groups,
    unpack_codes,
)
from llmopt.models.spec import spec_for

BACKENDS = ("auto", "int4pack", "int8pack", "dequant")


class QuantLinear(nn.Module):
    """y = x W^T + b with W held as packed INT codes + fp16 group scales and zero points."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        bias: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        check_bits_group(bits, group_size)
        if backend not in BACKENDS:
            raise QuantFormatError(f"backend={backend!r}; valid choices: {', '.join(BACKENDS)}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        packed_in = in_features if bits == 8 else -(-in_features // 2)
        groups = num_groups(in_features, group_size)
        self.register_buffer("qweight", torch.zeros(out_features, packed_in, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16))
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.backend = backend
        self.tile_rows = 512
        self.kernel_max_rows = 16
        self._kernel: tuple | None = None
        self._kernel_key: tuple | None = None

    @classmethod
    def from_packed(
        cls, packed: PackedWeight, bias: torch.Tensor | None = None, backend: str = "auto"
    ) -> QuantLinear:
        layer = cls(
            packed.in_features,
            packed.out_features,
            packed.bits,
            packed.group_size,
            bias=bias is not None,
            backend=backend,
        )
        layer.qweight.copy_(packed.qweight)
        layer.scales.copy_(packed.scales)
        layer.zeros.copy_(packed.zeros)
        if bias is not None:
            layer.bias.data.copy_(bias.detach().float())
        return layer.to(packed.qweight.device)

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` must not round the fp16 scales (the format's dtype); devices move."""
        scales = self.scales
        super()._apply(fn, recurse)
        self.scales = scales.to(self.qweight.device)
        self.invalidate()
        return self

    def packed(self) -> PackedWeight:
        return PackedWeight(
            self.qweight, self.scales, self.zeros, self.bits, self.group_size, self.in_features
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.packed().dequantize(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, backend={self.resolved_backend()}"
        )

    def packed_nbytes(self) -> int:
        """Bytes of the saved packed state (codes, scales, zeros, bias)."""
        n = self.packed().nbytes()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def kernel_nbytes(self) -> int:
        """Extra bytes held by the derived kernel layout (0 before the first forward)."""
        if self._kernel is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._kernel if torch.is_tensor(t))

    # ---- backend selection ----
    def resolved_backend(self, rows: int = 1) -> str:
        if self.backend != "auto":
            return self.backend
        if rows > self.kernel_max_rows:
            return "dequant"
        if self.bits <= 4 and self.out_features % 16 == 0 and self.qweight.device.type == "cpu":
            return "int4pack"
        if self.bits == 8 and self.group_size == -1 and self.qweight.device.type == "cpu":
            return "int8pack"
        return "dequant"

    def invalidate(self) -> None:
        """Forget the derived kernel layout (call after editing the packed buffers)."""
        self._kernel = None
        self._kernel_key = None

    def _prepare(self, backend: str, dtype: torch.dtype) -> tuple:
        key = (backend, dtype, self.qweight.data_ptr(), self.qweight.device)
        if self._kernel is not None and self._kernel_key == key:
            return self._kernel
        codes = unpack_codes(self.qweight, self.bits, self.in_features)
        if backend == "int4pack":
            if self.bits > 4 or self.out_features % 16:
                raise QuantFormatError(
                    f"int4pack needs bits <= 4 and out_features % 16 == 0; got bits={self.bits}, "
                    f"out_features={self.out_features}"
                )
            if self.group_size == -1:  # one scale per row, repeated over 32-column groups
                kgs = 32
                groups = -(-self.in_features // kgs)
                scales = self.scales.float().expand(-1, groups)
                zeros = self.zeros.float().expand(-1, groups)
            else:
                kgs = self.group_size
                groups = num_groups(self.in_features, kgs)
                scales, zeros = self.scales.float(), self.zeros.float()
            k_pad = groups * kgs
            # the CPU kernel needs K a multiple of 32 x innerKTiles; group sizes >= 32 give that
            padded = F.pad(codes.to(torch.int32), (0, k_pad - self.in_features), value=8)
            weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(padded, 2)
            # kernel dequantises (q - 8) * s + m; ours is (q - z) * s, so m = (8 - z) * s
            sz = torch.stack([scales, (8 - zeros) * scales], dim=-1)
            sz = sz.transpose(0, 1).contiguous().to(dtype)
            self._kernel = (weight, sz, kgs, k_pad)
        elif backend == "int8pack":
            if self.bits != 8 or self.group_size != -1:
                raise QuantFormatError(
                    f"int8pack needs bits=8 and group_size=-1; got bits={self.bits}, "
                    f"group_size={self.group_size}"
                )
            weight = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
            scales = self.scales[:, 0].to(dtype)
            offset = (128 - self.zeros[:, 0].float()) * self.scales[:, 0].float()
            self._kernel = (weight, scales, offset)
        else:
            self._kernel = ()
        self._kernel_key = key
        return self._kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        backend = self.resolved_backend(x2.shape[0])
        dtype = torch.bfloat16 if backend != "dequant" else x.dtype
        x2 = x2.to(dtype)
        kernel = self._prepare(backend, dtype)
        if backend == "int4pack":
            weight, sz, kgs, k_pad = kernel
            if k_pad != self.in_features:
                x2 = F.pad(x2, (0, k_pad - self.in_features))
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), weight, kgs, sz)
        elif backend == "int8pack":
            weight, scales, offset = kernel
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), weight, scales)
            y = y.float() + x2.float().sum(-1, keepdim=True) * offset
        else:
            y = self._dequant_matmul(x2, dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _dequant_matmul(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = x2.new_empty(x2.shape[0], self.out_features)
        for r0 in range(0, self.out_features, self.tile_rows):
            r1 = min(r0 + self.tile_rows, self.out_features)
            codes = unpack_codes(self.qweight[r0:r1], self.bits, self.in_features)
            w = dequantize_codes(
                codes, self.scales[r0:r1], self.zeros[r0:r1], self.group_size, dtype=dtype
            )
            out[:, r0:r1] = x2 @ w.t()
        return out


def quant_linear_from_linear(
    linear: nn.Linear, packed: PackedWeight, backend: str = "auto"
) -> QuantLinear:
    if (packed.out_features, packed.in_features) != tuple(linear.weight.shape):
        raise QuantFormatError(
            f"packed weight {packed.out_features}x{packed.in_features} does not match the "
            f"linear layer {tuple(linear.weight.shape)}"
        )
    return QuantLinear.from_packed(packed, bias=linear.bias, backend=backend)


def retie_head(model: nn.Module) -> None:
    """Point a tied, unquantized head at the embedding again (casts and loads untie them)."""
    spec = spec_for(model)
    head = spec.top_module(model, "head")
    if model.config.tie_embeddings and not isinstance(head, QuantLinear):
        head.weight = spec.top_module(model, "embedding").weight
