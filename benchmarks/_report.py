"""What every benchmark script prints and writes: run metadata, a right-aligned table, the JSON
report and figures (written aside and moved into place by `llmopt.artifacts`)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from llmopt.artifacts import atomic_save_figure, atomic_write_json


def run_info() -> dict[str, Any]:
    """Date, software and machine: the context a recorded figure needs."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def add_threads_argument(parser: argparse.ArgumentParser, default: int | None = None) -> None:
    parser.add_argument(
        "--threads", type=int, default=default, help="torch threads (default: torch's)"
    )


def apply_threads(parser: argparse.ArgumentParser, threads: int | None) -> None:
    """Set torch's thread count from --threads (None: leave torch's default)."""
    if threads is None:
        return
    if threads < 1:
        parser.error(f"--threads={threads} must be >= 1")
    torch.set_num_threads(threads)


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> Table:
    """A rich table of already formatted cells, every column right-aligned (cells wrap in a
    narrow console rather than being cut)."""
    out = Table(title=title)
    for col in columns:
        out.add_column(col, justify="right")
    for row in rows:
        out.add_row(*row)
    return out


def write_report(console: Console, path: Path | str, payload: Any, echo: bool = False) -> None:
    """Write the JSON report atomically, say where, and with `echo` print it to stdout."""
    atomic_write_json(path, payload)
    console.print(f"wrote {path}")
    if echo:
        print(json.dumps(payload, indent=1))


def save_figure(fig: Any, path: Path | str, dpi: int = 110) -> None:
    """Save a matplotlib figure atomically and free it."""
    import matplotlib.pyplot as plt

    atomic_save_figure(fig, path, dpi=dpi)
    plt.close(fig)
