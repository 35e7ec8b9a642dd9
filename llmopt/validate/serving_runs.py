"""The serving planner (`llmopt plan serve`) against published serving measurements.

Columns: row_id, model, gpu, num_gpus, tp, ep, precision, kv_dtype, input_len, output_len,
load (`offline`, `concurrency=N` or `rate=R`), output_tokens_per_s, ttft_ms, itl_ms, source,
locator; optional: num_requests (the benchmark's requests, replayed at a rate), scheduler
(mixed, prefill-first), multi_step, max_num_tokens (the engine's token budget per iteration).
A length written as a range ("1-1024") is drawn uniformly per request, as the benchmarks'
random datasets do.

The finite-request-rate rows are split like the training rows: `calibration_serving_online.csv`
(constants may be chosen on them) and `validation_serving_online.csv` (only ever predicted;
its `source_id`s appear in no calibration file). Cells are free text read robustly ("28,312", "~36 ms", "H100 SXM 80GB", "FP16",
"Llama 3.3 70B"); a row that cannot be understood is listed with the reason, never guessed.
Each row's configuration is predicted with the same global constants (nothing fitted per row).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from llmopt.models.presets import PRESETS, get_preset
from llmopt.plan.hardware import get_cluster
from llmopt.plan.serve import Scenario, ServeInputError, estimate, parse_load
from llmopt.validate.cells import RowError
from llmopt.validate.stats import error_summary

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_RUNS = DATA_DIR / "serving.csv"
ONLINE_CALIBRATION = DATA_DIR / "calibration_serving_online.csv"
ONLINE_VALIDATION = DATA_DIR / "validation_serving_online.csv"
METRICS = ("output_tokens_per_s", "ttft_ms", "itl_ms")
REQUIRED = ("row_id", "model", "gpu", "tp", "precision", "input_len", "output_len", "load")
# published model names -> the preset with the same shapes
MODEL_ALIASES = {
    "llama-3.3-70b": "llama-3.1-70b",  # Llama 3.3 70B: Llama 3.1 70B's architecture
    "llama-7b": "llama-2-7b",
    "llama-70b": "llama-2-70b",
}
GPU_PATTERNS = (  # (regex on the lower-cased cell, cluster preset)
    (r"gb200|nvl72", "gb200-nvl72"),
    (r"b200", "dgx-b200"),
    (r"h200", "dgx-h200"),
    (r"h800", "dgx-h800"),
    (r"h100.*pcie", "h100-pcie"),
    (r"h100", "dgx-h100"),
    (r"a100.*40", "dgx-a100-40gb"),
    (r"a100", "dgx-a100-80gb"),
    (r"mi300x", "mi300x"),
)
PRECISION_WORDS = {
    "bf16": "bf16", "fp16": "bf16", "float16": "bf16", "bfloat16": "bf16", "fp8": "fp8",
    "int8": "int8", "w8a8": "int8", "int4-awq": "int4-awq", "awq": "int4-awq", "int4": "int4-awq",
}  # fmt: skip


def number(cell: str | None, name: str, integer: bool = False) -> float | None:
    """A number from free text ("28,312", "~36 ms", "1.2k"); None when blank."""
    text = (cell or "").strip().lower()
    if text in ("", "-", "n/a", "na", "not reported"):
        return None
    m = re.fullmatch(r"[~≈]?\s*([-+]?[0-9][0-9,]*(?:\.[0-9]+)?)\s*(k)?\s*[a-z/%]*", text)
    if not m:
        raise RowError(f"{name}={cell!r} is not a number")
    value = float(m[1].replace(",", "")) * (1000 if m[2] else 1)
    if not math.isfinite(value) or value <= 0:
        raise RowError(f"{name}={cell!r} must be positive")
    if integer and value != int(value):
        raise RowError(f"{name}={cell!r} must be a whole number")
    return value


def model_of(cell: str) -> str:
    key = re.sub(r"^.*/", "", cell.strip().lower())
    key = re.sub(r"[\s_]+", "-", key)
    key = re.sub(r"-(instruct|chat|hf|fp8|fp4|awq|int4|int8)\b", "", key)
    key = MODEL_ALIASES.get(key, key)
    if key not in PRESETS:
        raise RowError(f"model {cell!r} has no preset ({key!r} unknown)")
    return key


def gpu_of(cell: str) -> str:
    low = cell.strip().lower()
    for pattern, preset in GPU_PATTERNS:
        if re.search(pattern, low):
            return preset
    raise RowError(f"gpu {cell!r} is not a known GPU")


def length_of(cell: str | None, name: str) -> tuple[int | None, int]:
    """(lowest, highest) of a length cell: "1,024" is (None, 1024); "1-1024" draws uniformly."""
    text = (cell or "").strip()
    m = re.fullmatch(r"([0-9][0-9,]*)\s*[-–]\s*([0-9][0-9,]*)", text)
    if not m:
        return None, int(number(cell, name, integer=True))
    lo, hi = (int(g.replace(",", "")) for g in m.groups())
    if not 0 < lo <= hi:
        raise RowError(f"{name}={cell!r} must be a range lo-hi with 0 < lo <= hi")
    return lo, hi


def precision_of(cell: str, name: str) -> str:
    key = cell.strip().lower()
    if key not in PRECISION_WORDS:
        raise RowError(f"{name}={cell!r}; valid: {', '.join(PRECISION_WORDS)}")
    return PRECISION_WORDS[key]


def scenario_of(row: dict[str, str]) -> tuple[str, str, Scenario]:
    """(preset, cluster preset, Scenario) of one CSV row, or RowError naming the bad cell."""
    missing = [c for c in REQUIRED if not (row.get(c) or "").strip()]
    if missing:
        raise RowError(f"missing {', '.join(missing)}")
    tp = int(number(row["tp"], "tp", integer=True))
    ep = int(number(row.get("ep") or "1", "ep", integer=True))
    gpus = number(row.get("num_gpus"), "num_gpus", integer=True)
    precision = precision_of(row["precision"], "precision")
    kv = precision_of(row.get("kv_dtype") or "bf16", "kv_dtype")
    if kv not in ("bf16", "fp8"):
        raise RowError(f"kv_dtype={row['kv_dtype']!r}; valid: bf16, fp16, fp8")
    in_lo, in_hi = length_of(row["input_len"], "input_len")
    out_lo, out_hi = length_of(row["output_len"], "output_len")
    extra: dict = {}
    for col in ("num_requests", "multi_step", "max_num_tokens"):
        value = number(row.get(col), col, integer=True)
        if value is not None:
            extra[col] = int(value)
    for col in ("scheduler", "engine", "admission"):
        if (row.get(col) or "").strip():
            extra[col] = row[col].strip().lower()
    try:
        sc = Scenario(
            precision=precision, kv_dtype=kv, tp=tp, ep=ep,
            num_gpus=None if gpus is None else int(gpus),
            input_len=in_hi, output_len=out_hi, input_len_min=in_lo, output_len_min=out_lo,
            load=parse_load(row["load"]), **extra,
        )  # fmt: skip
    except ServeInputError as exc:
        raise RowError(str(exc)) from None
    return model_of(row["model"]), gpu_of(row["gpu"]), sc


def evaluate(
    rows: list[dict[str, str]], set_name: str = ""
) -> tuple[list[dict], list[tuple[str, str]]]:
    """Per-row predictions and errors, and the rows that could not be understood; `set_name`
    ("calibration", "validation" or "") is carried into every result."""
    results, bad = [], []
    for row in rows:
        rid = (row.get("row_id") or "?").strip()
        try:
            measured = {m: number(row.get(m), m) for m in METRICS}
            if all(v is None for v in measured.values()):
                raise RowError("no measured output_tokens_per_s, ttft_ms or itl_ms")
            model_name, gpu, sc = scenario_of(row)
            cluster = get_cluster(gpu, max(1, math.ceil(sc.replicas * sc.tp / 8)))
            est = estimate(get_preset(model_name), cluster, sc)
        except (RowError, ServeInputError) as exc:
            bad.append((rid, str(exc)))
            continue
        predicted = {
            "output_tokens_per_s": est.output_tokens_per_s,
            "ttft_ms": None if est.ttft_s is None else est.ttft_s * 1e3,
            "itl_ms": est.itl_s * 1e3,
        }
        for metric, value in measured.items():
            if value is None or predicted[metric] is None:
                continue
            results.append(
                {
                    "row_id": rid, "model": model_name, "gpu": gpu, "tp": sc.tp,
                    "precision": sc.precision, "kv_dtype": sc.kv_dtype,
                    "isl_osl": f"{_span(sc.input_len_min, sc.input_len)}/"
                    f"{_span(sc.output_len_min, sc.output_len)}", "load": str(sc.load),
                    "metric": metric, "measured": value, "predicted": predicted[metric],
                    "rel_err": predicted[metric] / value - 1, "bound": est.bound,
                    "batch": est.batch, "set": set_name,
                    "source_id": (row.get("source_id") or "").strip(),
                }
            )  # fmt: skip
    return results, bad


def _span(lo: int | None, hi: int) -> str:
    return str(hi) if lo is None else f"{lo}-{hi}"


def load_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with Path(path).open(newline="") as fh:
        return list(csv.DictReader(fh))


def summary(errs: list[float]) -> tuple[float, float]:
    """(median, p90) of |errors| (`llmopt.validate.stats.error_summary`)."""
    return error_summary(errs)


def _golden(f, lo: float, hi: float, iters: int) -> float:
    """Argmin of a unimodal f on [lo, hi] by golden-section search."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


