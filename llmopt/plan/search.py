"""Enumerate, prune and rank parallel plans; evaluate one plan; explain rejections.

The search space is built as numpy arrays (one entry per plan) and every plan is scored by the
same vectorised memory and time model `estimate` uses, so ranking 10^5-10^6 plans takes well
under a second. Structural rules prune first (each with the reason `--why-not` prints), then
memory, then time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmopt.errors import UsageError
from llmopt.models.config import ModelConfig
from llmopt.parallel.plan import RECOMPUTES, ParallelPlan
from llmopt.plan.experts import expert_reasons
from llmopt.plan.frameworks import Numerics, framework_reasons
from llmopt.plan.grid import GRAD_REDUCES, STATE_OF_REDUCE_DTYPE, Grid, grid_row, to_grid
from llmopt.plan.hardware import GIB, Cluster
from llmopt.plan.memory import memory_breakdown
from llmopt.plan.objectives import Requirement, objective_band
from llmopt.plan.rules import msg_at, structural_reasons
from llmopt.plan.shortfall import NothingFitsError, no_candidates_message, nothing_fits_message
from llmopt.plan.space import build_grid  # noqa: F401  (re-exported: the search space)
from llmopt.plan.timing import comm_bytes_per_gpu, step_time
from llmopt.plan.workload import Workload, model_flops_per_step, recompute_flops_per_step


@dataclass
class Plan:
    """One evaluated plan: the mapping and everything the model predicts for it."""

    parallel: ParallelPlan
    fits: bool
    memory_bytes: dict[str, float]
    step_time_s: dict[str, float]
    tokens_per_s: float
    mfu: float
    hfu: float
    comm_bytes: dict[str, float]
    rejected: list[str] = field(default_factory=list)
    explanation: list[str] = field(default_factory=list)
    rank: int | None = None
    expert_tp: int = 1
    grad_reduce: str = "microbatch"  # ZeRO-2/3 gradient policy (grid.GRAD_REDUCES)
    mfu_bf16_peak: float | None = None  # FP8 runs: MFU against the bf16 peak, labelled so
    # expert-parallel degree; differs from parallel.ep only when EP is folded over tp·cp·dp
    # beyond dp·cp (Megatron-Core parallel folding), which ParallelPlan does not hold
    expert_parallel: int | None = None

    @property
    def ep(self) -> int:
        return self.parallel.ep if self.expert_parallel is None else self.expert_parallel

    def to_dict(self) -> dict[str, Any]:
        """ParallelPlan's fields, then what the model predicts for them."""
        mem = {k: self.memory_bytes[k] / GIB for k in self.memory_bytes}
        return {
            **self.parallel.to_dict(),
            "fits": self.fits,
            "memory_gib": {k: round(v, 3) for k, v in mem.items()},
            "step_time_s": {k: round(v, 6) for k, v in self.step_time_s.items()},
            "tokens_per_s": round(self.tokens_per_s, 1),
            "ep": self.ep,
            "etp": self.expert_tp,
            "grad_reduce": self.grad_reduce,
            "tokens_per_s_per_gpu": round(self.tokens_per_s / self.parallel.world_size, 1),
            "mfu": round(self.mfu, 4),
            "mfu_bf16_peak": None if self.mfu_bf16_peak is None else round(self.mfu_bf16_peak, 4),
            "hfu": round(self.hfu, 4),
            "comm_bytes_per_gpu_per_step": {k: float(v) for k, v in self.comm_bytes.items()},
            "rejected": self.rejected,
            "rank": self.rank,
            "explanation": self.explanation,
        }


@dataclass
class Evaluation:
    """Scores of every plan of a grid (arrays aligned with `grid`)."""

    work: Workload
    grid: Grid
    valid: np.ndarray  # structural rules and memory
    structural: np.ndarray
    reasons: list[tuple[str, np.ndarray]]  # (message, mask of plans it rejects)
    memory: dict[str, np.ndarray]
    time: dict[str, np.ndarray]
    comm: dict[str, np.ndarray] | None
    mfu: np.ndarray
    hfu: np.ndarray
    tokens_per_s: np.ndarray
    mfu_bf16: np.ndarray | None = None  # FP8 workloads: MFU against the bf16 peak
    framework: str = "llmopt"
    objective: str = "time"
    requires: tuple[Requirement, ...] = ()

    def __len__(self) -> int:
        return len(self.grid["tp"])

    def plan(self, i: int) -> Plan:
        return Plan(
            parallel=grid_row(self.grid, i, self.work.precision, self.work.state_bytes),
            fits=bool(self.memory["fits"][i]),
            memory_bytes={
                k: float(self.memory[k][i])
                for k in ("params", "grads", "optimizer", "activations", "other", "total")
            },
            step_time_s={k: float(v[i]) for k, v in self.time.items()},
            tokens_per_s=float(self.tokens_per_s[i]),
            mfu=float(self.mfu[i]),
            hfu=float(self.hfu[i]),
            comm_bytes={k: float(v[i]) for k, v in (self.comm or {}).items()},
            expert_tp=int(self.grid["etp"][i]) if "etp" in self.grid else 1,
            grad_reduce=GRAD_REDUCES[int(self.grid["gacc"][i])]
            if "gacc" in self.grid
            else "microbatch",
            mfu_bf16_peak=None if self.mfu_bf16 is None else float(self.mfu_bf16[i]),
            expert_parallel=int(self.grid["ep"][i]) if "ep" in self.grid else None,
        )


