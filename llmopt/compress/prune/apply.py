"""`prune_model`: take a model, return a pruned copy (the input model is never touched).

Magnitude pruning needs no data. Wanda and SparseGPT calibrate block by block, as GPTQ does
(and with GPTQ's public pieces): the calibration batch is embedded once, each block's linears
are pruned in the spec's `gptq_order` stages — every stage's input statistics collected from a
block whose earlier stages are already pruned — and the pruned block's outputs feed the next
block, so each layer adapts to the errors of the layers before it.

The copy carries `prune_config`, `prune_masks` (full module name -> bool keep-mask, so a kept
weight that happens to be 0.0 is still told apart from a pruned one) and `prune_report`.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from llmopt.compress.prune.masks import (
    check_nm_shape,
    magnitude_score,
    select_mask,
    wanda_score,
)
from llmopt.compress.prune.sparsegpt import sparsegpt_solve
from llmopt.compress.quant.calibration import check_calibration_tokens
from llmopt.compress.quant.gptq import collect_hessians
from llmopt.compress.quant.progress import layer_progress
from llmopt.models.packed.sparse.config import PruneConfig, PruneConfigError, Sparsity
from llmopt.models.spec import ModelSpec, spec_for


def prunable_linears(spec: ModelSpec, block: nn.Module) -> dict[str, nn.Linear]:
    """The block's linears the spec names (`block_linears`), by dotted name; absent ones skipped."""
    found = {}
    for name in spec.block_linears:
        module = spec.block_module(block, name)
        if isinstance(module, nn.Linear):
            found[name] = module
    return found


def prune_stages(spec: ModelSpec, linears: dict[str, nn.Linear]) -> list[list[str]]:
    """`gptq_order` restricted to the block's linears, plus any linear it does not mention."""
    stages = [[n for n in stage if n in linears] for stage in spec.gptq_order]
    stages = [s for s in stages if s]
    rest = [n for n in linears if all(n not in s for s in stages)]
    return stages + ([rest] if rest else [])


def _check_shapes(model: nn.Module, spec: ModelSpec, sparsity: Sparsity) -> None:
    if not sparsity.structured:
        return
    for block in spec.blocks_of(model):
        for lin in prunable_linears(spec, block).values():
            check_nm_shape(lin.in_features, sparsity.m)


def _check_calib(calib_tokens: torch.Tensor | None, config: PruneConfig) -> None:
    if config.needs_calibration:
        check_calibration_tokens(calib_tokens, config.method, PruneConfigError)


def _prune_linear(
    lin: nn.Linear, config: PruneConfig, hessian: torch.Tensor | None
) -> tuple[torch.Tensor, float]:
    """Prune one linear in place; returns (keep-mask, OBS loss or 0)."""
    weight = lin.weight.data
    if config.method == "sparsegpt":
        pruned, keep, loss = sparsegpt_solve(
            weight, hessian, config.sparsity, damp=config.damp, block_size=config.block_size
        )
        lin.weight.data = pruned
        return keep, loss
    if config.method == "wanda":
        score = wanda_score(weight, torch.diag(hessian))
        keep = select_mask(score, config.sparsity, per_row=True)
    else:
        keep = select_mask(magnitude_score(weight), config.sparsity, per_row=False)
    lin.weight.data = weight * keep.to(weight.dtype)
    return keep, 0.0


def prune_model(
    model: nn.Module,
    method: str = "sparsegpt",
    sparsity: str | float | Sparsity = 0.5,
    *,
    config: PruneConfig | None = None,
    calib_tokens: torch.Tensor | None = None,
    progress: bool = False,
    **options: Any,
) -> nn.Module:
    """A pruned copy of `model` (magnitude, Wanda or SparseGPT; unstructured or N:M).

    Wanda and SparseGPT need `calib_tokens` [n, T]. Extra keyword `options` are `PruneConfig`
    fields (e.g. `damp=0.01`, `block_size=128`).
    """
    if config is None:
        config = PruneConfig(method=method, sparsity=sparsity, **options)
    _check_calib(calib_tokens, config)
    if getattr(model, "quant_config", None) is not None:
        raise PruneConfigError("model is quantized; prune the full-precision model")
    if getattr(model, "prune_config", None) is not None:
        raise PruneConfigError("model is already pruned; prune the dense model")
    spec = spec_for(model)
    _check_shapes(model, spec, config.sparsity)
    start = time.perf_counter()
    pruned = copy.deepcopy(model).eval()
    dtype = next(pruned.parameters()).dtype
    pruned.float()
    blocks = spec.blocks_of(pruned)
    masks: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any]] = []
    x = cos = sin = None
    if config.needs_calibration:
        device = next(pruned.parameters()).device
        x = spec.top_module(pruned, "embedding")(calib_tokens.to(device)).float()
        cos, sin = pruned.rotary(0, calib_tokens.shape[1], x.dtype)
    label = f"{config.method} {config.sparsity}"
    with torch.no_grad(), layer_progress(len(blocks), label, progress) as advance:
        for i, block in enumerate(blocks):
            linears = prunable_linears(spec, block)
            losses: dict[str, float] = {}
            for stage in prune_stages(spec, linears):
                hessians = collect_hessians(block, stage, x, cos, sin) if x is not None else {}
                for name in stage:
                    keep, losses[name] = _prune_linear(linears[name], config, hessians.get(name))
                    masks[f"{spec.blocks}.{i}.{name}"] = keep.cpu()
            if x is not None:
                x = block(x, cos, sin)
            layers.append({"layer": i, "loss": losses})
            advance()
    pruned.to(dtype)
    if getattr(pruned.config, "tie_embeddings", False):
        head = spec.top_module(pruned, "head")
        head.weight = spec.top_module(pruned, "embedding").weight
    kept = sum(int(m.sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    pruned.prune_config = config
    pruned.prune_masks = masks
    pruned.prune_report = {
        "seconds": time.perf_counter() - start,
        "pruned_fraction": 1.0 - kept / max(total, 1),
        "pruned_weights": total - kept,
        "prunable_weights": total,
        "layers": layers,
    }
    return pruned