FIT_BOUNDS = {"gpu_time_scale": (0.8, 2.5), "request_s": (0.0, 0.1), "eager_layer_s": (0.0, 5e-4)}


def fit_engine(
    rows: list[dict[str, str]], engine: str, passes: int = 4, iters: int = 14
) -> tuple[dict[str, float], float]:
    """Fit one engine's profile (`llmopt.plan.serve.engines.EngineProfile`: GPU-time scale,
    front-end time per request, launch time per layer of a prompt iteration) to the `rows`
    that name it in their
    `engine` column, minimising the sum of squared log errors over every measured metric;
    coordinate descent (golden section per field). Meant for calibration rows only.
    Returns (fields, loss)."""
    import dataclasses

    from llmopt.plan.serve import engines as step_mod

    subset = [r for r in rows if (r.get("engine") or "").strip().lower() == engine]
    if not subset:
        raise RowError(f"no row names engine {engine!r}")
    saved = step_mod.ENGINE_PROFILES.get(engine)
    fields = {k: getattr(step_mod.EngineProfile(), k) for k in FIT_BOUNDS}  # from the roofline

    def loss(values: dict[str, float]) -> float:
        base = saved or step_mod.EngineProfile()
        step_mod.ENGINE_PROFILES[engine] = dataclasses.replace(base, **values)
        results, bad = evaluate(subset)
        if bad:
            return math.inf
        return sum(math.log1p(r["rel_err"]) ** 2 for r in results)

    try:
        for _ in range(passes):
            for name, (lo, hi) in FIT_BOUNDS.items():
                fields[name] = _golden(lambda v, key=name: loss({**fields, key: v}), lo, hi, iters)
        best = loss(fields)
    finally:
        if saved is None:
            step_mod.ENGINE_PROFILES.pop(engine, None)
        else:
            step_mod.ENGINE_PROFILES[engine] = saved
    return fields, best