def evaluate(
    model: ModelConfig,
    work: Workload,
    cluster: Cluster,
    grid: Grid,
    with_comm: bool = True,
    framework: str = "llmopt",
    objective: str = "time",
    requires: tuple[Requirement, ...] = (),
) -> Evaluation:
    """Memory, time, MFU of every plan in `grid` and why each invalid one is invalid: the
    structural rules, then `framework`'s (frameworks.py), memory, then the `requires`."""
    if work.precision == "fp8":
        cluster.gpu.peak_flops("fp8")  # raises when the GPU has no FP8
    reasons = structural_reasons(model, work, cluster, grid)
    reasons += framework_reasons(framework, model, Numerics.of_work(work), grid)
    reasons += expert_reasons(model, grid)
    structural = np.ones(len(grid["tp"]), dtype=bool)
    for _, mask in reasons:
        structural &= ~mask
    mem = memory_breakdown(model, work, cluster, grid)
    reasons.append(
        (
            "needs {mem_gib} GiB per GPU, more than the "
            + f"{mem['usable'][0] / GIB:.1f} GiB usable",
            ~mem["fits"],
        )
    )
    valid = structural & mem["fits"]
    for req in requires:
        violates = req.violates(grid, mem["total"], cluster.gpus_per_node)
        reasons.append((f"--require {req.text} excludes it", violates))
        valid &= ~violates
    time = step_time(model, work, cluster, grid)
    total = time["total"]
    n = cluster.num_gpus
    peak = cluster.gpu.peak_flops(work.precision)  # FP8 MFU against the FP8 peak
    mflops = model_flops_per_step(model, work)
    rc_flops = np.array([recompute_flops_per_step(model, work, r) for r in RECOMPUTES])
    mfu = mflops / (total * n * peak)
    hfu = (mflops + rc_flops[grid["rc"]]) / (total * n * peak)
    bf16 = mfu * peak / cluster.gpu.peak_flops("bf16") if work.precision == "fp8" else None
    with_comm = with_comm or objective == "internode-bytes"
    comm = comm_bytes_per_gpu(model, work, cluster, grid) if with_comm else None
    return Evaluation(
        work,
        grid,
        valid,
        structural,
        reasons,
        mem,
        time,
        comm,
        mfu,
        hfu,
        work.tokens_per_step / total,
        bf16,
        framework,
        objective,
        tuple(requires),
    )


def plan_at(ev: Evaluation, i: int) -> Plan:
    """Plan i of an evaluation, with the rules it breaks (if any) in `rejected`."""
    p = ev.plan(i)
    mem = f"{ev.memory['total'][i] / GIB:.1f}"
    p.rejected = [msg_at(msg, ev.grid, i, mem_gib=mem) for msg, mask in ev.reasons if mask[i]]
    return p


# Plans predicted within this fraction of each other are ties: the model's own error is larger
# (median ~6 % on published runs). Within a band, prefer fewer per-micro-batch collectives and
# less machinery: lower ZeRO stage, less recomputation, no context parallelism, then less TP.
TIE_BAND = 0.01


def ranked(ev: Evaluation) -> np.ndarray:
    """Indices of valid plans, best first: by the evaluation's objective band (objectives.py),
    then fastest (1 % bands; see TIE_BAND)."""
    idx = np.flatnonzero(ev.valid)
    if len(idx) == 0:
        return idx
    g = ev.grid
    t = ev.time["total"][idx]
    inter = ev.comm["inter_node"][idx] if ev.comm else t
    first = objective_band(ev.objective, t, ev.memory["total"][idx], inter)
    band = np.floor((t / t.min() - 1) / TIE_BAND)
    keys = (t, g["tp"][idx], g["cp"][idx], g["rc"][idx], g["zero"][idx], band, first)
    order = np.lexsort(keys)
    return idx[order]


