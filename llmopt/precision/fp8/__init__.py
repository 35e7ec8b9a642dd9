"""FP8 mixed-precision training: Transformer-Engine-style FP8 linear layers.

What runs in FP8 and what does not (TE's split): the three GEMMs of each block linear layer
(forward `y = x W^T`, input gradient `dx = dy W`, weight gradient `dW = dy^T x`) take FP8
operands; everything else (norms, RoPE, the softmax/attention core, residual adds,
embeddings, the LM head, the loss, the optimizer and the fp32 master weights) stays in
high precision. Formats follow TE's HYBRID recipe: E4M3 (more mantissa) for activations and
weights in the forward pass, E5M2 (more range) for gradients in the backward pass.

Every FP8 tensor carries one fp32 per-tensor scale: `x_fp8 = saturate(x * scale)`, and the
GEMM multiplies by `1 / scale` of each operand (`torch._scaled_mm`'s `scale_a/scale_b`). Two
recipes choose the scale:

- current (dynamic) scaling: `scale = fp8_max / amax(x) / 2**margin` from the tensor now;
- delayed scaling (TE's `DelayedScaling`): the scale comes from a history of past amaxes
  (`max` over the window or the `most_recent` entry), so the cast needs no extra pass over
  the tensor; the history rolls exactly like TE's `amax_and_scale_update` kernel.

Both keep the previous scale when the amax is 0 or not finite (TE's guard) and saturate on
the cast, so a spike can clip values but never produce inf/NaN. With tensor or data
parallelism each amax is all-reduced (MAX) over a process group before it is used, so every
rank quantises with the same scale.

Layout: `cast` (formats, casts, recipes), `scaler` (per-tensor scaling state and the
amax reduction), `linear` (the layer and device support); this module converts models
(which layers: the architecture's `ModelSpec`) and re-exports the whole FP8 API.
"""

from __future__ import annotations

import fnmatch
from typing import Literal

from torch import nn

from llmopt.models.spec import spec_for
from llmopt.precision.fp8.cast import (  # noqa: F401 - the FP8 API in one place
    E4M3,
    E5M2,
    FP8_DTYPES,
    GEMM_ALIGNMENT,
    HIGH_PRECISION_DTYPES,
    CurrentScaling,
    DelayedScaling,
    Fp8Error,
    Fp8UnsupportedError,
    Recipe,
    compute_amax,
    dequantize,
    fp8_max,
    make_recipe,
    quantize,
    role_dtype,
    scale_from_amax,
)
from llmopt.precision.fp8.linear import (  # noqa: F401
    Float8Linear,
    GemmKind,
    fp8_gemm_unsupported_reason,
)
from llmopt.precision.fp8.scaler import (  # noqa: F401
    AmaxGroup,
    Fp8Scaler,
    reduce_amax,
    resolve_group,
)

# ---------------------------------------------------------------------------------------------
# Model conversion
# ---------------------------------------------------------------------------------------------


def fp8_targets(model: nn.Module) -> list[str]:
    """Qualified names of the layers FP8 converts: the architecture's block linears.

    The GEMM-heavy linears only: the LM head (its softmax/loss is precision-sensitive),
    embeddings, norms and the attention core stay in high precision. Works on a pipeline
    stage (only the blocks it holds).
    """
    spec = spec_for(model)
    return [
        f"{block_name}.{name}"
        for block_name, block in spec.named_blocks(model)
        for name, module in spec.named_block_modules(block, spec.block_linears)
        if type(module) is nn.Linear
    ]


def convert_to_fp8(
    model: nn.Module,
    recipe: str | Recipe = "current",
    *,
    skip: tuple[str, ...] | list[str] = (),
    amax_group: AmaxGroup = "auto",
    fallback: Literal["error", "emulate"] = "error",
    on_bad_shape: Literal["error", "keep"] = "error",
) -> nn.Module:
    """Swap the model's block linears (`fp8_targets`) for `Float8Linear` in place; returns it.

    skip: fnmatch patterns of qualified module names to keep in high precision.
    amax_group: process group over which amaxes are MAX-reduced so all ranks use one scale;
        "auto" = the world group when torch.distributed is initialised. With pipeline
        parallelism pass the group of ranks holding the same stage (stages have different
        layers, so a world-wide reduction would pair unrelated tensors).
    fallback: what to do on a device without FP8 GEMMs: "error", or "emulate" (exact FP8
        quantisation, GEMM in fp32 after dequantising; for correctness work, not speed).
    on_bad_shape: a layer whose dims are not multiples of 16: "error" or "keep" it as is.
    """
    recipe = make_recipe(recipe)
    resolve_group(amax_group)  # validates early; "auto" is resolved again at each use
    if fallback not in ("error", "emulate"):
        raise Fp8Error(f"fallback={fallback!r} is not supported; choose 'error' or 'emulate'")
    if on_bad_shape not in ("error", "keep"):
        raise Fp8Error(f"on_bad_shape={on_bad_shape!r} is not supported; choose 'error' or 'keep'")
    candidates = fp8_targets(model)
    targets = [
        (name, model.get_submodule(name))
        for name in candidates
        if not any(fnmatch.fnmatch(name, p) for p in skip)
    ]
    if not targets:
        shown = ", ".join(candidates[:3]) + (", ..." if len(candidates) > 3 else "")
        raise Fp8Error(
            f"convert_to_fp8 found no block linear layers to convert (skip={list(skip)}; "
            f"candidates: {shown or 'none'})"
        )
    device = targets[0][1].weight.device
    reason = fp8_gemm_unsupported_reason(device)
    if reason is not None and fallback == "error":
        raise Fp8UnsupportedError(
            f"FP8 GEMM unavailable: {reason}; pass fallback='emulate' to keep FP8 numerics "
            "with the GEMM done in fp32"
        )
    gemm: GemmKind = "scaled_mm" if reason is None else "emulated"
    for name, module in targets:
        bad = [
            f"{dim}={getattr(module, dim)}"
            for dim in ("in_features", "out_features")
            if getattr(module, dim) % GEMM_ALIGNMENT
        ]
        if bad:
            if on_bad_shape == "keep":
                continue
            raise Fp8Error(
                f"{name}: {', '.join(bad)} not a multiple of {GEMM_ALIGNMENT} (FP8 GEMM "
                "requirement); pass skip=['" + name + "'] or on_bad_shape='keep'"
            )
        if module.weight.dtype not in HIGH_PRECISION_DTYPES:
            raise Fp8Error(
                f"{name}: weight dtype {module.weight.dtype} cannot be an FP8 master weight; "
                "use float32, bfloat16 or float16"
            )
        parent_name, _, child = name.rpartition(".")
        new = Float8Linear.from_linear(module, recipe, gemm)
        setattr(model.get_submodule(parent_name), child, new)
    set_amax_group(model, amax_group)
    return model


def set_amax_group(model: nn.Module, group: AmaxGroup) -> None:
    """Point every FP8 scaler of `model` at `group` (e.g. once the trainer built its grid)."""
    for module in model.modules():
        if isinstance(module, Fp8Scaler):
            module.group = group


def fp8_modules(model: nn.Module) -> dict[str, Float8Linear]:
    """The converted layers by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}
