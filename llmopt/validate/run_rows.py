"""A published run's row read into what the planner evaluates: the model, the cluster and the
workload the source states, with every open cell named as an assumption (`RowSetup`).
`llmopt.validate.planner_runs` predicts and scores the rows.
"""

from __future__ import annotations

import csv
import dataclasses
import re
from pathlib import Path

from llmopt.models.config import ModelConfig
from llmopt.plan.hardware import Cluster, customize, get_cluster
from llmopt.plan.workload import RECOMPUTES, SCHEDULES, Workload
from llmopt.validate.cells import (
    RowError,
    count,
    flag,
    is_blank,
    moe_of_columns,
    row_preset,
    zero_stage,
)
from llmopt.validate.software import kernel_traits, software_years

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


def number(value: str | None) -> float | None:
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
    # the source states no global batch: one micro-batch per step on each of the dp ranks
    # (torchtitan before gradient accumulation), the micro-batch the planner's choice
    open_batch: bool = False


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
    peak = number(row.get("peak_tflops_dense_16bit"))
    if peak:
        cluster = customize(cluster, **{"gpu.peak_bf16_tflops": peak})
    gb = re.search(r"(\d+)\s*GB\b(?!/s)", gpu)  # a board size, not a link speed
    if gb and abs(float(gb.group(1)) - cluster.gpu.hbm_gib / 0.99) > 2:
        gib = round(float(gb.group(1)) * 0.99, 1)  # "96 GB" boards expose 0.99 x in GiB
        cluster = customize(cluster, **{"gpu.hbm_gib": gib})
        notes.append(f"{gb.group(1)} GB board: HBM {gib} GiB usable")
    in_cell = re.search(r"([\d.]+)\s*TB/s", gpu)
    tbs = number(row.get("hbm_tbs")) or (float(in_cell.group(1)) if in_cell else None)
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
    years = software_years(row)
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
        global_batch=count(row["global_batch_seqs"], "global_batch_seqs", seq) or 1,
        precision="fp8" if fp8 else "bf16",
        flash_attention=not early,
        **kernel_traits(row, years, fp8),
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
        f"flash={work.attention_kernel if work.flash_attention else 'no (Megatron <= 2022)'}, "
        f"dp_overlap={'yes' if work.dp_comm_overlap else 'no'}, "
        f"kernels={'fused' if work.fused_kernels else 'eager'}, {reduce} reduce"
        + (", fp8 GEMMs" if fp8 else "")
        + (", TP overlap" if tp_overlap else "")
        + (", op-level SAC" if work.selective == "every-other-mm" else "")
        + (", torchao casts" if work.fp8_casts == "torchao" else "")
        + (", FP8 all-gather" if work.fp8_param_gather else "")
        + (", bf16 Adam moments" if work.moments == "bf16" else "")
        + (f", modules {'/'.join(work.recompute_modules)}" if work.recompute_modules else "")
    )
    return work


# Stages per rank a framework builds for an interleaved schedule when the run names no split:
# torchtitan's generate_split_points gives every PipelineScheduleMulti 2 stages per rank
# (torchtitan/parallelisms/pipelining_utils.py @9dec370ad26b5f8e9a7333a0e36165018262644b).
FRAMEWORK_INTERLEAVED_V = {"torchtitan": 2}


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
    elif (row.get("framework") or "").strip().lower() in FRAMEWORK_INTERLEAVED_V and re.search(
        r"interleaved", f"{row.get('locator', '')} {row.get('notes', '')}", re.IGNORECASE
    ):
        framework = row["framework"].strip().lower()
        c["v"] = FRAMEWORK_INTERLEAVED_V[framework]
        c["sched"] = SCHEDULES.index("interleaved")
        notes.append(f"v={c['v']} ({framework}'s default stages per rank, not stated)")
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
    open_batch = count(row["global_batch_seqs"], "global_batch_seqs", work.seq_len) is None
    if open_batch and "dp" not in c:
        raise RowError("global_batch_seqs and dp are both open; state one")
    return RowSetup(model, work, cluster, c, notes, open_batch)


OPEN_BATCH_MICRO_BATCHES = (1, 2, 4, 8, 16)


NAMES = {"mb": "micro_batch", "rc": "recompute", "sp": "sequence_parallel",
         "v": "virtual_stages", "zero": "zero_stage", "ep": "ep", "etp": "etp"}  # fmt: skip


def load_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a runs CSV; ValueError naming the file when it lacks a required column."""
    with Path(path).open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    missing = [c for c in REQUIRED if rows and c not in rows[0]]
    if not rows or missing:
        raise ValueError(f"{path} lacks columns {missing or 'rows'}")
    return rows
