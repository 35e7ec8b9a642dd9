"""Run bad-input cases through the real `llmopt` CLI and classify each outcome.

Each case (`cases.CASES`) builds its files in a scratch directory and runs in this process
through `llmopt.cli.main` with stdout/stderr captured; Ctrl-C and a closed stdout pipe run as
real subprocesses. Outcomes:
  clean      the expected exit status, no traceback, one error line naming what the case lists
  vague      a one-line error that does not name the flag / file / key
  traceback  an exception escaped, or stderr holds a traceback
  silent     another exit status than expected (e.g. 0 where a refusal was expected)
  data lost  a file that existed before the run was changed or removed
  hang       still running after the case's time limit (stopped by SIGALRM)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from llmopt.validate.reliability.cases import CASES, Case

OUTCOMES = ("clean", "vague", "traceback", "silent", "data lost", "hang")
ROOT = Path(__file__).resolve().parents[3]


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def classify(case: Case, code: int | str | None, stderr: str, crashed: bool) -> str:
    """One outcome for a finished case (data loss is checked by the caller)."""
    if code == "hang":
        return "hang"
    if crashed or "Traceback (most recent call last)" in stderr:
        return "traceback"
    if code != case.expect:
        return "silent"
    if case.expect == 0:
        return "clean"
    errors = [line for line in stderr.splitlines() if "error:" in line]
    if len(errors) != 1 or not all(n.lower() in errors[0].lower() for n in case.names):
        return "vague"
    return "clean"


class _Hang(Exception):
    """A case still running after its time limit."""


def _alarm(signum, frame):
    raise _Hang


def run_case(case: Case, scratch: Path, limit_s: int = 0) -> dict:
    """Build the case's files under `scratch`, run it in-process, classify the outcome; a case
    still running after `limit_s` seconds (0: no limit) is stopped and counts as a hang."""
    from llmopt.cli import main

    cwd = Path.cwd()
    os.chdir(scratch)
    try:
        noise = io.StringIO()  # what building a model or a run prints is not the case's
        with contextlib.redirect_stdout(noise), contextlib.redirect_stderr(noise):
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
            except _Hang:
                code = "hang"
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
    kept = set(case.changes)
    lost = [
        p for p, digest in before.items() if after.get(p) != digest and Path(p).name not in kept
    ]
    outcome = "data lost" if lost else classify(case, code, err.getvalue(), crashed)
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    return {
        "case": case.name,
        "kind": case.kind,
        "argv": [a.replace(str(scratch), "$TMP") for a in argv],
        "exit": code,
        "outcome": outcome,
        "stderr_last": (lines[-1] if lines else "").replace(str(scratch), "$TMP"),
        "lost": [p.replace(str(scratch), "$TMP") for p in lost],
    }


def run_cases(cases: list[Case], limit_s: int = 60) -> list[dict]:
    """Each case in a fresh scratch directory."""
    results = []
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="llmopt-sweep-") as tmp:
            results.append(run_case(case, Path(tmp), limit_s))
    return results


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
    outcome = (
        "traceback" if "Traceback" in stderr else ("clean" if proc.returncode == 130 else "silent")
    )
    return {"case": "Ctrl-C during generate", "kind": "signals and pipes", "exit": proc.returncode,
            "outcome": outcome, "stderr_last": (stderr.strip().splitlines() or [""])[-1]}  # fmt: skip


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
    """One row per input class (in catalogue order) and a total."""
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


def sample(cases: list[Case] = CASES, every: int = 3) -> list[Case]:
    """CI's quick tier: every `every`-th local case that builds no model, plus each such case
    issue 30 named (`named`), fixed so a failure reproduces."""
    quick = [c for c in cases if c.local and not c.needs_model]
    return [c for i, c in enumerate(quick) if i % every == 0 or c.named]
