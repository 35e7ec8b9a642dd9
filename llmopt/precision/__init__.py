"""llmopt.precision: FP8 mixed-precision training (Transformer-Engine-style FP8 linears)."""

from llmopt.precision.fp8 import (
    CurrentScaling,
    DelayedScaling,
    Float8Linear,
    Fp8Error,
    Fp8UnsupportedError,
    convert_to_fp8,
    fp8_gemm_unsupported_reason,
    fp8_modules,
    fp8_targets,
    make_recipe,
    set_amax_group,
)

__all__ = [
    "CurrentScaling",
    "DelayedScaling",
    "Float8Linear",
    "Fp8Error",
    "Fp8UnsupportedError",
    "convert_to_fp8",
    "fp8_gemm_unsupported_reason",
    "fp8_modules",
    "fp8_targets",
    "make_recipe",
    "set_amax_group",
]
