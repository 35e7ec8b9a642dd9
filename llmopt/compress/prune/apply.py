"""`prune_model`: take a model, return a pruned copy (the input model is never touched).

Magnitude pruning needs no data. Wanda and SparseGPT calibrate block by block, as GPTQ does
(and with GPTQ's public pieces): the calibration batch is embedded once, each block's linears
are pruned in the spec's `gptq_order` stages — every stage's input statistics collected from a
block whose earlier stages are already pruned — and the pruned block's outputs feed the next
block, so each layer adapts to the errors of the layers before it.

The copy's `compression_metadata` (`llmopt.models.packed.metadata`) carries `prune_config`,
`prune_masks` (full module name -> bool keep-mask, so a kept weight that happens to be 0.0 is
still told apart from a pruned one) and `prune_report`.
"""

from __future__ import annotations

import copy
import time
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
from llmopt.compress.prune.masks import (
    check_nm_shape,
    magnitude_score,
    select_mask,
    wanda_score,
)
from llmopt.compress.prune.sparsegpt import sparsegpt_solve
from llmopt.compress.quant.calibration import check_calibration_tokens
from llmopt.models.packed.metadata import compression_metadata, set_compression_metadata
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


class _Prune(BlockMethod):
    """Pruning in the calibration walk: Hessians per `gptq_order` stage (none for magnitude),
    pruned blocks' outputs fed forward."""

    observe = staticmethod(hessian)

    def __init__(self, config: PruneConfig, spec: ModelSpec) -> None:
        self.config, self.spec = config, spec
        self.label = f"{config.method} {config.sparsity}"
        self.masks: dict[str, torch.Tensor] = {}
        self.layer_reports: list[dict[str, Any]] = []
        self.linears: dict[str, nn.Linear] = {}
        self.losses: dict[str, float] = {}

    def stages(self, step: BlockStep) -> list[list[str]]:
        self.linears, self.losses = prunable_linears(self.spec, step.block), {}
        return sequential_stages(self.spec, list(self.linears))

    def apply(self, step: BlockStep, stage: list[str], stats: dict[str, Any]) -> None:
        for name in stage:
            keep, self.losses[name] = _prune_linear(
                self.linears[name], self.config, stats.get(name)
            )
            self.masks[f"{step.name}.{name}"] = keep.cpu()

    def finish(self, step: BlockStep) -> None:
        self.layer_reports.append({"layer": step.index, "loss": self.losses})


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
    prior = compression_metadata(model)
    if prior.quantized:
        raise PruneConfigError("model is quantized; prune the full-precision model")
    if prior.pruned:
        raise PruneConfigError("model is already pruned; prune the dense model")
    spec = spec_for(model)
    _check_shapes(model, spec, config.sparsity)
    start = time.perf_counter()
    pruned = copy.deepcopy(model).eval()
    dtype = next(pruned.parameters()).dtype
    pruned.float()
    method = _Prune(config, spec)
    calib = calib_tokens if config.needs_calibration else None
    walk_blocks(pruned, calib, method, progress)
    masks, layers = method.masks, method.layer_reports
    pruned.to(dtype)
    if getattr(pruned.config, "tie_embeddings", False):
        head = spec.top_module(pruned, "head")
        head.weight = spec.top_module(pruned, "embedding").weight
    kept = sum(int(m.sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    report = {
        "seconds": time.perf_counter() - start,
        "pruned_fraction": 1.0 - kept / max(total, 1),
        "pruned_weights": total - kept,
        "prunable_weights": total,
        "layers": layers,
    }
    set_compression_metadata(
        pruned, prior.replace(prune_config=config, prune_masks=masks, prune_report=report)
    )
    return pruned
