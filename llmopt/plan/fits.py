""" "Fits with X": when the plans a user asks about do not fit in memory, the one switch that
makes them fit (issue 27 item 5), and the best plan some framework runs next to the
unconstrained #1.

A switch is tried only where it changes something the constraints or the workload fixed: the
gradient-reduce dtype (bf16 gradients, 16 instead of 18 B/param: what NeMo's performance
recipes and DeepSpeed use), a fixed recompute mode (selective, then full), a fixed ZeRO stage
(one more), a fixed micro-batch (1). The cheapest switch whose plans fit is named with the
memory and step time of its best plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.parallel.plan import RECOMPUTES
from llmopt.plan.hardware import GIB, Cluster
from llmopt.plan.rules import format_constraints
from llmopt.plan.search import Evaluation, build_grid, evaluate
from llmopt.plan.workload import Workload


def _switches(constraints: dict[str, int], work: Workload) -> list[tuple[str, dict, Workload]]:
    out = []
    if work.state_bytes == "megatron":
        out.append(
            ("--reduce-dtype bf16", constraints, dataclasses.replace(work, state_bytes="zero"))
        )
    rc = constraints.get("rc")
    for target in ("selective", "full"):
        if rc is not None and RECOMPUTES.index(target) > rc:
            out.append(
                (f"recompute={target}", {**constraints, "rc": RECOMPUTES.index(target)}, work)
            )
    z = constraints.get("zero")
    if z is not None and z < 3:
        out.append((f"zero_stage={z + 1}", {**constraints, "zero": z + 1}, work))
    if constraints.get("mb", 1) > 1:
        out.append(("micro_batch=1", {**constraints, "mb": 1}, work))
    return out


def fits_with(
    model: ModelConfig,
    work: Workload,
    cluster: Cluster,
    constraints: dict[str, int],
    ev: Evaluation,
) -> str | None:
    """One line naming the cheapest switch that makes plans with `constraints` fit (None when
    none of the switches does, or when memory is not what rejects them)."""
    best: tuple[float, str] | None = None
    for label, cons, w in _switches(constraints, work):
        grid = build_grid(model, w, cluster, cons)
        if len(grid["tp"]) == 0:
            continue
        alt = evaluate(model, w, cluster, grid, False, ev.framework, ev.objective, ev.requires)
        ok = np.flatnonzero(alt.valid)
        if not len(ok):
            continue
        i = int(ok[np.argmin(alt.time["total"][ok])])
        t = float(alt.time["total"][i])
        mem = float(alt.memory["total"][i]) / GIB
        line = (
            f"  Fits with {label}: {format_constraints({k: int(v[i]) for k, v in grid.items() if k in ('tp', 'pp', 'dp', 'cp', 'zero', 'rc', 'mb')})} "
            f"needs {mem:.1f} GiB per GPU and takes {t:.2f} s per step."
        )
        if best is None or t < best[0]:
            best = (t, line)
    return None if best is None else best[1]
