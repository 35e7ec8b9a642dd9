"""Validate the planner against published training runs.

    python benchmarks/validate_planner.py [--runs benchmarks/data/published_runs.csv]
    python benchmarks/validate_planner.py --runs benchmarks/data/published_moe_runs.csv

Each row's exact configuration is evaluated with `llmopt.plan` and the prediction is converted
into the quantity and FLOP convention the source reported (Narayanan Eq. 3 TFLOP/s, which counts
the recomputed forward; Megatron model TFLOP/s; iteration time; tokens/s), so like is compared
with like. Fields the source left blank or "not reported" are chosen by the planner itself (the
fastest plan that fits, with every reported field held fixed) and printed as assumptions.
The `model` cell may name a preset (`llmopt.models.presets`) instead of giving shapes; optional
MoE columns `experts, top_k, shared_experts, expert_ffn_hidden, moe_layers, ep, etp` describe
or check the experts and fix the expert mapping. Free-text cells are read by
`published_cells` ("~2K (4M tokens)", "FSDP: off", "not stated"); a row that cannot be
understood is reported as such and left out of the statistics.
The last line is `median_abs_rel_err=<x> p90_abs_rel_err=<y> n=<rows>`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from llmopt.models.config import ModelConfig
from llmopt.plan.hardware import Cluster, customize, get_cluster
from llmopt.plan.search import build_grid, evaluate, plan_at
from llmopt.plan.workload import RECOMPUTES, SCHEDULES, Workload, megatron_flops

REQUIRED = (
    "row_id", "model", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "seq_len", "vocab",
    "gpu_type", "total_gpus", "tp", "pp", "dp", "cp", "virtual_pp_stages", "micro_batch",
    "global_batch_seqs", "recompute", "sequence_parallel", "zero_fsdp", "tflops_per_gpu_reported",
    "tflops_convention", "tokens_per_s_per_gpu_reported", "step_time_s_reported", "notes",
)  # fmt: skip


sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_cells import (  # noqa: E402
    RowError,
    count,
    is_blank,
    moe_of_columns,
    row_preset,
    zero_stage,
)


def _int(value: str, what: str = "cell", seq_len: int | None = None) -> int | None:
    return count(value or "", what, seq_len)


def _float(value: str) -> float | None:
    try:
        return float((value or "").replace(",", ""))
    except ValueError:
        return None


GPU_KEYS = (
    ("GB200", "gb200-nvl72"),  # before "B200": a GB200 row must not be read as a DGX-B200
    ("B200", "dgx-b200"),
    ("H200", "dgx-h200"),
    ("H100", "dgx-h100"),
    ("A100", "dgx-a100-80gb"),
)


@dataclasses.dataclass
class RowSetup:
    model: ModelConfig
    work: Workload
    cluster: Cluster
    constraints: dict[str, int]
    assumptions: list[str]


def setup_row(row: dict[str, str]) -> RowSetup:
    """Model, workload, cluster and the reported parts of the mapping for one CSV row."""
    notes: list[str] = []
    name = row["model"]
    preset = row_preset(row, notes)
    llama = preset is not None or "llama" in name.lower()
    h = preset.hidden_size if preset else _int(row["hidden"], "hidden")
    heads = preset.num_heads if preset else _int(row["heads"], "heads")
    ffn_cell = row["ffn_hidden"]
    times_h = re.match(r"\s*(\d+)\s*h\b", ffn_cell)  # "4h assumed (GPT)"
    if preset:
        ffn = preset.intermediate_size
    elif times_h and h is not None:
        ffn = int(times_h.group(1)) * h
        notes.append(f"ffn={times_h.group(1)}h")
    else:
        ffn = _int(ffn_cell, "ffn_hidden")
    if h is None or heads is None:
        raise RowError("hidden and heads must be given (or a preset named)")
    if ffn is None:
        ffn = 4 * h
        notes.append("ffn=4h (GPT shape)")
    seq = _int(row["seq_len"], "seq_len")
    if seq is None:
        raise RowError("seq_len must be stated")
    model = (
        preset.replace(max_seq_len=max(seq, preset.max_seq_len))
        if preset
        else ModelConfig(
            name=name,
            vocab_size=int(row["vocab"]),
            hidden_size=h,
            intermediate_size=ffn,
            num_layers=int(row["layers"]),
            num_heads=heads,
            num_kv_heads=_int(row["kv_heads"], "kv_heads") or heads,
            max_seq_len=seq,
            mlp="swiglu" if llama else "gelu",
            tie_embeddings=not llama,
            moe=moe_of_columns(row, int(row["layers"])),
        )
    )
    gpu = row["gpu_type"]
    n_gpus = _int(row["total_gpus"], "total_gpus")
    if n_gpus is None:
        raise RowError("total_gpus must be stated")
    key = next((k for tag, k in GPU_KEYS if tag in gpu), None)
    if key is None:
        raise ValueError(f"row {row['row_id']}: unknown gpu_type {gpu!r}")
    if n_gpus > 8 and n_gpus % 8 and key != "gb200-nvl72":
        raise ValueError(f"row {row['row_id']}: total_gpus={n_gpus} is not a multiple of 8")
    per_node = min(n_gpus, 8)
    if key == "gb200-nvl72":  # the run's GPUs per 72-GPU NVLink rack: largest divisor <= 72
        per_node = max(d for d in range(1, 73) if n_gpus % d == 0)
        notes.append(f"{per_node} GPUs per NVLink domain")
    cluster = get_cluster(key, max(n_gpus // per_node, 1), per_node)
    peak = _float(row.get("peak_tflops_dense_16bit", ""))
    if peak:
        cluster = customize(cluster, **{"gpu.peak_bf16_tflops": peak})
    gb = re.search(r"(\d+)\s*GB", gpu)
    if gb and abs(float(gb.group(1)) - cluster.gpu.hbm_gib / 0.99) > 2:
        gib = round(float(gb.group(1)) * 0.99, 1)  # "80 GB" boards expose 79.2 GiB
        cluster = customize(cluster, **{"gpu.hbm_gib": gib})
        notes.append(f"{gb.group(1)} GB board: HBM {gib} GiB usable")
    watts = re.search(r"(\d+)\s*W\b", gpu)
    if watts:
        cluster = customize(cluster, **{"gpu.power_limit_w": float(watts.group(1))})
        notes.append(f"power limit {watts.group(1)} W")
    years = [
        int(y)
        for y in re.findall(r"\b(20[12]\d)\b", row.get("source", "") + row.get("locator", ""))
    ]
    # Megatron-LM before 2023: no fused flash attention, gradient all-reduce after backward,
    # pipeline messages scattered over TP ranks.
    early = bool(years) and min(years) <= 2022
    prec = row.get("precision", "").lower()
    rec = row["recompute"].lower()
    zero_txt = row["zero_fsdp"].lower()
    zero = zero_stage(row["zero_fsdp"])
    sharded = "fsdp" in zero_txt or "zero-3" in zero_txt
    deepspeed = "zero-3" in zero_txt and "fsdp" not in zero_txt
    # fp16 mixed precision (2021): fp16 gradients all-reduced, fp32 master + Adam (16 B/param);
    # bf16 Megatron/torchtitan accumulate and reduce gradients in fp32 (18 B/param).
    fp16 = prec.startswith("fp16 mixed")
    # Megatron-Bridge / NeMo performance recipes set ddp.grad_reduce_in_fp32=False (scripts/
    # performance/configs/*: "cfg.ddp.grad_reduce_in_fp32 = False"): bf16 gradient buffer and
    # reduce-scatter, 16 B/param.
    bf16_grads = "performance recipes" in zero_txt
    fp8 = "fp8" in prec.split("(")[0] or "float8" in prec
    work = Workload(
        seq_len=seq,
        global_batch=_int(row["global_batch_seqs"], "global_batch_seqs", seq) or 0,
        precision="fp8" if fp8 else "bf16",
        flash_attention=not early,
        dropout=not llama,
        state_bytes="zero" if deepspeed or fp16 or bf16_grads else "megatron",
        tp_comm_overlap=any(
            k in (prec + row["notes"]).lower() for k in ("tp-comm-overlap", "async tp")
        ),
        dp_comm_overlap=not (early and not sharded),
        fused_kernels="eager" not in prec or "compile" in prec,
        pp_scatter_gather=early,
    )
    notes.append(
        f"flash={'yes' if work.flash_attention else 'no (Megatron <= 2022)'}, "
        f"dp_overlap={'yes' if work.dp_comm_overlap else 'no'}, "
        f"kernels={'fused' if work.fused_kernels else 'eager'}, {work.state_bytes} B/param"
        + (", fp8 GEMMs" if fp8 else "")
    )
    c: dict[str, int] = {}
    for key in ("tp", "pp", "dp", "cp", "ep", "etp"):
        v = _int(row.get(key, ""), key)
        if v is not None:
            c[key] = v
    if "cp" not in c:
        c["cp"] = 1
        notes.append("cp=1 (blank)")
    if model.moe is None and c.get("ep", 1) > 1:
        raise RowError(f"ep={c['ep']} but no experts (fill experts/top_k/... or name a preset)")
    mb = _int(row["micro_batch"], "micro_batch")
    if mb is not None:
        c["mb"] = mb
    v = _int(row["virtual_pp_stages"], "virtual_pp_stages")
    if v is not None:
        c["v"] = v
        c["sched"] = SCHEDULES.index("interleaved" if v > 1 else "1f1b")
    elif c.get("pp", 1) == 1:
        c["v"], c["sched"] = 1, SCHEDULES.index("1f1b")
    if rec.startswith("full"):
        c["rc"] = RECOMPUTES.index("full")
    elif rec.startswith("selective"):
        c["rc"] = RECOMPUTES.index("selective")
    elif rec.startswith(("none", "no")) and not is_blank(rec):  # "not stated": planner's choice
        c["rc"] = RECOMPUTES.index("none")
    sp = row["sequence_parallel"].strip().lower()
    if sp in ("yes", "no"):
        c["sp"] = int(sp == "yes")
    elif c.get("tp", 1) == 1:
        c["sp"] = 0
    if zero is not None:
        c["zero"] = zero
    return RowSetup(model, work, cluster, c, notes)


def predict(setup: RowSetup):
    """Best plan under the row's constraints; prefers plans that fit, else the leanest."""
    model, work, cluster = setup.model, setup.work, setup.cluster
    grid = build_grid(model, work, cluster, setup.constraints)
    if len(grid["tp"]) == 0:
        raise ValueError(f"no plan matches {setup.constraints}")
    ev = evaluate(model, work, cluster, grid, with_comm=False)
    ok = np.flatnonzero(ev.valid)
    if len(ok):
        best = ok[np.argmin(ev.time["total"][ok])]
        fits = True
    else:
        ok = np.flatnonzero(ev.structural)
        if not len(ok):
            raise ValueError(f"no structurally valid plan for {setup.constraints}")
        best = ok[np.argmin(ev.memory["total"][ok])]
        fits = False
    sub = {k: v[[best]] for k, v in grid.items()}
    plan = plan_at(evaluate(model, work, cluster, sub), 0)
    chosen = []
    names = {
        "mb": "micro_batch",
        "rc": "recompute",
        "sp": "sequence_parallel",
        "v": "virtual_stages",
        "zero": "zero_stage",
    }
    p = plan.parallel
    values = {
        "mb": p.micro_batch,
        "rc": p.recompute,
        "sp": str(p.sequence_parallel).lower(),
        "v": f"{p.virtual_stages} ({p.schedule})",
        "zero": p.zero_stage,
    }
    for key, label in names.items():
        if key not in setup.constraints:
            chosen.append(f"{label}={values[key]} (planner's choice)")
    if not fits:
        chosen.append("predicted not to fit; leanest plan used")
    return plan, chosen


