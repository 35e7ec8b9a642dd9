"""Where an export goes: refuse to overwrite the input, build aside, rename into place.

A directory export is filled in a hidden sibling directory and moved over the destination
with `os.replace` only once every file is written, so a reader never sees half an export and a
failed export leaves the previous one intact. Single files go through `llmopt.artifacts`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class ExportError(ValueError):
    """An export that cannot be written as asked (bad format option, output = input, ...)."""


def check_output(out: str | Path, source: str | Path | None) -> Path:
    """`out` as a Path; refused when it is (inside) the input or the input lies inside it."""
    out = Path(out).expanduser()
    if source is None:
        return out
    src = Path(source).expanduser()
    if not src.exists():
        return out
    src_r, out_r = src.resolve(), out.resolve()
    if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
        raise ExportError(
            f"output {out} would overwrite the input model {source}; choose another --out"
        )
    return out


@contextmanager
def staged_directory(out: Path) -> Iterator[Path]:
    """A temporary directory next to `out`; on success it replaces `out` (an old one removed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a directory")
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        yield stage
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(stage, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def choice(value: str, valid: tuple[str, ...], what: str) -> str:
    """`value` if it is one of `valid`, else a one-line ExportError listing them."""
    if value not in valid:
        raise ExportError(f"{what}={value!r} is not supported; valid choices: {', '.join(valid)}")
    return value


def write_with(path: Path, write: Callable[[Path], object]) -> None:
    from llmopt.artifacts import atomic_write

    atomic_write(path, write)
