"""AWQ (Lin et al. 2024): protect salient weights by scaling their input channels.

A weight column that meets large activations matters more: its rounding error is multiplied
by those activations. AWQ multiplies such columns by s > 1 before quantizing (so they get a
finer relative grid) and divides the activations by s, folding 1/s into the op that produces
them (an RMSNorm's weight or the previous linear's rows), so the full-precision model is
unchanged. Per group of linears sharing an input:

    s = mean|x|^α,   α in {0, 1/n, ..., (n-1)/n} chosen to minimise the block output error,

or, with duo scaling (AutoAWQ's default), s = mean|x|^α / mean|w|^(1-α) with |w| relative to
its group's max, plus s = 1 as a candidate;

then a per-(row, group) clipping range is searched to minimise each linear's output error.
s = 1 (plain RTN) is always a candidate, so the search never does worse than RTN on its sample.

Block by block, the inputs of the next block are the full-precision outputs of this one
(as in the reference implementation); scaling is exact, so only quantization differs. A linear
no calibration token reached (a MoE expert nothing was routed to) gets neither scale nor clip:
it is rounded to nearest and listed in the report's `rtn_fallback`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmopt.compress.calibration_walk import BlockMethod, BlockStep, walk_blocks
from llmopt.compress.quant.gptq import rtn_fallback_report
from llmopt.compress.quant.targets import block_linears, replace_with_packed
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.quant.format import (
    compute_qparams,
    effective_group,
    fake_quantize,
    num_groups,
    pack_weight,
)
from llmopt.models.spec import ModelSpec, spec_for


@dataclass
class BoundGroup:
    """One block's instance of a spec `ScalingGroup`: the producer module, the linears
    sharing its output, and the function whose output error is scored."""

    prev_name: str
    prev: nn.Module
    names: list[str]
    inspect: Callable[[torch.Tensor], torch.Tensor]


def scaling_groups(
    block: nn.Module, spec: ModelSpec, selected: set[str], cos, sin
) -> list[BoundGroup]:
    """The spec's AWQ fold points that are exact in this block, restricted to `selected`.

    A linear producer folds exactly only into consumers reading its outputs one-to-one (so
    v -> o is skipped under grouped-query attention, as in AutoAWQ).
    """
    groups = []
    for group in spec.awq_groups:
        names = [n for n in group.linears if n in selected]
        prev = spec.block_module(block, group.prev)
        if not names or prev is None:
            continue
        if any(spec.block_module(block, n) is None for n in group.needs):
            continue
        linears = [spec.block_module(block, n) for n in names]
        if isinstance(prev, nn.Linear) and any(
            lin.in_features != prev.out_features for lin in linears
        ):
            continue
        groups.append(BoundGroup(group.prev, prev, names, _inspect(spec, block, group, cos, sin)))
    return groups


def _inspect(spec: ModelSpec, block: nn.Module, group, cos, sin) -> Callable:
    """The module output the scale search scores: attention (with RoPE), another module, or
    the group's own linears concatenated."""
    if not group.inspect:
        linears = [spec.block_module(block, n) for n in group.linears]
        if len(linears) == 1:
            return linears[0]
        return lambda x: torch.cat([lin(x) for lin in linears], dim=-1)
    module = spec.block_module(block, group.inspect)
    if group.inspect == spec.attention:
        return lambda x: module(x, cos, sin)
    return module


