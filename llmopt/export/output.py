"""Where an export goes: refuse to overwrite the input, build aside, rename into place.

A directory export is filled in a hidden sibling directory and moved over the destination
with `os.replace` only once every file is written, so a reader never sees half an export and a
failed export leaves the previous one intact. Single files go through `llmopt.artifacts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from llmopt.artifacts import OutputPathError, atomic_directory, atomic_write
from llmopt.errors import LlmoptError


class ExportError(LlmoptError, ValueError):
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
    """A temporary directory next to `out`; on success it replaces `out` whole (the previous
    export intact until then; `llmopt.artifacts.atomic_directory`)."""
    try:
        with atomic_directory(out) as stage:
            yield stage
    except OutputPathError as exc:
        raise ExportError(str(exc)) from exc


def choice(value: str, valid: tuple[str, ...], what: str) -> str:
    """`value` if it is one of `valid`, else a one-line ExportError listing them."""
    if value not in valid:
        raise ExportError(f"{what}={value!r} is not supported; valid choices: {', '.join(valid)}")
    return value


def write_with(path: Path, write: Callable[[Path], object]) -> None:
    atomic_write(path, write)
