"""FP8 formats, saturating casts and the two scaling recipes (TE's current and delayed).

Every FP8 tensor carries one fp32 per-tensor scale: `x_fp8 = saturate(x * scale)`; the scale
is `fp8_max / amax / 2**margin`, and the previous one is kept when the amax is 0 or not finite
(TE's guard), so a spike can clip values but never produce inf/NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from llmopt.errors import LlmoptError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# cuBLASLt's FP8 GEMMs need every dimension of both operands divisible by 16.
GEMM_ALIGNMENT = 16

Fp8Format = Literal["hybrid", "e4m3"]
AmaxAlgo = Literal["max", "most_recent"]
TensorRole = Literal["input", "weight", "grad_output"]
ROLES: tuple[TensorRole, ...] = ("input", "weight", "grad_output")


class Fp8Error(LlmoptError, ValueError):
    """An FP8 configuration or situation that cannot work as asked."""


class Fp8UnsupportedError(Fp8Error):
    """The device or dtype has no FP8 GEMM and no fallback was allowed."""


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2)."""
    if dtype not in FP8_DTYPES:
        raise Fp8Error(f"{dtype} is not an FP8 format; valid: {', '.join(map(str, FP8_DTYPES))}")
    return float(torch.finfo(dtype).max)


# ---------------------------------------------------------------------------------------------
# Casts and scaling math
# ---------------------------------------------------------------------------------------------


def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor (NaN becomes +inf so MAX-reductions stay well defined)."""
    amax = x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    return torch.nan_to_num(amax, nan=float("inf"), posinf=float("inf"))


def scale_from_amax(
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    previous: torch.Tensor | None = None,
) -> torch.Tensor:
    """TE's scale: fp8_max / amax / 2**margin, or `previous` when amax is 0 or not finite.

    The extra check on the scale itself catches amaxes so small that the quotient overflows
    fp32 (TE would store an inf scale there).
    """
    amax = amax.float()
    if previous is None:
        previous = torch.ones_like(amax)
    scale = (fp8_max(fp8_dtype) / amax) / (2.0**margin)
    ok = torch.isfinite(amax) & (amax > 0) & torch.isfinite(scale)
    return torch.where(ok, scale, previous.float())


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast `clamp(x * scale, -max, max)` to FP8.

    A plain `.to(float8_e4m3fn)` turns out-of-range values into NaN (E4M3FN has no inf);
    saturation is what keeps a stale delayed scale from ever producing NaN.
    """
    limit = fp8_max(fp8_dtype)
    return (x.float() * scale).clamp_(-limit, limit).to(fp8_dtype)


def dequantize(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Back to high precision: data / scale."""
    return (data.float() / scale).to(dtype)


# ---------------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor dynamic scaling: each cast uses the amax of the tensor being cast."""

    margin: int = 0
    fp8_format: Fp8Format = "hybrid"

    def __post_init__(self) -> None:
        _check_common(self.margin, self.fp8_format)

    name = "current"


@dataclass(frozen=True)
class DelayedScaling:
    """TE's delayed scaling: the scale comes from a rolling window of past amaxes."""

    margin: int = 0
    fp8_format: Fp8Format = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = "max"

    def __post_init__(self) -> None:
        _check_common(self.margin, self.fp8_format)
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise Fp8Error(f"amax_history_len={self.amax_history_len!r} must be an integer >= 1")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise Fp8Error(
                f"amax_compute_algo={self.amax_compute_algo!r} is not supported; "
                "choose 'max' or 'most_recent'"
            )

    name = "delayed"


Recipe = CurrentScaling | DelayedScaling
RECIPES = {"current": CurrentScaling, "delayed": DelayedScaling}


def _check_common(margin: int, fp8_format: str) -> None:
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise Fp8Error(f"margin={margin!r} must be a non-negative integer")
    if fp8_format not in ("hybrid", "e4m3"):
        raise Fp8Error(f"fp8_format={fp8_format!r} is not supported; choose 'hybrid' or 'e4m3'")


def make_recipe(recipe: str | Recipe) -> Recipe:
    """A recipe object from 'current' / 'delayed' (defaults) or an existing recipe."""
    if isinstance(recipe, CurrentScaling | DelayedScaling):
        return recipe
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]()
    raise Fp8Error(f"unknown FP8 recipe {recipe!r}; choose one of: {', '.join(RECIPES)}")


def role_dtype(recipe: Recipe, role: TensorRole) -> torch.dtype:
    """E4M3 for forward tensors; E5M2 for gradients under HYBRID."""
    if role == "grad_output" and recipe.fp8_format == "hybrid":
        return E5M2
    return E4M3