def _search_scale(
    group: BoundGroup,
    block: nn.Module,
    inp: torch.Tensor,
    n_search: int,
    config: QuantConfig,
) -> tuple[torch.Tensor, float, list[float]]:
    """Grid-search α; returns (scales, α, loss per grid point). The first point is always
    s = 1 (RTN), so the search never does worse than RTN on its sample."""
    x_mean = inp.abs().reshape(-1, inp.shape[-1]).float().mean(0)
    sample = inp[:n_search]
    fp_out = group.inspect(sample)
    linears = [block.get_submodule(n) for n in group.names]
    originals = [lin.weight.data.clone() for lin in linears]
    w_mean = _weight_mean(originals, config.group_size) if config.awq_duo_scaling else None
    losses = []
    best = (math.inf, None, 0.0)
    try:
        for k in range(config.awq_grid + (w_mean is not None)):
            if w_mean is None:
                alpha = k / config.awq_grid
                s = x_mean.pow(alpha).clamp(min=1e-4)
            elif k == 0:
                alpha, s = 0.0, torch.ones_like(x_mean)
            else:
                alpha = (k - 1) / config.awq_grid
                s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for lin, w in zip(linears, originals):
                lin.weight.data = (
                    fake_quantize(w * s, config.bits, config.group_size, config.sym) / s
                )
            loss = (group.inspect(sample) - fp_out).float().pow(2).mean().item()
            losses.append(loss)
            if loss < best[0]:
                best = (loss, s.clone(), alpha)
    finally:
        for lin, w in zip(linears, originals):
            lin.weight.data = w
    return best[1], best[2], losses


def _weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Per input channel, the mean over output rows of |w| relative to its quantization
    group's max: how large the channel already is on the grid (AutoAWQ's duo scaling)."""
    w = torch.cat(weights).abs().float()
    out_f, in_f = w.shape
    gs = effective_group(in_f, group_size)
    g = num_groups(in_f, group_size)
    wp = nn.functional.pad(w, (0, g * gs - in_f)).reshape(out_f, g, gs)
    wp = wp / wp.amax(-1, keepdim=True).clamp(min=1e-8)
    return wp.reshape(out_f, g * gs)[:, :in_f].mean(0)


def _apply_scale(group: BoundGroup, block: nn.Module, s: torch.Tensor) -> None:
    """Fold 1/s into the producer of the input and s into the consumers' columns (exact)."""
    prev = group.prev
    if isinstance(prev, nn.Linear):
        prev.weight.data = prev.weight.data / s[:, None]
        if prev.bias is not None:
            prev.bias.data = prev.bias.data / s
    else:  # RMSNorm
        prev.weight.data = prev.weight.data / s
    for name in group.names:
        lin = block.get_submodule(name)
        lin.weight.data = lin.weight.data * s


def search_clip(
    w: torch.Tensor, x: torch.Tensor, config: QuantConfig
) -> tuple[torch.Tensor, float, float]:
    """Per-(row, group) clipping range minimising the linear's output MSE on `x` [N, in].

    A group's share of the output error over the tokens is d^T H d, with d the row's
    weight error in the group and H = X_g^T X_g / N the group's input Gram matrix, so the
    search costs out·gs² per group and step whatever N is: it scores every calibration token
    for less than direct partial outputs on 512 of them (issue 19: a 512-token sample made
    AWQ's quality swing 9% between calibration draws). Returns (max_abs [out, groups],
    output MSE unclipped, output MSE clipped).
    """
    out_f, in_f = w.shape
    gs = effective_group(in_f, config.group_size)
    g = num_groups(in_f, config.group_size)
    pad = g * gs - in_f
    xg = nn.functional.pad(x.float(), (0, pad)).reshape(-1, g, gs).transpose(0, 1)  # [G, N, gs]
    gram = torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]  # [G, gs, gs]

    def group_errors(q: torch.Tensor) -> torch.Tensor:
        d = nn.functional.pad(q - w, (0, pad)).reshape(out_f, g, gs).transpose(0, 1)
        return (torch.bmm(d, gram) * d).sum(-1).t()  # [out, G]

    org_max = nn.functional.pad(w.abs(), (0, pad)).reshape(out_f, g, gs).amax(-1)
    best_err = torch.full((out_f, g), math.inf)
    best_max = org_max.clone()
    first_err = None
    steps = int(config.awq_max_shrink * config.awq_clip_grid)
    for i in range(steps + 1):
        max_val = org_max * (1 - i / config.awq_clip_grid)
        q = fake_quantize(w, config.bits, config.group_size, config.sym, max_abs=max_val)
        err = group_errors(q)
        if first_err is None:
            first_err = err
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max, first_err.sum(1).mean().item(), best_err.sum(1).mean().item()


