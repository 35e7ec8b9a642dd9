"""The training planner against published runs: each row's configuration is evaluated with
`llmopt.plan` and the prediction converted into the quantity and FLOP convention the source
reported (Narayanan's Eq. 3, Megatron's model TFLOP/s, Megatron-Core's causal count, 6N+12LHQT,
iteration time, tokens/s). Calibration rows may tune cost terms; validation rows come from
other sources and are only predicted (`SETS`). Cells a source left open are the planner's
choice, printed as assumptions; optional columns (framework, reduce_dtype, tp_comm_overlap,
compile, dispatcher, ep_overlap, nvlink_domain, hbm_tbs, attention) state what the source
implies; the kernels a row ran are read by `llmopt.validate.software`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from llmopt.plan.flops import model_flops_per_token
from llmopt.plan.search import Plan, build_grid, evaluate, plan_at
from llmopt.plan.workload import megatron_flops
from llmopt.validate.cells import (
    RowError,
)
from llmopt.validate.run_rows import (  # noqa: F401  (SETS: the sets' CSVs, re-exported)
    NAMES,
    OPEN_BATCH_MICRO_BATCHES,
    SETS,
    RowSetup,
    load_rows,
    number,
    setup_row,
)
from llmopt.validate.stats import error_summary


def predict(setup: RowSetup) -> tuple[Plan, list[str]]:
    """Best plan under the row's constraints (what fits, else the leanest), and the choices the
    planner made where the source is silent. With an open global batch, the micro-batch with
    the most tokens/s among those that fit sets it (dp × micro-batch, one per step), and
    `setup.work` becomes that workload."""
    if setup.open_batch:
        return _predict_open_batch(setup)
    model, work, cluster = setup.model, setup.work, setup.cluster
    grid = build_grid(model, work, cluster, setup.constraints)
    if len(grid["tp"]) == 0:
        raise ValueError(f"no plan matches {setup.constraints}")
    ev = evaluate(model, work, cluster, grid, with_comm=False)
    ok = np.flatnonzero(ev.valid)
    fits = bool(len(ok))
    if fits:
        best = ok[np.argmin(ev.time["total"][ok])]
    else:
        ok = np.flatnonzero(ev.structural)
        if not len(ok):
            first = next((m for m, mask in ev.reasons if mask.all()), "no structurally valid plan")
            raise ValueError(f"{setup.constraints}: {first}")
        best = ok[np.argmin(ev.memory["total"][ok])]
    sub = {k: v[[best]] for k, v in grid.items()}
    plan = plan_at(evaluate(model, work, cluster, sub), 0)
    p = plan.parallel
    values = {"mb": p.micro_batch, "rc": p.recompute, "sp": str(p.sequence_parallel).lower(),
              "v": f"{p.virtual_stages} ({p.schedule})", "zero": p.zero_stage, "ep": p.ep,
              "etp": plan.expert_tp}  # fmt: skip
    chosen = [
        f"{label}={values[key]} (planner's choice)"
        for key, label in NAMES.items()
        if key not in setup.constraints and (key not in ("ep", "etp") or model.moe is not None)
    ]
    if not fits:
        chosen.append("predicted not to fit; leanest plan used")
    return plan, chosen


def _predict_open_batch(setup: RowSetup) -> tuple[Plan, list[str]]:
    dp = setup.constraints["dp"]
    given = setup.constraints.get("mb")
    best = None
    for mb in (given,) if given else OPEN_BATCH_MICRO_BATCHES:
        work = dataclasses.replace(setup.work, global_batch=dp * mb)
        one = dataclasses.replace(
            setup, work=work, constraints={**setup.constraints, "mb": mb}, open_batch=False
        )
        try:
            plan, chosen = predict(one)
        except ValueError:
            continue
        fits = plan.fits
        rate = work.tokens_per_step / plan.step_time_s["total"]
        key = (fits, rate if fits else -plan.memory_bytes["total"])
        if best is None or key > best[0]:
            best = (key, plan, chosen, work, mb)
    if best is None:
        raise ValueError(f"{setup.constraints}: no micro-batch gives a plan")
    _, plan, chosen, work, mb = best
    setup.work = work
    return plan, [*chosen, f"global batch = dp x micro_batch {mb} (planner's choice)"]


def measured_and_predicted(
    row: dict[str, str], setup: RowSetup, step_s: float
) -> tuple[str, float, float]:
    """(metric name, measured, predicted) in the row's own convention."""
    model, work = setup.model, setup.work
    n = setup.cluster.num_gpus
    conv = row["tflops_convention"]
    tflops = number(row["tflops_per_gpu_reported"])
    B, s, L, h, V = (
        work.global_batch,
        work.seq_len,
        model.num_layers,
        model.hidden_size,
        model.vocab_size,
    )
    tokens = work.tokens_per_step
    tps = number(row["tokens_per_s_per_gpu_reported"])
    if tflops is not None and tps is None:
        if "6N" in conv:  # torchtitan / PaLM: 6·(params without embedding) + 12·L·H·Q·T
            per_token = model_flops_per_token(model, s, "palm")
            return "TFLOP/s (6N+12LHQT)", tflops, per_token * tokens / step_s / n / 1e12
        if "causal" in conv.lower() or "megatron-core" in conv.lower():
            per_token = model_flops_per_token(model, s, "causal")
            return "TFLOP/s (Megatron-Core, causal)", tflops, per_token * tokens / step_s / n / 1e12
        if "96" in conv or "Eq.3" in conv:
            flops = megatron_flops(B, s, L, h, V, recompute=True)
            return "TFLOP/s (Eq.3, 96)", tflops, flops / step_s / n / 1e12
        flops = megatron_flops(B, s, L, h, V, recompute=False)
        return "TFLOP/s (model, 72)", tflops, flops / step_s / n / 1e12
    t = number(row["step_time_s_reported"])
    if t is not None:  # compared as throughput so the error has the same sense as the others
        return "iteration/s", 1 / t, 1 / step_s
    if tps is not None:
        return "tokens/s/GPU", tps, tokens / step_s / n
    raise RowError("no measured throughput column is filled")


