"""GPTQ (Frantar et al. 2023): quantize columns one at a time, pushing each column's rounding
error onto the not-yet-quantized columns through the inverse Hessian of the layer's loss.

For a linear layer with calibration inputs X, the loss ||W X - Q X||^2 has Hessian
H = 2 X X^T. With the upper Cholesky factor U of H^{-1} (after 1% mean-diagonal damping),
quantizing column j with error e_j = (w_j - q_j) / U_jj updates the remaining columns by
-e_j U_j,j+1: — applied lazily, 128 columns at a time, as a rank-128 update. Optional
act-order visits columns by decreasing H_jj; group parameters are then fixed upfront from the
contiguous groups of the original weight ("static groups"), so the packed format and the
kernels stay unchanged. Each group's range is searched (`gptq_range_grid`): min/max shrunk
toward 0 until the H_jj-weighted rounding error is least. With min/max ranges a broad
calibration mix cost GPTQ 12% perplexity in domain; the search won most of it back and
improved out-of-domain text too (docs/benchmarks/quant.md).

Layer by layer (and, with `gptq_true_sequential`, sub-layer by sub-layer in the spec's
`gptq_order`; Llama: qkv, o, gate/up, down), each layer's Hessian is collected from inputs produced by the already-quantized layers.
A linear with no calibration input (a MoE expert no calibration token was routed to) has
nothing to fit: it is rounded to nearest, listed in the report's `rtn_fallback` and warned of.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from llmopt.compress.calibration_walk import (
    BlockMethod,
    BlockStep,
    hessian,
    sequential_stages,
    walk_blocks,
)
from llmopt.compress.calibration_walk import collect_hessians as collect_hessians
from llmopt.compress.quant.rtn import rtn_quantize
from llmopt.compress.quant.targets import block_linears, replace_with_packed
from llmopt.errors import UsageError
from llmopt.models.packed.quant.config import GPTQ_GROUPS, QuantConfig
from llmopt.models.packed.quant.format import (
    PackedWeight,
    compute_qparams,
    effective_group,
    num_groups,
    pack_codes,
)
from llmopt.models.spec import ModelSpec, spec_for


@torch.no_grad()
def gptq_solve(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    groups: str = "static",
    range_grid: int = 0,
    max_shrink: float = 0.35,
) -> tuple[PackedWeight, float]:
    """GPTQ-quantize one weight [out, in] given its input Hessian [in, in].

    With act-order, `groups="static"` fixes every group's parameters from the original weight;
    `"lazy"` fixes them when the group's first column is reached, from the weights as the
    error feedback has updated them by then (still contiguous groups, so the format is the
    same). `range_grid` > 0 searches each group's range, shrunk by up to `max_shrink`, for the
    least H_jj-weighted rounding error instead of taking min/max.
    Returns the packed weight and the summed proxy loss sum((w - q)^2 / U_jj^2) / 2.
    """
    w = weight.detach().float().clone()
    out_f, in_f = w.shape
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    gs = effective_group(in_f, group_size)
    maxq = 2**bits - 1

    if groups not in GPTQ_GROUPS:
        raise UsageError(f"groups={groups!r}; valid choices: {', '.join(GPTQ_GROUPS)}")
    hdiag = torch.diag(h).clone()
    n_groups = num_groups(in_f, group_size)
    scales = torch.zeros(out_f, n_groups)
    zeros = torch.zeros_like(scales)
    # params fixed before any error feedback (one group per row has nothing to wait for)
    static = group_size == -1 or (act_order and groups == "static")
    if static:
        scales, zeros = _search_qparams(w, hdiag, bits, group_size, sym, range_grid, max_shrink)
    ready = torch.full((n_groups,), static)
    perm = torch.argsort(hdiag, descending=True) if act_order else torch.arange(in_f)
    where = torch.argsort(perm)  # original column -> position in the permuted order
    w = w[:, perm]
    h = h[perm][:, perm]

    h += damp * torch.mean(torch.diag(h)) * torch.eye(in_f)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    codes = torch.zeros(out_f, in_f, dtype=torch.uint8)
    loss = 0.0
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // gs
            if not ready[g]:
                # the group's columns as the feedback has left them: none is quantized yet
                pos = where[g * gs : min((g + 1) * gs, in_f)]
                cur = torch.empty(out_f, len(pos))
                inside = pos < i2
                cur[:, inside] = w1[:, pos[inside] - i1]
                later = pos[~inside]
                cur[:, ~inside] = w[:, later] - err1[:, :i] @ u[i1 : i1 + i, later]
                scales[:, g : g + 1], zeros[:, g : g + 1] = _search_qparams(
                    cur, hdiag[g * gs : g * gs + len(pos)], bits, -1, sym, range_grid, max_shrink
                )
                ready[g] = True
            s, z = scales[:, g], zeros[:, g]
            col_w = w1[:, i]
            q = torch.clamp(torch.round(col_w / s) + z, 0, maxq)
            dq = (q - z) * s
            codes[:, col] = q.to(torch.uint8)
            d = u1[i, i]
            e = (col_w - dq) / d
            loss += float((e * e).sum()) / 2
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    packed = PackedWeight(
        qweight=pack_codes(codes, bits),
        scales=scales.half(),
        zeros=zeros.to(torch.uint8),
        bits=bits,
        group_size=group_size,
        in_features=in_f,
    )
    return packed, loss


def _search_qparams(
    w: torch.Tensor,
    hdiag: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    grid: int,
    max_shrink: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group params; with `grid` > 0 the range shrink (1 - k/grid, up to `max_shrink`)
    with the least sum_j H_jj (w_j - q_j)^2 per (row, group), else plain min/max."""
    best_s, best_z = compute_qparams(w, bits, group_size, sym)
    if grid <= 0:
        return best_s, best_z
    gs = effective_group(w.shape[1], group_size)
    cols = torch.arange(w.shape[1]) // gs

    def rep(t: torch.Tensor) -> torch.Tensor:  # per-group values -> per-column
        return t[:, cols]

    def group_error(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        q = torch.clamp(torch.round(w / rep(s)) + rep(z), 0, 2**bits - 1)
        err = (w - (q - rep(z)) * rep(s)) ** 2 * hdiag[None, :]
        return torch.zeros_like(s).index_add_(1, cols, err)

    best_err = group_error(best_s, best_z)
    for k in range(1, int(max_shrink * grid) + 1):
        s, z = compute_qparams(w, bits, group_size, sym, shrink=1 - k / grid)
        err = group_error(s, z)
        better = err < best_err
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
        best_err = torch.minimum(err, best_err)
    return best_s, best_z


class _GPTQ(BlockMethod):
    """GPTQ in the calibration walk: Hessians per stage, quantized weights fed forward."""

    def __init__(self, config: QuantConfig, spec: ModelSpec) -> None:
        self.config, self.spec = config, spec
        self.label = f"GPTQ W{config.bits}"
        self.layer_reports: list[dict[str, Any]] = []
        self.fallback: list[str] = []
        self.linears: dict[str, nn.Linear] = {}
        self.packed: dict[str, PackedWeight] = {}
        self.losses: dict[str, float] = {}

    def stages(self, step: BlockStep) -> list[list[str]]:
        linears = block_linears(step.block, self.spec, self.config)
        self.linears, self.packed, self.losses = linears, {}, {}
        if not self.config.gptq_true_sequential:
            return [list(linears)]
        return sequential_stages(self.spec, list(linears), sort_rest=True)

    observe = staticmethod(hessian)

    def apply(self, step: BlockStep, stage: list[str], stats: dict[str, Any]) -> None:
        config = self.config
        for name in stage:
            lin = self.linears[name]
            if not bool(stats[name].any()):  # no calibration input: nothing to fit
                packed = rtn_quantize(lin.weight, config.bits, config.group_size, config.sym)
                lin.weight.data = packed.dequantize()
                self.packed[name] = packed
                self.fallback.append(f"{step.name}.{name}")
                continue
            packed, loss = gptq_solve(
                lin.weight,
                stats[name],
                config.bits,
                config.group_size,
                config.sym,
                damp=config.gptq_damp,
                block_size=config.gptq_block_size,
                act_order=config.gptq_act_order,
                groups=config.gptq_groups,
                range_grid=config.gptq_range_grid,
                max_shrink=config.gptq_max_shrink,
            )
            # later stages see this layer's quantized output (fp matmul of the
            # dequantised weight: same numbers as QuantLinear, faster for calibration)
            lin.weight.data = packed.dequantize()
            self.packed[name], self.losses[name] = packed, loss

    def finish(self, step: BlockStep) -> None:
        for name, packed in self.packed.items():
            replace_with_packed(step.block, name, packed, self.config)
        losses = {k: _finite(v) for k, v in self.losses.items()}
        self.layer_reports.append({"layer": step.index, "loss": losses})


def gptq_quantize(
    model: nn.Module, config: QuantConfig, calib_tokens: torch.Tensor, progress: bool
) -> dict[str, Any]:
    """Quantize every block in place, feeding quantized outputs forward; returns a report."""
    method = _GPTQ(config, spec_for(model))
    walk_blocks(model, calib_tokens, method, progress)
    return {"layers": method.layer_reports, **rtn_fallback_report(method.fallback, "GPTQ")}


def rtn_fallback_report(names: list[str], method: str) -> dict[str, Any]:
    """The linears that got no calibration input (MoE experts no calibration token was routed
    to) and were rounded to nearest instead: listed in the report and warned about."""
    if names:
        warnings.warn(
            f"{method}: {len(names)} linear(s) saw no calibration tokens (experts no token was "
            f"routed to) and were quantized round-to-nearest: {', '.join(names[:8])}"
            + (" ..." if len(names) > 8 else "")
            + "; more or longer calibration samples reach more experts",
            stacklevel=3,
        )
    return {"rtn_fallback": list(names)}


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None
