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
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# cuBLASLt's FP8 GEMMs need every dimension of both operands divisible by 16.
GEMM_ALIGNMENT = 16

Fp8Format = Literal["hybrid", "e4m3"]
AmaxAlgo = Literal["max", "most_recent"]
GemmKind = Literal["scaled_mm", "emulated"]
TensorRole = Literal["input", "weight", "grad_output"]
ROLES: tuple[TensorRole, ...] = ("input", "weight", "grad_output")


class Fp8Error(ValueError):
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


# ---------------------------------------------------------------------------------------------
# Per-tensor scaling state
# ---------------------------------------------------------------------------------------------

# A torch ProcessGroup, the engine's counted `llmopt.parallel.comm.Group` (anything with
# `all_reduce(tensor, op="max")`), None (no reduction) or "auto" (the world when initialised).
AmaxGroup = Any


def _resolve_group(group: AmaxGroup) -> Any:
    if isinstance(group, str):
        if group != "auto":
            raise Fp8Error(f"amax_group={group!r}: pass a process group, None or 'auto'")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None
    return group


def reduce_amax(amax: torch.Tensor, group: AmaxGroup) -> torch.Tensor:
    """All-reduce MAX over `group` (in place) so all ranks derive the same scale."""
    group = _resolve_group(group)
    if group is None:
        return amax
    if hasattr(group, "all_reduce"):  # counted engine group; a no-op when its size is 1
        group.all_reduce(amax, op="max")
    elif dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


class Fp8Scaler(nn.Module):
    """Scale and amax history of one tensor role (input, weight or grad_output) of one layer.

    Buffers are non-persistent: a checkpoint of an FP8 model is the plain model's state dict
    (the master weights), loadable without FP8. A resumed delayed-scaling run therefore
    rebuilds its history, starting from scale 1 like a fresh TE run.
    """

    def __init__(self, recipe: Recipe, fp8_dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.recipe = recipe
        self.fp8_dtype = fp8_dtype
        self.group: AmaxGroup = None
        length = recipe.amax_history_len if isinstance(recipe, DelayedScaling) else 1
        self.register_buffer("amax_history", torch.zeros(length, device=device), persistent=False)
        self.register_buffer("scale", torch.ones((), device=device), persistent=False)

    def _apply(self, fn, recurse=True):
        """Follow device moves but never dtype casts: scales and amaxes stay fp32.

        `model.to(torch.bfloat16)` would otherwise round them (and `_scaled_mm` wants fp32).
        """
        for name, buf in self._buffers.items():
            if buf is not None:
                moved = fn(buf)
                self._buffers[name] = buf.to(device=moved.device, dtype=torch.float32)
        return self

    @torch.no_grad()
    def update_scale(self) -> torch.Tensor:
        """Delayed scaling's step: scale from the history, then roll it (TE's kernel order).

        Roll: entry i takes entry i+1, the last takes the old entry 0 (the latest amax), and
        entry 0 is zeroed for the amax about to be recorded.
        """
        history = self.amax_history
        if self.recipe.amax_compute_algo == "max":
            amax = history.amax()
        else:
            amax = history[0].clone()
        self.scale.copy_(
            scale_from_amax(amax, self.fp8_dtype, self.recipe.margin, previous=self.scale)
        )
        self.amax_history.copy_(torch.roll(history, -1, 0))
        self.amax_history[0] = 0.0
        return self.scale

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 data, inverse scale) of x under this role's recipe."""
        if isinstance(self.recipe, DelayedScaling):
            self.update_scale()
            data = quantize(x, self.scale, self.fp8_dtype)
            self.amax_history[0] = reduce_amax(compute_amax(x), self.group)
        else:
            amax = reduce_amax(compute_amax(x), self.group)
            self.amax_history[0] = amax
            self.scale.copy_(
                scale_from_amax(amax, self.fp8_dtype, self.recipe.margin, previous=self.scale)
            )
            data = quantize(x, self.scale, self.fp8_dtype)
        return data, self.scale.reciprocal()

    def extra_repr(self) -> str:
        return f"{self.fp8_dtype}, history={self.amax_history.numel()}"


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


# ---------------------------------------------------------------------------------------------
# Model conversion
# ---------------------------------------------------------------------------------------------

# The GEMM-heavy linears of a block; the LM head (its softmax/loss is precision-sensitive),
# embeddings, norms and the attention core are never converted.
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_block_linear(name: str, module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and name.startswith("layers.")
        and name.rsplit(".", 1)[-1] in BLOCK_LINEARS
    )


def convert_to_fp8(
    model: nn.Module,
    recipe: str | Recipe = "current",
    *,
    skip: tuple[str, ...] | list[str] = (),
    amax_group: AmaxGroup = "auto",
    fallback: Literal["error", "emulate"] = "error",
    on_bad_shape: Literal["error", "keep"] = "error",
) -> nn.Module:
    """Swap a Llama model's block linears for `Float8Linear` in place and return the model.

    skip: fnmatch patterns of module names to keep in high precision (e.g. "layers.0.*").
    amax_group: process group over which amaxes are MAX-reduced so all ranks use one scale;
        "auto" = the world group when torch.distributed is initialised. With pipeline
        parallelism pass the group of ranks holding the same stage (stages have different
        layers, so a world-wide reduction would pair unrelated tensors).
    fallback: what to do on a device without FP8 GEMMs: "error", or "emulate" (exact FP8
        quantisation, GEMM in fp32 after dequantising; for correctness work, not speed).
    on_bad_shape: a layer whose dims are not multiples of 16: "error" or "keep" it as is.
    """
    recipe = make_recipe(recipe)
    _resolve_group(amax_group)  # validates early; "auto" is resolved again at each use
    if fallback not in ("error", "emulate"):
        raise Fp8Error(f"fallback={fallback!r} is not supported; choose 'error' or 'emulate'")
    if on_bad_shape not in ("error", "keep"):
        raise Fp8Error(f"on_bad_shape={on_bad_shape!r} is not supported; choose 'error' or 'keep'")
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if _is_block_linear(name, module) and not any(fnmatch.fnmatch(name, p) for p in skip)
    ]
    if not targets:
        raise Fp8Error(
            "convert_to_fp8 found no block linear layers (layers.*.{q,k,v,o,gate,up,down}_proj)"
            f" to convert (skip={list(skip)})"
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
