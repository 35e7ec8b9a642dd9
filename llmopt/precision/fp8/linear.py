"""`Float8Linear`: an nn.Linear whose three GEMMs take FP8 operands, and device support.

Forward `y = x W^T` in E4M3 x E4M3; backward `dx = dy W` and `dW = dy^T x` with E5M2
gradients under HYBRID. Operands are saved in FP8 for backward (TE's activation saving).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import nn

from llmopt.precision.fp8.cast import (
    E4M3,
    GEMM_ALIGNMENT,
    HIGH_PRECISION_DTYPES,
    ROLES,
    Fp8Error,
    Recipe,
    make_recipe,
    role_dtype,
)
from llmopt.precision.fp8.scaler import Fp8Scaler

GemmKind = Literal["scaled_mm", "emulated"]

# ---------------------------------------------------------------------------------------------
# Device support
# ---------------------------------------------------------------------------------------------


@functools.cache
def _cpu_scaled_mm_error() -> str | None:
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    a = torch.zeros(16, 16, dtype=E4M3)
    one = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch {torch.__version__} has no CPU FP8 GEMM ({str(exc).splitlines()[0]})"
    return None


def fp8_gemm_unsupported_reason(device: torch.device | str) -> str | None:
    """Why `torch._scaled_mm` cannot run FP8 GEMMs on `device`, or None when it can."""
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_scaled_mm_error()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available in this torch build"
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            name = torch.cuda.get_device_name(device)
            return (
                f"{name} has compute capability {capability[0]}.{capability[1]}; FP8 GEMMs "
                "need 8.9+ (Ada, Hopper, Blackwell)"
            )
        return None
    return f"no FP8 GEMM on device type {device.type!r} (supported: cpu, cuda sm_89+)"


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows up to a multiple (zero rows add nothing to a weight gradient's sum)."""
    extra = -t.shape[0] % multiple
    if extra == 0:
        return t
    # fp8 tensors have no pad kernel on every backend: pad the raw bytes.
    raw = t.view(torch.uint8)
    return torch.cat([raw, raw.new_zeros(extra, *t.shape[1:])]).view(t.dtype)


def _fp8_mm(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    gemm: GemmKind,
) -> torch.Tensor:
    """(a / sa) @ (b / sb) with fp32 accumulation; a row-major, b column-major (cuBLASLt)."""
    if gemm == "scaled_mm":
        return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer: Float8Linear, compute_dtype: torch.dtype):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        x_fp8, x_inv = layer.scalers["input"].quantize(x2)
        w_fp8, w_inv = layer.scalers["weight"].quantize(weight)
        out = _fp8_mm(x_fp8, x_inv, w_fp8.t(), w_inv, compute_dtype, layer.gemm)
        if bias is not None:
            out = out + bias.to(compute_dtype)
        # Saved in FP8: the activation memory of these GEMMs shrinks 2-4x, as in TE.
        ctx.save_for_backward(x_fp8, x_inv, w_fp8, w_inv)
        ctx.layer = layer
        ctx.shapes = (x.shape, x.dtype, weight.dtype, bias is not None)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x_fp8, x_inv, w_fp8, w_inv = ctx.saved_tensors
        layer: Float8Linear = ctx.layer
        x_shape, x_dtype, w_dtype, has_bias = ctx.shapes
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g_fp8, g_inv = layer.scalers["grad_output"].quantize(g2)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dx = dy @ W: W [N, K] must be handed over column-major.
            w_col = w_fp8.t().contiguous().t()
            grad_x = _fp8_mm(g_fp8, g_inv, w_col, w_inv, x_dtype, layer.gemm).reshape(x_shape)
        if ctx.needs_input_grad[1]:
            # dW = dy^T @ x; the token dim is the GEMM's inner dim here, so it is padded.
            g_t = _pad_rows(g_fp8, GEMM_ALIGNMENT).t().contiguous()
            x_col = _pad_rows(x_fp8, GEMM_ALIGNMENT).t().contiguous().t()
            grad_w = _fp8_mm(g_t, g_inv, x_col, x_inv, w_dtype, layer.gemm)
        if has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.float().sum(0).to(w_dtype)
        return grad_x, grad_w, grad_b, None, None


class Float8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8 (E4M3 forward, E5M2 gradients).

    The parameters stay what they were (fp32 master weights, the same Parameter objects when
    built with `from_linear`); only the GEMM operands are cast, at every call. Subclassing
    nn.Linear keeps `weight`, `bias`, `in_features`, `out_features` where sharding code
    expects them.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: str | Recipe = "current",
        gemm: GemmKind = "scaled_mm",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_fp8(make_recipe(recipe), gemm)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: str | Recipe = "current", gemm: GemmKind = "scaled_mm"
    ) -> Float8Linear:
        """Wrap an existing linear layer, sharing its parameters.

        Everything the old module carried comes along (its hooks, e.g. tensor parallelism's
        output all-reduce, and attributes such as `tp_dim` on its parameters), so FP8 can be
        applied before or after sharding.
        """
        new = cls.__new__(cls)
        new.__dict__.update(
            {k: v.copy() if isinstance(v, dict) else v for k, v in linear.__dict__.items()}
        )
        new._setup_fp8(make_recipe(recipe), gemm)
        return new

    def _setup_fp8(self, recipe: Recipe, gemm: GemmKind) -> None:
        if gemm not in ("scaled_mm", "emulated"):
            raise Fp8Error(f"gemm={gemm!r} is not supported; choose 'scaled_mm' or 'emulated'")
        if self.weight.dtype not in HIGH_PRECISION_DTYPES:
            raise Fp8Error(
                f"Float8Linear needs a float32/bfloat16/float16 master weight, got "
                f"{self.weight.dtype}"
            )
        for name in ("in_features", "out_features"):
            size = getattr(self, name)
            if size % GEMM_ALIGNMENT:
                raise Fp8Error(
                    f"{name}={size} is not a multiple of {GEMM_ALIGNMENT}, which FP8 GEMMs "
                    "(cuBLASLt) require; keep this layer in high precision (skip=...)"
                )
        self.recipe = recipe
        self.gemm = gemm
        device = self.weight.device if self.weight.device.type != "meta" else None
        self.scalers = nn.ModuleDict(
            {role: Fp8Scaler(recipe, role_dtype(recipe, role), device) for role in ROLES}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            compute_dtype = torch.get_autocast_dtype(device_type)
        else:
            compute_dtype = x.dtype
        if compute_dtype not in HIGH_PRECISION_DTYPES:
            raise Fp8Error(
                f"Float8Linear input dtype {compute_dtype} is not supported; "
                "use float32, bfloat16 or float16"
            )
        with torch.autocast(device_type, enabled=False):
            return _Fp8LinearFn.apply(x, self.weight, self.bias, self, compute_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, gemm={self.gemm}"
