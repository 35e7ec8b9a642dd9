"""The one-line errors of a search that finds no valid plan: what to change, not a traceback."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmopt.errors import UsageError
from llmopt.models.config import ModelConfig
from llmopt.plan.grid import grid_row
from llmopt.plan.hardware import GIB, Cluster
from llmopt.plan.rules import format_constraints, msg_at
from llmopt.plan.workload import Workload


def no_candidates_message(
    model: ModelConfig, work: Workload, cluster: Cluster, constraints: dict[str, int] | None
) -> str:
    """Why no mapping at all could be generated."""
    what = f" with {format_constraints(constraints)}" if constraints else ""
    for key in ("tp", "pp", "dp", "cp"):
        if constraints and key in constraints and cluster.num_gpus % constraints[key]:
            return f"{key}={constraints[key]} does not divide the {cluster.num_gpus} GPUs"
    return (
        f"no mapping of {cluster.num_gpus} GPUs{what} divides global batch "
        f"{work.global_batch} and the model's layers; change the batch, the GPU count or the "
        "constraints"
    )


def nothing_fits_message(
    model: ModelConfig,
    work: Workload,
    cluster: Cluster,
    ev: Any,  # llmopt.plan.search.Evaluation (not imported: search imports this module)
    constraints: dict[str, int] | None,
) -> str:
    """Why every generated mapping is invalid: the first rule, or the leanest plan's shortfall."""
    what = f" with {format_constraints(constraints)}" if constraints else ""
    if not ev.structural.any():
        counts: dict[str, int] = {}
        for msg, mask in ev.reasons:
            if mask.any() and "{mem_gib}" not in msg:
                counts[msg_at(msg, ev.grid, int(np.flatnonzero(mask)[0]))] = int(mask.sum())
        first = next(iter(counts))
        return f"no valid mapping{what} for {model.name}: e.g. {first}"
    fitting = ev.structural & ev.memory["fits"]
    if fitting.any():  # only the --require expressions exclude the rest
        i = int(np.flatnonzero(fitting)[0])
        excluded = [msg_at(m, ev.grid, i) for m, mask in ev.reasons if "--require" in m and mask[i]]
        texts = ", ".join(r.text for r in ev.requires)
        return (
            f"no plan{what} for {model.name} meets --require {texts}: e.g. "
            f"{grid_row(ev.grid, i).short()} fits but {excluded[0]}"
        )
    idx = np.flatnonzero(ev.structural)
    best = idx[np.argmin(ev.memory["total"][idx])]
    need = ev.memory["total"][best] / GIB
    have = ev.memory["usable"][best] / GIB
    p = grid_row(ev.grid, int(best))
    return (
        f"{model.name} does not fit on {cluster.nodes}x{cluster.gpus_per_node} "
        f"{cluster.gpu.name}{what}: the leanest plan ({p.short()}, zero_stage={p.zero_stage}, "
        f"recompute={p.recompute}, micro_batch={p.micro_batch}) needs {need:.1f} GiB per GPU, "
        f"{need - have:.1f} GiB more than the {have:.1f} GiB usable"
    )


class NothingFitsError(UsageError):
    """A search whose every plan is invalid; carries the evaluation so a caller can say which
    switch would admit plans (`llmopt.plan.fits.fits_with`)."""

    def __init__(self, message: str, evaluation: Any, constraints: dict[str, int] | None):
        super().__init__(message)
        self.evaluation = evaluation
        self.constraints = dict(constraints or {})
