"""Validate the training planner against published runs (`llmopt.validate.planner_runs`).

    python benchmarks/validate_planner.py                      # calibration and validation sets
    python benchmarks/validate_planner.py --set validation     # only the held-out rows
    python benchmarks/validate_planner.py --runs FILE.csv      # any CSV with the columns
    python benchmarks/validate_planner.py --mappings nemo      # published mappings vs #1

Prints a table per set and one summary line per set,
`<set> <kind>: median_abs_rel_err=<x> p90_abs_rel_err=<y> n=<rows>`; with --runs the last line
is `median_abs_rel_err=<x> p90_abs_rel_err=<y> n=<rows>`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmopt.artifacts import atomic_write_text
from llmopt.validate.planner_runs import SETS, evaluate_rows, load_rows, summary


def _table(title: str, results, failed) -> Table:
    table = Table(title=title)
    for col in ("row", "model", "GPUs", "mapping", "metric", "measured", "predicted", "err"):
        table.add_column(
            col, justify="right" if col in ("GPUs", "measured", "predicted", "err") else "left"
        )
    table.add_column("assumed", overflow="fold")
    for r in results:
        p = r.plan.parallel
        mapping = f"t{p.tp} p{p.pp} d{p.dp} c{p.cp} mb{p.micro_batch} v{p.virtual_stages} z{p.zero_stage} {p.recompute}"
        mapping += f" e{r.plan.ep}/{r.plan.expert_tp}" if r.plan.ep > 1 else ""
        table.add_row(r.row_id, r.model, str(r.gpus), mapping, r.metric, f"{r.measured:.4g}",
                      f"{r.predicted:.4g}", f"{r.rel_err:+.1%}", "; ".join(r.assumptions))  # fmt: skip
    for rid, why in failed:
        table.add_row(rid, "-", "-", "-", "-", "-", "-", "n/a", why)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--runs", default=None, help="a runs CSV (default: the calibration and validation sets)"
    )
    ap.add_argument("--set", choices=("calibration", "validation", "all"), default="all")
    ap.add_argument("--out", default="runs/validate_planner.json", help="JSON results path")
    ap.add_argument(
        "--mappings",
        default=None,
        metavar="FRAMEWORK",
        help="rank NeMo's published mappings under this framework's rules instead",
    )
    args = ap.parse_args(argv)
    if args.mappings is not None:
        return _mappings(args.mappings)
    if args.runs is not None:
        files = {("file", Path(args.runs).name): Path(args.runs)}
    else:
        files = {k: v for k, v in SETS.items() if args.set in ("all", k[0])}
    console = Console(width=200)
    payload, lines = {}, []
    for (name, kind), path in files.items():
        if not path.is_file():
            raise SystemExit(f"validate_planner: no runs CSV at {path}")
        try:
            rows = load_rows(path)
        except ValueError as exc:
            raise SystemExit(f"validate_planner: {exc}") from None
        results, failed = evaluate_rows(rows)
        console.print(
            _table(f"planner vs published runs: {name} {kind} ({path.name})", results, failed)
        )
        if not results:
            raise SystemExit(f"validate_planner: no row of {path} could be predicted")
        med, p90 = summary(results)
        stats = f"median_abs_rel_err={med:.4f} p90_abs_rel_err={p90:.4f} n={len(results)}"
        lines.append(stats if args.runs else f"{name} {kind}: {stats}")
        payload[f"{name}/{kind}"] = {"runs": str(path), "median_abs_rel_err": med,
                                     "p90_abs_rel_err": p90, "failed": failed,
                                     "rows": [r.to_dict() for r in results]}  # fmt: skip
    atomic_write_text(Path(args.out), json.dumps(payload, indent=1))
    for line in lines:
        print(line)
    return 0


def _mappings(framework: str) -> int:
    from llmopt.validate.mappings import check

    rows = check(framework)
    for r in rows:
        if r.valid:
            print(f"{r.label}: {r.spec} valid, best variant {r.published_s:.2f} s, rank #{r.rank}, "
                  f"{r.gap:+.1%} versus #1 {r.top} ({r.top_s:.2f} s)")  # fmt: skip
        else:
            print(f"{r.label}: {r.spec} INVALID under {framework}: {r.reason}")
    within = sum(1 for r in rows if r.valid and r.gap is not None and r.gap <= 0.05)
    print(f"valid={sum(r.valid for r in rows)}/{len(rows)} within_5pct={within}/{len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
