"""The training planner against published runs: each row's configuration is evaluated with
`llmopt.plan` and the prediction converted into the quantity and FLOP convention the source
reported (Narayanan's Eq. 3, Megatron's model TFLOP/s, Megatron-Core's causal count, 6N+12LHQT,
iteration time, tokens/s). Calibration rows may tune cost terms; validation rows come from
other sources and are only predicted (`SETS`). Cells a source left open are the planner's
choice, printed as assumptions; optional columns (framework, reduce_dtype, tp_comm_overlap,
compile, dispatcher, ep_overlap, nvlink_domain, hbm_tbs) state what the source implies.
"""

from __future__ import annotations

import csv
import dataclasses
import re
from pathlib import Path

import numpy as np

from llmopt.models.config import ModelConfig
from llmopt.plan.flops import model_flops_per_token
from llmopt.plan.hardware import Cluster, customize, get_cluster
from llmopt.plan.search import Plan, build_grid, evaluate, plan_at
from llmopt.plan.workload import RECOMPUTES, SCHEDULES, Workload, megatron_flops
from llmopt.validate.cells import (
    RowError,
    count,
    flag,
    is_blank,
    moe_of_columns,
    row_preset,
    zero_stage,
)
from llmopt.validate.stats import error_summary

DATA = Path(__file__).resolve().parent / "data"
# (set, kind) -> CSV in llmopt/validate/data (sources per row; README.md there)
SETS: dict[tuple[str, str], Path] = {
    ("calibration", "dense"): DATA / "calibration_dense.csv",
    ("calibration", "moe"): DATA / "calibration_moe.csv",
    ("validation", "dense"): DATA / "validation_dense.csv",
    ("validation", "moe"): DATA / "validation_moe.csv",
}
REQUIRED = (
    "row_id", "source", "locator", "model", "layers", "hidden", "heads", "kv_heads",
    "ffn_hidden", "seq_len", "vocab", "gpu_type", "total_gpus", "tp", "pp", "dp", "cp",
    "virtual_pp_stages", "micro_batch", "global_batch_seqs", "recompute", "sequence_parallel",
    "zero_fsdp", "tflops_per_gpu_reported", "tflops_convention",
    "tokens_per_s_per_gpu_reported", "step_time_s_reported", "notes",
)  # fmt: skip
GPU_KEYS = (
    ("GB200", "gb200-nvl72"),  # before "B200": a GB200 row must not be read as a DGX-B200
    ("B200", "dgx-b200"),
    ("H200", "dgx-h200"),
    ("H800", "dgx-h800"),
    ("H100", "dgx-h100"),
    ("A100", "dgx-a100-80gb"),
)


def _float(value: str | None) -> float | None:
    try:
        return float((value or "").replace(",", ""))
    except ValueError:
        return None


@dataclasses.dataclass
class RowSetup:
    """One row as the planner sees it: model, workload, cluster, the reported mapping fields
    (grid keys) and the assumptions made where the source was silent."""

    model: ModelConfig
    work: Workload
    cluster: Cluster
    constraints: dict[str, int]
    assumptions: list[str]


def _model(row: dict[str, str], notes: list[str]) -> ModelConfig:
    preset = row_preset(row, notes)
    seq = count(row["seq_len"], "seq_len")
    if seq is None:
        raise RowError("seq_len must be stated")
    if preset is not None:
        return preset.replace(max_seq_len=max(seq, preset.max_seq_len))
    name = row["model"]
    llama = "llama" in name.lower()
    h, heads = count(row["hidden"], "hidden"), count(row["heads"], "heads")
    if h is None or heads is None:
        raise RowError("hidden and heads must be given (or a preset named)")
    times_h = re.match(r"\s*(\d+)\s*h\b", row["ffn_hidden"])  # "4h assumed (GPT)"
    if times_h:
        ffn = int(times_h.group(1)) * h
        notes.append(f"ffn={times_h.group(1)}h")
    else:
        ffn = count(row["ffn_hidden"], "ffn_hidden")
    if ffn is None:
        ffn = 4 * h
        notes.append("ffn=4h (GPT shape)")
    layers = count(row["layers"], "layers")
    vocab = count(row["vocab"], "vocab")
    if layers is None or vocab is None:
        raise RowError("layers and vocab must be given (or a preset named)")
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=count(row["kv_heads"], "kv_heads") or heads,
        max_seq_len=seq,
        mlp="swiglu" if llama else "gelu",
        tie_embeddings=not llama,
        moe=moe_of_columns(row, layers),
    )


