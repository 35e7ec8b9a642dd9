"""`plan compare`'s choice: for each partial mapping spec, the plan the search would run, and how
each compares with the fastest one that fits.

A spec fixes some ParallelPlan fields ("tp=8,pp=8"); the planner fills in the rest with its
ranking. When no variant is valid (usually memory), the leanest structurally valid variant is
returned, flagged as not fitting, so the comparison still shows what it would cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmopt.errors import UsageError
from llmopt.models.config import ModelConfig
from llmopt.plan.explain import link_report
from llmopt.plan.hardware import Cluster
from llmopt.plan.rules import parse_constraints
from llmopt.plan.search import Plan, build_grid, evaluate, plan_at, ranked
from llmopt.plan.workload import Workload


@dataclass
class Compared:
    """One compared mapping: its spec, the chosen plan, its collectives and its verdict."""

    spec: str
    plan: Plan
    collectives: list[dict]
    verdict: str = ""


def best_for_spec(model: ModelConfig, work: Workload, cluster: Cluster, spec: str) -> Plan:
    """The top-ranked plan with the spec's settings, else the leanest structurally valid one."""
    grid = build_grid(model, work, cluster, parse_constraints(spec))
    if len(grid["tp"]) == 0:
        raise UsageError(f"mapping {spec!r} is impossible on {cluster.num_gpus} GPUs")
    ev = evaluate(model, work, cluster, grid)
    order = ranked(ev)
    if len(order):
        return plan_at(ev, int(order[0]))
    ok = np.flatnonzero(ev.structural)
    if not len(ok):
        raise UsageError(f"mapping {spec!r} violates: " + "; ".join(plan_at(ev, 0).rejected))
    return plan_at(ev, int(ok[np.argmin(ev.memory["total"][ok])]))


def compare(
    model: ModelConfig, work: Workload, cluster: Cluster, specs: list[str]
) -> list[Compared]:
    """Each spec's plan (ranked 1..n in the given order) with a verdict versus the fastest."""
    out = []
    for i, spec in enumerate(specs):
        plan = best_for_spec(model, work, cluster, spec)
        plan.rank = i + 1
        out.append(Compared(spec, plan, link_report(model, work, cluster, plan.parallel)))
    fitting = [c.plan.step_time_s["total"] for c in out if c.plan.fits]
    fastest = min(fitting) if fitting else None
    for c in out:
        total = c.plan.step_time_s["total"]
        if not c.plan.fits:
            c.verdict = "does not fit: " + "; ".join(c.plan.rejected)
        elif total == fastest:
            c.verdict = "fastest"
        else:
            c.verdict = f"{total / fastest - 1:+.1%} vs fastest"
    return out
