"""AWQ (Lin et al. 2024): protect salient weights by scaling their input channels.

A weight column that meets large activations matters more: its rounding error is multiplied
by those activations. AWQ multiplies such columns by s > 1 before quantizing (so they get a
finer relative grid) and divides the activations by s, folding 1/s into the op that produces
them (an RMSNorm's weight or the previous linear's rows), so the full-precision model is
unchanged. Per group of linears sharing an input:

    s = mean|x|^α,   α in {0, 1/n, ..., (n-1)/n} chosen to minimise the block output error,

then a per-(row, group) clipping range is searched to minimise each linear's output error.
α = 0 is plain RTN, so the search never does worse than RTN on the calibration data.

Block by block, the inputs of the next block are the full-precision outputs of this one
(as in the reference implementation); scaling is exact, so only quantization differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmopt.compress.quant.apply import block_linears, layer_progress, replace_with_packed
from llmopt.compress.quant.config import QuantConfig
from llmopt.compress.quant.formats import (
    compute_qparams,
    effective_group,
    fake_quantize,
    num_groups,
    pack_weight,
)


@dataclass
class ScalingGroup:
    """Linears that share one input, the op producing that input, and the module scored."""

    prev_name: str
    prev: nn.Module
    names: list[str]
    inspect: Callable[[torch.Tensor], torch.Tensor]


def _capture_inputs(
    block: nn.Module, names: list[str], x: torch.Tensor, cos, sin
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Inputs of each named linear and the block's output, from one forward pass."""
    feats: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:
        module = block.get_submodule(name)

        def hook(_m, args, _out, name=name):
            feats[name] = args[0].detach()

        hooks.append(module.register_forward_hook(hook))
    try:
        out = block(x, cos, sin)
    finally:
        for h in hooks:
            h.remove()
    return feats, out