@dataclasses.dataclass
class RowResult:
    row_id: str
    model: str
    gpus: int
    metric: str
    measured: float
    predicted: float
    plan: Plan
    assumptions: list[str]

    @property
    def rel_err(self) -> float:
        return self.predicted / self.measured - 1

    def to_dict(self) -> dict:
        return {
            "row_id": self.row_id, "model": self.model, "gpus": self.gpus, "metric": self.metric,
            "measured": self.measured, "predicted": self.predicted, "rel_err": self.rel_err,
            "plan": self.plan.to_dict(), "assumptions": self.assumptions,
        }  # fmt: skip


def evaluate_rows(rows: list[dict[str, str]]) -> tuple[list[RowResult], list[tuple[str, str]]]:
    """Predictions of every row, and (row_id, reason) for rows not understood or not
    predicted: one odd row never hides the others."""
    results, failed = [], []
    for row in rows:
        rid = row.get("row_id", "?")
        try:
            setup = setup_row(row)
            plan, chosen = predict(setup)
            metric, meas, pred = measured_and_predicted(row, setup, plan.step_time_s["total"])
        except RowError as exc:
            failed.append((rid, f"not understood: {exc}"))
            continue
        except (ValueError, KeyError) as exc:
            failed.append((rid, f"not predicted: {exc}"))
            continue
        results.append(
            RowResult(
                rid,
                row["model"],
                setup.cluster.num_gpus,
                metric,
                meas,
                pred,
                plan,
                setup.assumptions + chosen,
            )  # fmt: skip
        )
    return results, failed


def summary(results: list[RowResult]) -> tuple[float, float]:
    """(median, p90) of |predicted / measured - 1| (`llmopt.validate.stats`)."""
    return error_summary([r.rel_err for r in results])


def sources(path: Path) -> set[str]:
    """The `source_id` of every row of a runs CSV (what the split keeps apart)."""
    return {r["source_id"].strip() for r in load_rows(path)}