class _AWQ(BlockMethod):
    """AWQ in the calibration walk: every selected linear's inputs from one full forward,
    whose (full-precision) outputs feed the next block."""

    feed_original = True

    def __init__(self, config: QuantConfig, spec: ModelSpec, n_search: int) -> None:
        self.config, self.spec, self.n_search = config, spec, n_search
        self.label = f"AWQ W{config.bits}"
        self.gen = torch.Generator().manual_seed(config.calib_seed)
        self.layer_reports: list[dict[str, Any]] = []
        self.scales: dict[str, torch.Tensor] = {}
        self.fallback: list[str] = []
        self.linears: dict[str, nn.Linear] = {}

    def stages(self, step: BlockStep) -> list[list[str]]:
        self.linears = block_linears(step.block, self.spec, self.config)
        return [list(self.linears)]

    def apply(self, step: BlockStep, stage: list[str], stats: dict[str, Any]) -> None:
        block, spec, config = step.block, self.spec, self.config
        feats = dict(stats)
        layer_report: dict[str, Any] = {"layer": step.index, "groups": [], "clip": {}}
        for group in scaling_groups(block, spec, set(self.linears), step.cos, step.sin):
            inp = feats[group.names[0]]
            if inp.numel() == 0:  # no calibration input (an unrouted expert): no scale
                continue
            s, alpha, losses = _search_scale(group, block, inp, self.n_search, config)
            _apply_scale(group, block, s)
            scaled = inp / s  # the linears now see x / s
            for name in group.names:
                feats[name] = scaled
            self.scales[f"{step.name}.{group.prev_name}"] = s
            top = torch.topk(s, k=min(4, s.numel()))
            layer_report["groups"].append(
                {
                    "prev": group.prev_name,
                    "linears": group.names,
                    "alpha": alpha,
                    "loss_rtn": losses[0],
                    "loss_awq": min(losses),
                    "scale_max": s.max().item(),
                    "scale_min": s.min().item(),
                    "top_channels": top.indices.tolist(),
                }
            )
        for name, lin in self.linears.items():
            w = lin.weight.data
            max_abs = None
            tokens = feats[name].reshape(-1, w.shape[1])
            if tokens.shape[0] == 0:  # an expert no calibration token was routed to
                self.fallback.append(f"{step.name}.{name}")
            elif config.awq_clip and name not in spec.awq_no_clip:
                limit = config.awq_clip_tokens
                if limit is not None and tokens.shape[0] > limit:
                    pick = torch.randperm(tokens.shape[0], generator=self.gen)
                    tokens = tokens[pick[:limit]]
                max_abs, before, after = search_clip(w, tokens, config)
                layer_report["clip"][name] = {"mse_noclip": before, "mse_clip": after}
            scale, zero = compute_qparams(
                w, config.bits, config.group_size, config.sym, max_abs=max_abs
            )
            packed = pack_weight(
                w, config.bits, config.group_size, config.sym, scale=scale, zero=zero
            )
            replace_with_packed(block, name, packed, config)
        self.layer_reports.append(layer_report)


def awq_quantize(
    model: nn.Module, config: QuantConfig, calib_tokens: torch.Tensor, progress: bool
) -> dict[str, Any]:
    """Scale, clip and quantize every block in place; returns the per-layer report."""
    n_search = min(config.awq_search_samples, calib_tokens.shape[0])
    method = _AWQ(config, spec_for(model), n_search)
    walk_blocks(model, calib_tokens, method, progress)
    report = rtn_fallback_report(method.fallback, "AWQ")
    return {"layers": method.layer_reports, "scales": method.scales, **report}