def scaling_groups(block: nn.Module, selected: set[str], cos, sin) -> list[ScalingGroup]:
    """The Llama block's four places where a per-channel scale can be folded exactly."""
    attn, mlp = block.self_attn, block.mlp
    groups = []

    def keep(names):
        return [n for n in names if n in selected]

    qkv = keep(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
    if qkv:
        groups.append(
            ScalingGroup("input_layernorm", block.input_layernorm, qkv, lambda x: attn(x, cos, sin))
        )
    # v -> o only when shapes match one-to-one (no grouped-query sharing), as in AutoAWQ
    if "self_attn.o_proj" in selected and attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        groups.append(
            ScalingGroup("self_attn.v_proj", attn.v_proj, ["self_attn.o_proj"], attn.o_proj)
        )
    gate_up = keep(["mlp.gate_proj", "mlp.up_proj"])
    if gate_up:
        groups.append(
            ScalingGroup("post_attention_layernorm", block.post_attention_layernorm, gate_up, mlp)
        )
    # up -> down is exact only when up's output enters down linearly (SwiGLU's product)
    if "mlp.down_proj" in selected and mlp.kind == "swiglu":
        groups.append(ScalingGroup("mlp.up_proj", mlp.up_proj, ["mlp.down_proj"], mlp.down_proj))
    return groups


def _search_scale(
    group: ScalingGroup,
    block: nn.Module,
    inp: torch.Tensor,
    n_search: int,
    config: QuantConfig,
) -> tuple[torch.Tensor, float, list[float]]:
    """Grid-search α; returns (scales, α, loss per grid point)."""
    x_mean = inp.abs().reshape(-1, inp.shape[-1]).float().mean(0)
    sample = inp[:n_search]
    fp_out = group.inspect(sample)
    linears = [block.get_submodule(n) for n in group.names]
    originals = [lin.weight.data.clone() for lin in linears]
    losses = []
    best = (math.inf, None, 0.0)
    try:
        for k in range(config.awq_grid):
            alpha = k / config.awq_grid
            s = x_mean.pow(alpha).clamp(min=1e-4)
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


def _apply_scale(group: ScalingGroup, block: nn.Module, s: torch.Tensor) -> None:
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

    Returns (max_abs [out, groups], output MSE unclipped, output MSE clipped).
    """
    out_f, in_f = w.shape
    gs = effective_group(in_f, config.group_size)
    g = num_groups(in_f, config.group_size)
    pad = g * gs - in_f
    xp = nn.functional.pad(x.float(), (0, pad)).reshape(-1, g, gs).transpose(0, 1)  # [G, N, gs]

    def grouped_out(weight: torch.Tensor) -> torch.Tensor:
        wp = nn.functional.pad(weight, (0, pad)).reshape(out_f, g, gs).permute(1, 2, 0)
        return torch.bmm(xp, wp)  # [G, N, out]: each group's partial output

    org_out = grouped_out(w)
    org_max = nn.functional.pad(w.abs(), (0, pad)).reshape(out_f, g, gs).amax(-1)
    best_err = torch.full((out_f, g), math.inf)
    best_max = org_max.clone()
    first_err = None
    steps = int(config.awq_max_shrink * config.awq_clip_grid)
    for i in range(steps + 1):
        max_val = org_max * (1 - i / config.awq_clip_grid)
        q = fake_quantize(w, config.bits, config.group_size, config.sym, max_abs=max_val)
        err = (grouped_out(q) - org_out).pow(2).mean(1).t()  # [out, G]
        if first_err is None:
            first_err = err
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max, first_err.sum(1).mean().item(), best_err.sum(1).mean().item()


def awq_quantize(
    model: nn.Module, config: QuantConfig, calib_tokens: torch.Tensor, progress: bool
) -> dict[str, Any]:
    """Scale, clip and quantize every block in place; returns the per-layer report."""
    n, t = calib_tokens.shape
    x = model.embed_tokens(calib_tokens).float()
    cos, sin = model.rotary(0, t, x.dtype)
    n_search = min(config.awq_search_samples, n)
    gen = torch.Generator().manual_seed(config.calib_seed)
    layers_report = []
    scales: dict[str, torch.Tensor] = {}
    with layer_progress(len(model.layers), f"AWQ W{config.bits}", progress) as advance:
        for i, block in enumerate(model.layers):
            linears = block_linears(block, config)
            feats, out = _capture_inputs(block, list(linears), x, cos, sin)
            layer_report: dict[str, Any] = {"layer": i, "groups": [], "clip": {}}
            for group in scaling_groups(block, set(linears), cos, sin):
                inp = feats[group.names[0]]
                s, alpha, losses = _search_scale(group, block, inp, n_search, config)
                _apply_scale(group, block, s)
                scaled = inp / s  # the linears now see x / s
                for name in group.names:
                    feats[name] = scaled
                scales[f"layers.{i}.{group.prev_name}"] = s
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
            for name, lin in linears.items():
                w = lin.weight.data
                max_abs = None
                # q/k feed a softmax through RoPE: clipping them hurts (as in AutoAWQ)
                if config.awq_clip and not name.endswith(("q_proj", "k_proj")):
                    tokens = feats[name].reshape(-1, w.shape[1])
                    if tokens.shape[0] > config.awq_clip_tokens:
                        pick = torch.randperm(tokens.shape[0], generator=gen)
                        tokens = tokens[pick[: config.awq_clip_tokens]]
                    max_abs, before, after = search_clip(w, tokens, config)
                    layer_report["clip"][name] = {"mse_noclip": before, "mse_clip": after}
                scale, zero = compute_qparams(
                    w, config.bits, config.group_size, config.sym, max_abs=max_abs
                )
                packed = pack_weight(
                    w, config.bits, config.group_size, config.sym, scale=scale, zero=zero
                )
                replace_with_packed(block, name, packed, config)
            layers_report.append(layer_report)
            x = out
            advance()
    return {"layers": layers_report, "scales": scales}
