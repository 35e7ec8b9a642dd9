"""The full reliability sweep (issue 30): every case of `llmopt.validate.reliability.CASES`
through the real `llmopt` CLI, plus Ctrl-C and a closed pipe as real subprocesses.

    OMP_NUM_THREADS=1 python benchmarks/reliability_sweep.py [--out runs/reliability_sweep.json]
    PYTHONPATH=/path/to/other/checkout python benchmarks/reliability_sweep.py   # another tree

Prints the table by input class (clean, vague, traceback, silent, data lost, hang) and every
case that is not clean, and writes the JSON docs/reliability.md quotes. A correctness sweep,
not a timing one. Exit 1 unless: 0 data lost, 0 tracebacks, 0 silent, 0 hangs, <= 10 vague.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

MAX_VAGUE = 10


def main(argv: list[str] | None = None) -> int:
    from llmopt.artifacts import atomic_write_text
    from llmopt.validate.reliability import CASES, OUTCOMES, run_cases, table
    from llmopt.validate.reliability.sweep import probe_closed_pipe, probe_interrupt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", default="runs/reliability_sweep.json", help="JSON results")
    parser.add_argument("--no-models", action="store_true", help="skip cases that build a model")
    parser.add_argument("--no-subprocess", action="store_true", help="skip Ctrl-C and pipe runs")
    parser.add_argument("--case-limit", type=int, default=120, help="seconds before a case hangs")
    parser.add_argument("--kind", action="append", default=[], help="only this class (repeat)")
    parser.add_argument("--skip-kind", action="append", default=[], help="skip a class (repeat)")
    args = parser.parse_args(argv)
    chosen = [
        c
        for c in CASES
        if not (args.no_models and c.needs_model)
        and c.kind not in args.skip_kind
        and (not args.kind or c.kind in args.kind)
    ]
    t0 = time.perf_counter()
    results = run_cases(chosen, args.case_limit)
    if not args.no_subprocess:
        results += [probe_interrupt(), probe_closed_pipe()]
    rows = table(results)
    print(f"{'class':28} {'tried':>5} " + " ".join(f"{o:>9}" for o in OUTCOMES))
    for row in rows:
        print(f"{row['class']:28} {row['tried']:5d} " + " ".join(f"{row[o]:9d}" for o in OUTCOMES))
    for r in results:
        if r["outcome"] != "clean":
            print(f"  {r['outcome']}: {r['case']}: exit {r['exit']}: {r['stderr_last']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"seconds": round(time.perf_counter() - t0, 1), "table": rows, "cases": results}
    atomic_write_text(out, json.dumps(report, indent=1, allow_nan=False))
    print(f"wrote {out} ({report['seconds']} s)")
    total = rows[-1]
    bad = sum(total[o] for o in ("traceback", "silent", "data lost", "hang"))
    return 0 if bad == 0 and total["vague"] <= MAX_VAGUE else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