def measured_and_predicted(row: dict[str, str], setup: RowSetup, step_s: float):
    """(metric name, measured, predicted) in the row's own convention."""
    model, work = setup.model, setup.work
    n = int(row["total_gpus"])
    conv = row["tflops_convention"]
    tflops = _float(row["tflops_per_gpu_reported"])
    B, s, L, h, V = work.global_batch, work.seq_len, model.num_layers, model.hidden_size, None
    V = model.vocab_size
    if tflops is not None:
        if "6N" in conv:  # torchtitan: 6·(params without embedding) + 12·L·h·s per token
            n_params = model.num_parameters() - model.embedding_parameters()
            per_token = 6 * n_params + 12 * L * model.q_size * s
            return (
                "TFLOP/s (6N+12Lhs)",
                tflops,
                per_token * work.tokens_per_step / step_s / n / 1e12,
            )
        if "96" in conv or "Eq.3" in conv:
            flops = megatron_flops(B, s, L, h, V, recompute=True)
            return "TFLOP/s (Eq.3, 96)", tflops, flops / step_s / n / 1e12
        flops = megatron_flops(B, s, L, h, V, recompute=False)
        return "TFLOP/s (model, 72)", tflops, flops / step_s / n / 1e12
    t = _float(row["step_time_s_reported"])
    if t is not None:
        # Compare as throughput so the error has the same sense as the other rows.
        return "iteration/s", 1 / t, 1 / step_s
    tps = _float(row["tokens_per_s_per_gpu_reported"])
    if tps is not None:
        return "tokens/s/GPU", tps, work.tokens_per_step / step_s / n
    mfu = re.match(r"\s*([\d.]+)\s*%", row.get("mfu_reported", ""))
    if mfu:
        peak = setup.cluster.gpu.peak_flops("bf16")
        pred = megatron_flops(B, s, L, h, V, recompute=False) / step_s / n / peak
        return "MFU (72)", float(mfu.group(1)) / 100, pred
    raise ValueError(f"row {row['row_id']}: no measured throughput column is filled")