def _cluster(row: dict[str, str], notes: list[str]) -> Cluster:
    gpu = row["gpu_type"]
    n_gpus = count(row["total_gpus"], "total_gpus")
    if n_gpus is None:
        raise RowError("total_gpus must be stated")
    key = next((k for tag, k in GPU_KEYS if tag in gpu.upper()), None)
    if key is None:
        raise RowError(f"gpu_type={gpu!r} is not a GPU the planner knows")
    # GPUs per NVLink domain: the largest divisor of the run's GPUs up to the stated domain
    # (else 72 for NVL72 racks, 8 for a DGX/HGX node)
    domain = count(row.get("nvlink_domain", ""), "nvlink_domain") or (
        72 if key == "gb200-nvl72" else 8
    )
    per_node = max(d for d in range(1, min(domain, n_gpus) + 1) if n_gpus % d == 0)
    if per_node != 8:
        notes.append(f"{per_node} GPUs per NVLink domain")
    if n_gpus % per_node:
        raise RowError(f"total_gpus={n_gpus} is not a multiple of {per_node} GPUs per node")
    cluster = get_cluster(key, n_gpus // per_node, per_node)
    peak = _float(row.get("peak_tflops_dense_16bit"))
    if peak:
        cluster = customize(cluster, **{"gpu.peak_bf16_tflops": peak})
    gb = re.search(r"(\d+)\s*GB\b(?!/s)", gpu)  # a board size, not a link speed
    if gb and abs(float(gb.group(1)) - cluster.gpu.hbm_gib / 0.99) > 2:
        gib = round(float(gb.group(1)) * 0.99, 1)  # "96 GB" boards expose 0.99 x in GiB
        cluster = customize(cluster, **{"gpu.hbm_gib": gib})
        notes.append(f"{gb.group(1)} GB board: HBM {gib} GiB usable")
    in_cell = re.search(r"([\d.]+)\s*TB/s", gpu)
    tbs = _float(row.get("hbm_tbs")) or (float(in_cell.group(1)) if in_cell else None)
    if tbs:
        cluster = customize(cluster, **{"gpu.hbm_bandwidth_gbs": tbs * 1000})
        notes.append(f"HBM {tbs} TB/s")
    watts = re.search(r"(\d+)\s*W\b", gpu)
    if watts:
        cluster = customize(cluster, **{"gpu.power_limit_w": float(watts.group(1))})
        notes.append(f"power limit {watts.group(1)} W")
    return cluster


def _workload(row: dict[str, str], model: ModelConfig, notes: list[str]) -> Workload:
    seq = count(row["seq_len"], "seq_len")
    years = [int(y) for y in re.findall(r"\b(20[12]\d)\b", row["source"] + row["locator"])]
    # Megatron-LM before 2023: no fused flash attention, gradient all-reduce after backward,
    # pipeline messages scattered over TP ranks.
    early = bool(years) and min(years) <= 2022
    framework = (row.get("framework") or "").strip().lower()
    prec = row.get("precision", "").lower()
    zero_txt = row["zero_fsdp"].lower()
    sharded = "fsdp" in zero_txt or "zero-3" in zero_txt
    deepspeed = "zero-3" in zero_txt and "fsdp" not in zero_txt
    # fp16 mixed precision (2021): fp16 gradients reduced (16 B/param). Megatron-Bridge / NeMo
    # performance recipes set grad_reduce_in_fp32=False (NVIDIA-NeMo/Megatron-Bridge@b7b4e11b
    # scripts/performance/configs/*): bf16 gradients, 16 B/param. Otherwise fp32 (18 B/param).
    reduce = (row.get("reduce_dtype") or "").strip().lower()
    if reduce not in ("fp32", "bf16"):
        bf16 = deepspeed or prec.startswith("fp16 mixed") or "performance recipes" in zero_txt
        reduce = "bf16" if bf16 or framework == "nemo" else "fp32"
    fp8 = "fp8" in prec.split("(")[0] or "float8" in prec
    tp_overlap = flag(row.get("tp_comm_overlap", ""), "tp_comm_overlap")
    if tp_overlap is None:
        text = (prec + row["notes"]).lower()
        tp_overlap = any(k in text for k in ("tp-comm-overlap", "async tp", "asynctp"))
    compiled = flag(row.get("compile", ""), "compile")
    fused = compiled if compiled is not None else ("eager" not in prec or "compile" in prec)
    ep_overlap = (row.get("ep_overlap") or "").strip().lower()
    work = Workload(
        seq_len=seq,
        global_batch=count(row["global_batch_seqs"], "global_batch_seqs", seq) or 0,
        precision="fp8" if fp8 else "bf16",
        flash_attention=not early,
        # GPT rows given by their shapes train with dropout; Llama and preset rows do not
        dropout=count(row["layers"], "layers") is not None and "llama" not in row["model"].lower(),
        state_bytes="zero" if reduce == "bf16" else "megatron",
        tp_comm_overlap=tp_overlap,
        dp_comm_overlap=not (early and not sharded),
        fused_kernels=fused,
        pp_scatter_gather=early,
        ep_comm_overlap=ep_overlap in ("yes", "1f1b"),
        ep_dispatcher=(row.get("dispatcher") or "alltoall").strip().lower(),
        dualpipe=ep_overlap == "dualpipe",
        sharding="deepspeed" if deepspeed or framework == "deepspeed" else "fsdp",
    )
    notes.append(
        f"flash={'yes' if work.flash_attention else 'no (Megatron <= 2022)'}, "
        f"dp_overlap={'yes' if work.dp_comm_overlap else 'no'}, "
        f"kernels={'fused' if work.fused_kernels else 'eager'}, {reduce} reduce"
        + (", fp8 GEMMs" if fp8 else "")
        + (", TP overlap" if tp_overlap else "")
    )
    return work


def setup_row(row: dict[str, str]) -> RowSetup:
    """Model, workload, cluster and the reported parts of the mapping for one CSV row."""
    notes: list[str] = []
    model = _model(row, notes)
    cluster = _cluster(row, notes)
    work = _workload(row, model, notes)
    c: dict[str, int] = {}
    for key in ("tp", "pp", "dp", "cp", "ep", "etp"):
        v = count(row.get(key, ""), key)
        if v is not None:
            c[key] = v
    if "cp" not in c:
        c["cp"] = 1
        notes.append("cp=1 (blank)")
    if model.moe is None and c.get("ep", 1) > 1:
        raise RowError(f"ep={c['ep']} but no experts (fill experts/top_k/... or name a preset)")
    mb = count(row["micro_batch"], "micro_batch")
    if mb is not None:
        c["mb"] = mb
    v = count(row["virtual_pp_stages"], "virtual_pp_stages")
    if v is not None:
        c["v"] = v
        c["sched"] = SCHEDULES.index("interleaved" if v > 1 else "1f1b")
    elif c.get("pp", 1) == 1:
        c["v"], c["sched"] = 1, SCHEDULES.index("1f1b")
    rec = row["recompute"].strip().lower()
    if rec.startswith("full"):
        c["rc"] = RECOMPUTES.index("full")
    elif rec.startswith("selective"):
        c["rc"] = RECOMPUTES.index("selective")
    elif rec.startswith(("none", "no")) and not is_blank(rec):  # "not stated": planner's choice
        c["rc"] = RECOMPUTES.index("none")
    sp = flag(row["sequence_parallel"], "sequence_parallel")
    if sp is not None:
        c["sp"] = int(sp)
    elif c.get("tp", 1) == 1:
        c["sp"] = 0
    zero = zero_stage(row["zero_fsdp"])
    if zero is not None:
        c["zero"] = zero
    return RowSetup(model, work, cluster, c, notes)


NAMES = {"mb": "micro_batch", "rc": "recompute", "sp": "sequence_parallel",
         "v": "virtual_stages", "zero": "zero_stage", "ep": "ep", "etp": "etp"}  # fmt: skip


def predict(setup: RowSetup) -> tuple[Plan, list[str]]:
    """Best plan under the row's constraints (what fits, else the leanest), and the choices the
    planner made where the source is silent."""
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


def measured_and_predicted(
    row: dict[str, str], setup: RowSetup, step_s: float
) -> tuple[str, float, float]:
    """(metric name, measured, predicted) in the row's own convention."""
    model, work = setup.model, setup.work
    n = setup.cluster.num_gpus
    conv = row["tflops_convention"]
    tflops = _float(row["tflops_per_gpu_reported"])
    B, s, L, h, V = (
        work.global_batch,
        work.seq_len,
        model.num_layers,
        model.hidden_size,
        model.vocab_size,
    )
    tokens = work.tokens_per_step
    tps = _float(row["tokens_per_s_per_gpu_reported"])
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
    t = _float(row["step_time_s_reported"])
    if t is not None:  # compared as throughput so the error has the same sense as the others
        return "iteration/s", 1 / t, 1 / step_s
    if tps is not None:
        return "tokens/s/GPU", tps, tokens / step_s / n
    raise RowError("no measured throughput column is filled")


def load_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a runs CSV; ValueError naming the file when it lacks a required column."""
    with Path(path).open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    missing = [c for c in REQUIRED if rows and c not in rows[0]]
    if not rows or missing:
        raise ValueError(f"{path} lacks columns {missing or 'rows'}")
    return rows


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