@dataclass
class SearchResult:
    plans: list[Plan]
    evaluated: int
    valid: int
    evaluation: Evaluation


def search(
    model: ModelConfig,
    work: Workload,
    cluster: Cluster,
    top_k: int = 10,
    constraints: dict[str, int] | None = None,
    framework: str = "llmopt",
    objective: str = "time",
    requires: tuple[Requirement, ...] = (),
) -> SearchResult:
    """Rank every valid plan that `framework` can run and meets `requires`, by `objective`;
    raise ValueError naming the shortfall when nothing is valid."""
    grid = build_grid(model, work, cluster, constraints)
    if len(grid["tp"]) == 0:
        raise UsageError(no_candidates_message(model, work, cluster, constraints))
    opts = dict(framework=framework, objective=objective, requires=tuple(requires))
    ev = evaluate(model, work, cluster, grid, with_comm=False, **opts)
    order = ranked(ev)
    if len(order) == 0:
        message = nothing_fits_message(model, work, cluster, ev, constraints)
        raise NothingFitsError(message, ev, constraints)
    top = order[:top_k]
    sub = {k: v[top] for k, v in grid.items()}
    top_ev = evaluate(model, work, cluster, sub, with_comm=True, **opts)
    plans = []
    for j in range(len(top)):
        p = plan_at(top_ev, j)
        p.rank = j + 1
        plans.append(p)
    return SearchResult(plans, len(grid["tp"]), int(ev.valid.sum()), ev)


def workload_for(work: Workload, plan: ParallelPlan) -> Workload:
    """The workload with the plan's precision (bf16/fp8; fp32 is refused) and gradient-reduce
    dtype (fp32: the "megatron" state convention, bf16: "zero")."""
    if plan.precision not in ("bf16", "fp8"):
        raise UsageError(f"precision={plan.precision!r}: the planner prices bf16 or fp8 training "
                         "(2-byte activations); choose bf16 or fp8")  # fmt: skip
    return dataclasses.replace(
        work, precision=plan.precision, state_bytes=STATE_OF_REDUCE_DTYPE[plan.reduce_dtype]
    )


def estimate(
    model: ModelConfig,
    work: Workload,
    cluster: Cluster,
    plan: ParallelPlan,
    etp: int | None = None,
    grad_reduce: str = "microbatch",
    ep: int | None = None,
) -> Plan:
    """Evaluate one fully specified plan (even an invalid one: `rejected` says why). Precision
    and reduce dtype come from the plan (`workload_for`); `etp` is the expert TP (None: tp);
    `ep` an expert-parallel degree folded beyond dp·cp (None: plan.ep)."""
    if plan.world_size != cluster.num_gpus:
        raise UsageError(
            f"tp*pp*dp*cp={plan.world_size} but the cluster has {cluster.num_gpus} GPUs "
            f"({cluster.nodes} nodes x {cluster.gpus_per_node})"
        )
    work = workload_for(work, plan)
    ev = evaluate(model, work, cluster, to_grid(plan, etp, grad_reduce, ep))
    out = plan_at(ev, 0)
    out.parallel = plan  # the grid does not carry fp8_recipe: keep the plan as given
    return out


def plan_of_rank(
    model: ModelConfig, work: Workload, cluster: Cluster, result: SearchResult, rank: int
) -> Plan:
    """The plan ranked `rank` (1 = best) among all valid plans of a search, fully evaluated."""
    order = ranked(result.evaluation)
    if not 1 <= rank <= len(order):
        raise UsageError(f"rank {rank} is not valid: {len(order)} plans are valid")
    if rank <= len(result.plans):
        return result.plans[rank - 1]
    i = int(order[rank - 1])
    ev = result.evaluation
    sub = {k: v[[i]] for k, v in ev.grid.items()}
    one = evaluate(model, work, cluster, sub, True, ev.framework, ev.objective, ev.requires)
    plan = plan_at(one, 0)
    plan.rank = rank
    return plan


def first_rank(result: SearchResult, accepts: Callable[[Plan], bool]) -> int | None:
    """The best rank whose plan `accepts(plan)` (a cheap check, e.g. an exporter's), if any."""
    for r, i in enumerate(ranked(result.evaluation), start=1):
        if accepts(plan_at(result.evaluation, int(i))):
            return r
    return None
