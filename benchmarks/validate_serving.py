"""Validate the serving planner (`llmopt plan serve`) against published serving measurements
(`llmopt.validate.serving_runs`; data: llmopt/validate/data/serving.csv).

    python benchmarks/validate_serving.py [--runs FILE.csv] [--out runs/validate_serving.json]

The last line is `median_abs_rel_err=<x> p90_abs_rel_err=<y> n=<rows>` over output tokens/s of
the `--runs` file (serving.csv); TTFT and ITL errors (all rows, and the online rows: finite
request rate or concurrency) are summarised on the lines before it. The finite-request-rate
rows (calibration_serving_online.csv, validation_serving_online.csv; `--no-online` leaves them
out) are printed and summarised per set: the held-out line is the one to read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llmopt.artifacts import atomic_write_text
from llmopt.validate.serving_runs import (
    DEFAULT_RUNS,
    METRICS,
    ONLINE_CALIBRATION,
    ONLINE_VALIDATION,
    evaluate,
    fit_engine,
    load_rows,
    summary,
)


def main(argv: list[str] | None = None) -> int:
    import csv

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(DEFAULT_RUNS))
    ap.add_argument("--out", default=None, help="also write the per-row table as JSON")
    ap.add_argument("--no-online", action="store_true", help="skip the finite-rate row sets")
    ap.add_argument(
        "--fit-engines",
        action="store_true",
        help="fit each engine profile on the calibration finite-rate rows and print it",
    )
    args = ap.parse_args(argv)
    if args.fit_engines:
        cal = load_rows(ONLINE_CALIBRATION)
        for engine in sorted({(r.get("engine") or "").strip().lower() for r in cal} - {""}):
            fields, loss = fit_engine(cal, engine)
            text = " ".join(f"{k}={v:.4g}" for k, v in fields.items())
            print(f"engine {engine}: {text} (sum of squared log errors {loss:.4f})")
        return 0
    path = Path(args.runs)
    if not path.is_file():
        print(f"validate_serving: error: no runs file at {path}", file=sys.stderr)
        return 2
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    results, bad = evaluate(rows)
    online_sets = []
    if not args.no_online:
        for name, file in (("calibration", ONLINE_CALIBRATION), ("validation", ONLINE_VALIDATION)):
            res, miss = evaluate(load_rows(file), name)
            online_sets.append((name, res))
            bad += miss
    print(
        f"{'row':>4} {'model':<15} {'gpu':<14} {'tp':>2} {'prec':<8} {'kv':<4} {'ISL/OSL':<11} "
        f"{'load':<14} {'metric':<20} {'measured':>10} {'predicted':>10} {'err':>7}  bound"
    )
    for r in results + [r for _, res in online_sets for r in res]:
        print(
            f"{r['row_id']:>4} {r['model']:<15} {r['gpu']:<14} {r['tp']:>2} {r['precision']:<8} "
            f"{r['kv_dtype']:<4} {r['isl_osl']:<11} {r['load']:<14} {r['metric']:<20} "
            f"{r['measured']:>10,.1f} {r['predicted']:>10,.1f} {r['rel_err']:>+7.1%}  {r['bound']}"
        )
    for rid, reason in bad:
        print(f"row {rid}: not understood: {reason}")
    by = {m: [r["rel_err"] for r in results if r["metric"] == m] for m in METRICS}
    online = {
        m: [r["rel_err"] for r in results if r["metric"] == m and r["load"] != "offline"]
        for m in METRICS
    }
    others = []
    for m in ("ttft_ms", "itl_ms"):
        med, p90 = summary(by[m])
        others.append(f"{m}: median_abs_rel_err={med:.3f} p90_abs_rel_err={p90:.3f} n={len(by[m])}")
    print("; ".join(others) + f"; rows not understood: {len(bad)}")
    online_line = []
    for m in METRICS:
        med, p90 = summary(online[m])
        online_line.append(f"{m} median={med:.3f} p90={p90:.3f} n={len(online[m])}")
    print("online rows: " + "; ".join(online_line))
    for name, res in online_sets:
        parts = []
        for m in METRICS:
            errs = [r["rel_err"] for r in res if r["metric"] == m and r["load"].startswith("rate")]
            med, p90 = summary(errs)
            parts.append(f"{m} median={med:.3f} p90={p90:.3f} n={len(errs)}")
        label = "held-out" if name == "validation" else name
        print(f"finite-rate {label} rows: " + "; ".join(parts))
    if args.out:
        atomic_write_text(
            Path(args.out),
            json.dumps(
                {
                    "rows": results,
                    "online": {n: res for n, res in online_sets},
                    "not_understood": bad,
                },
                indent=1,
            ),
        )
    med, p90 = summary(by["output_tokens_per_s"])
    print(
        f"median_abs_rel_err={med:.3f} p90_abs_rel_err={p90:.3f} n={len(by['output_tokens_per_s'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
