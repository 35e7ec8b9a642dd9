"""Wall time of `llmopt plan serve` (issue 12: the default scenario answers in < 1 s).

    python benchmarks/serve_planner_speed.py --out runs/serve_planner_speed.json

Cases run in-process through the CLI entry point (`llmopt.cli.main`, argument parsing, model
and GPU lookup, estimate or search, rendering), timed `--repeats` times after one warm-up;
the median is reported against its target. A cold `python -m llmopt plan serve` subprocess
(interpreter start and imports included) is timed once for information; it has no target
because it measures the interpreter and the machine's load as much as the planner.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llmopt.artifacts import atomic_write_json
from llmopt.cli import main as cli_main

CASES = [  # name, argv after `llmopt plan serve`, target seconds
    ("default: Llama-3.1-8B, 1 H100, c=32", [], 1.0),
    ("default --json", ["--json"], 1.0),
    ("70B fp8 on 8 H100, rate 5 req/s", ["--model", "llama-3.1-70b", "--tp", "8",
                                         "--precision", "fp8", "--request-rate", "5"], 1.0),
    ("search: 70B on 8 H100, ITL <= 30 ms", ["--model", "llama-3.1-70b", "--num-gpus", "8",
                                             "--max-itl-ms", "30", "--concurrency", "64"], 1.0),
    ("search: 405B fp8 on 16 H200, TTFT <= 2 s", ["--model", "llama-3.1-405b", "--gpu", "h200",
                                                  "--num-gpus", "16", "--precision", "fp8",
                                                  "--max-ttft-ms", "2000"], 1.0),
]  # fmt: skip


def run_case(argv: list[str]) -> float:
    sink = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(sink):
        rc = cli_main(["plan", "serve", *argv])
    elapsed = time.perf_counter() - start
    if rc not in (0, 1):
        raise SystemExit(f"llmopt plan serve {' '.join(argv)} failed with exit code {rc}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="runs/serve_planner_speed.json")
    args = ap.parse_args(argv)
    if args.repeats <= 0:
        raise SystemExit(f"--repeats={args.repeats} must be positive")
    rows, ok = [], True
    print(f"{'case':<44} {'median s':>9} {'target':>9}  result")
    for name, case_argv, target in CASES:
        run_case(case_argv)  # warm-up: imports, preset tables
        times = [run_case(case_argv) for _ in range(args.repeats)]
        med = statistics.median(times)
        passed = med < target
        ok &= passed
        print(f"{name:<44} {med:>9.4f} {'< ' + format(target, 'g') + ' s':>9}  "
              f"{'ok' if passed else 'MISSED'}")  # fmt: skip
        rows.append({"case": name, "argv": case_argv, "seconds_median": med,
                     "seconds_all": times, "target_s": target})  # fmt: skip
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "llmopt", "plan", "serve"], check=True, capture_output=True
    )
    cold = time.perf_counter() - start
    print(f"{'cold subprocess `python -m llmopt plan serve`':<44} {cold:>9.4f} {'-':>9}  info")
    atomic_write_json(Path(args.out), {"cases": rows, "cold_subprocess_s": cold})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