def main(argv: list[str] | None = None) -> int:
    default_csv = Path(__file__).resolve().parent / "data" / "published_runs.csv"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(default_csv), help="CSV of published runs")
    ap.add_argument("--out", default="runs/validate_planner.json", help="JSON results path")
    ap.add_argument("--plot", default=None, help="write a predicted-vs-measured PNG here")
    args = ap.parse_args(argv)
    path = Path(args.runs)
    if not path.is_file():
        raise SystemExit(f"validate_planner: no runs CSV at {path}")
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    missing = [c for c in REQUIRED if rows and c not in rows[0]]
    if not rows or missing:
        raise SystemExit(f"validate_planner: {path} lacks columns {missing or 'rows'}")
    console = Console(width=200)
    table = Table(title=f"planner vs published runs ({path.name})")
    for col in ("row", "model", "GPUs", "mapping", "metric", "measured", "predicted", "err"):
        table.add_column(
            col, justify="right" if col in ("GPUs", "measured", "predicted", "err") else "left"
        )
    table.add_column("assumed", overflow="fold")
    results = []
    failed = []
    for row in rows:
        try:
            setup = setup_row(row)
            plan, chosen = predict(setup)
            metric, meas, pred = measured_and_predicted(row, setup, plan.step_time_s["total"])
        except (ValueError, KeyError) as exc:  # one odd row must not hide the others
            what = "not understood" if isinstance(exc, RowError) else "not predicted"
            failed.append({"row_id": row.get("row_id"), "error": f"{what}: {exc}"})
            table.add_row(row.get("row_id", "?"), row.get("model", "?"), row.get("total_gpus", "?"),
                          "-", "-", "-", "-", "n/a", f"{what}: {exc}")  # fmt: skip
            continue
        err = pred / meas - 1
        p = plan.parallel
        mapping = f"t{p.tp} p{p.pp} d{p.dp} mb{p.micro_batch} v{p.virtual_stages} z{p.zero_stage} {p.recompute}"
        mapping += f" e{p.ep}/{plan.expert_tp}" if p.ep > 1 else ""
        results.append(
            {
                "row_id": row["row_id"],
                "model": row["model"],
                "gpus": int(row["total_gpus"]),
                "metric": metric,
                "measured": meas,
                "predicted": pred,
                "rel_err": err,
                "plan": plan.to_dict(),
                "assumptions": setup.assumptions + chosen,
            }
        )
        table.add_row(
            row["row_id"], row["model"], row["total_gpus"], mapping, metric,
            f"{meas:.4g}", f"{pred:.4g}", f"{err:+.1%}", "; ".join(setup.assumptions + chosen),
        )  # fmt: skip
    console.print(table)
    if failed:
        console.print(f"{len(failed)} row(s) not predicted: {failed}")
    if not results:
        raise SystemExit("validate_planner: no row could be predicted")
    errs = [abs(r["rel_err"]) for r in results]
    med = statistics.median(errs)
    p90 = float(np.percentile(errs, 90))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "runs": str(path),
        "median_abs_rel_err": med,
        "p90_abs_rel_err": p90,
        "rows": results,
    }
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(payload, fh, indent=1)
    os.replace(tmp, out)
    if args.plot:
        _plot(results, Path(args.plot))
    print(f"median_abs_rel_err={med:.4f} p90_abs_rel_err={p90:.4f} n={len(results)}")
    return 0


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    errs = [100 * r["rel_err"] for r in results]
    ax.bar(
        [r["row_id"] for r in results], errs, color=["C0" if abs(e) <= 10 else "C3" for e in errs]
    )
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("published run (row_id)")
    ax.set_ylabel("predicted / measured throughput - 1 (%)")
    ax.set_title("llmopt plan vs published runs")
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
