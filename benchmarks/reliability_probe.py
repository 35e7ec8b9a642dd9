"""Run a fixed list of bad inputs through the real `llmopt` CLI and classify each outcome.

    python benchmarks/reliability_probe.py [--out runs/reliability_probe.json] [--no-models]

Each case (benchmarks/reliability_cases.py) runs in this process through `llmopt.cli.main`
with stderr captured; Ctrl-C and a closed stdout pipe run as real subprocesses. Outcomes:
  clean      the expected exit status, no traceback, one error line naming what the case lists
  vague      a one-line error that does not name the flag / file / key
  traceback  an exception escaped, or stderr holds a traceback
  silent     exit 0 (or another status) where a refusal was expected, or still running
             after --case-limit seconds (it did the work instead of refusing)
  data lost  a file that existed before the run was changed or removed
Prints a table by input class and writes the JSON the docs quote (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reliability_cases import CASES, Case  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("clean", "vague", "traceback", "silent", "data lost")


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def classify(case: Case, code: int | None, stderr: str, crashed: bool) -> str:
    """One outcome for a finished case (data loss is checked by the caller)."""
    if crashed or "Traceback (most recent call last)" in stderr:
        return "traceback"
    if code != case.expect:
        return "silent"
    errors = [line for line in stderr.splitlines() if "error:" in line]
    if len(errors) != 1 or not all(n.lower() in errors[0].lower() for n in case.names):
        return "vague"
    return "clean"


class RanOn(Exception):
    """A case still running after its time limit: it did the work instead of refusing."""


def _alarm(signum, frame):
    raise RanOn


def run_case(case: Case, scratch: Path, limit_s: int = 0) -> dict:
    """Build the case's files under `scratch`, run it in-process, classify the outcome;
    a case still running after `limit_s` seconds (0: no limit) is stopped and counts as silent."""
    from llmopt.cli import main

    cwd = Path.cwd()
    os.chdir(scratch)
    try:
        argv = case.build(scratch)
        before = _snapshot(scratch)
        err, out = io.StringIO(), io.StringIO()
        crashed, code = False, None
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            previous = signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(limit_s)
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's own refusals
                code = exc.code if isinstance(exc.code, int) else 1
            except RanOn:
                code = "ran on"
                err.write(f"still running after {limit_s} s\n")
            except BaseException as exc:  # noqa: BLE001 - an escaped exception is the finding
                crashed = True
                err.write(f"Traceback (most recent call last):\n{type(exc).__name__}: {exc}\n")
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
        after = _snapshot(scratch)
    finally:
        os.chdir(cwd)
    lost = [p for p, digest in before.items() if after.get(p) != digest]
    outcome = "data lost" if lost else classify(case, code, err.getvalue(), crashed)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    return {
        "case": case.name,
        "kind": case.kind,
        "argv": [a.replace(str(scratch), "$TMP") for a in argv],
        "exit": code,
        "outcome": outcome,
        "stderr_last": (lines[-1] if lines else "").replace(str(scratch), "$TMP"),
    }


def _llmopt(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmopt", *args]


def _env() -> dict[str, str]:
    # the llmopt under test: $PYTHONPATH when set (e.g. another checkout), else this one
    return {"PYTHONPATH": str(ROOT), **os.environ, "OMP_NUM_THREADS": "1"}


def probe_interrupt(timeout: float = 120.0) -> dict:
    """Ctrl-C while generating: exit 130, no traceback."""
    cmd = _llmopt("generate", "--prompt", "In the beginning", "--max-new-tokens", "4000", "--eager")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    proc.stdout.read(1)  # the first streamed token: the model is loaded and decoding
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=timeout)
    stderr = err.decode(errors="replace")
    traceback = "Traceback" in stderr
    outcome = "traceback" if traceback else ("clean" if proc.returncode == 130 else "silent")
    return {"case": "Ctrl-C during generate", "kind": "signals and pipes", "exit": proc.returncode,
            "outcome": outcome, "stderr_last": stderr.strip().splitlines()[-1:] or ""}  # fmt: skip


def probe_closed_pipe(timeout: float = 120.0) -> dict:
    """`llmopt plan --json | head -c 200`: the reader leaves early; exit 0, no traceback."""
    cmd = _llmopt("plan", "--json", "--top-k", "100")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    proc.stdout.read(200)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=timeout)
    stderr = err.decode(errors="replace")
    outcome = "traceback" if stderr.strip() else ("clean" if proc.returncode == 0 else "silent")
    return {"case": "plan --json | head -c 200", "kind": "signals and pipes",
            "exit": proc.returncode, "outcome": outcome, "stderr_last": stderr.strip()[-200:]}  # fmt: skip


def table(results: list[dict]) -> list[dict]:
    rows: dict[str, dict] = {}
    for r in results:
        row = rows.setdefault(
            r["kind"], {"class": r["kind"], "tried": 0, **dict.fromkeys(OUTCOMES, 0)}
        )
        row["tried"] += 1
        row[r["outcome"]] += 1
    total = {"class": "total", "tried": len(results)}
    total.update({o: sum(r[o] for r in rows.values()) for o in OUTCOMES})
    return [*rows.values(), total]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", default="runs/reliability_probe.json", help="JSON results")
    parser.add_argument("--no-models", action="store_true", help="skip cases that build a model")
    parser.add_argument("--no-subprocess", action="store_true", help="skip Ctrl-C and pipe runs")
    parser.add_argument(
        "--case-limit", type=int, default=60, help="seconds before a case counts as silent"
    )
    parser.add_argument("--skip-kind", action="append", default=[], help="skip a class (repeat)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    results = []
    for case in CASES:
        if (args.no_models and case.needs_model) or case.kind in args.skip_kind:
            continue
        with tempfile.TemporaryDirectory(prefix="llmopt-probe-") as tmp:
            results.append(run_case(case, Path(tmp), args.case_limit))
    if not args.no_subprocess:
        results += [probe_interrupt(), probe_closed_pipe()]
    rows = table(results)
    print(f"{'class':32} {'tried':>5} " + " ".join(f"{o:>9}" for o in OUTCOMES))
    for row in rows:
        print(f"{row['class']:32} {row['tried']:5d} " + " ".join(f"{row[o]:9d}" for o in OUTCOMES))
    for r in results:
        if r["outcome"] != "clean":
            print(f"  {r['outcome']}: {r['case']}: exit {r['exit']}: {r['stderr_last']}")
    from llmopt.artifacts import atomic_write_text

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"seconds": round(time.perf_counter() - t0, 1), "table": rows, "cases": results}
    atomic_write_text(out, json.dumps(report, indent=1, allow_nan=False))
    print(f"wrote {out} ({report['seconds']} s)")
    return 0 if rows[-1]["clean"] == rows[-1]["tried"] else 1


if __name__ == "__main__":
    sys.exit(main())
