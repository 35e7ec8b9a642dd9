"""Where an export goes: refuse to overwrite the input, build aside, rename into place.

A directory export is filled in a hidden sibling directory and moved into the destination
only once every file is written, so a reader never sees half an export and a failed export
leaves the previous one intact; the user's own files in the destination are never replaced
without `--overwrite` and never deleted (`llmopt.output_dir`). Single files go through
`llmopt.artifacts`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from llmopt.artifacts import OutputPathError, atomic_write
from llmopt.errors import LlmoptError


class ExportError(LlmoptError, ValueError):
    """An export that cannot be written as asked (bad format option, output = input, ...)."""


def check_output(
    out: str | Path,
    source: str | Path | None,
    kind: str | None = None,
    overwrite: bool = False,
) -> Path:
    """`out` as a Path, before any work: refused when it is (inside) the input or the input
    lies inside it, and for a directory output of `kind`, when it holds what is not an earlier
    output of that kind and `overwrite` is not set (`llmopt.output_dir.check_output_dir`)."""
    out = Path(out).expanduser()
    src = Path(source).expanduser() if source is not None else None
    if src is not None and src.exists():
        src_r, out_r = src.resolve(), out.resolve()
        if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
            raise ExportError(
                f"output {out} would overwrite the input model {source}; choose another --out"
            )
    if kind is not None:
        from llmopt.output_dir import check_output_dir

        try:
            check_output_dir(out, kind, overwrite=overwrite)
        except OutputPathError as exc:
            raise ExportError(str(exc)) from exc
    return out


@contextmanager
def staged_directory(out: Path, kind: str, overwrite: bool = False) -> Iterator[Path]:
    """A temporary directory next to `out`; on success its files become `out` (the previous
    export intact until then; an `out` holding the user's files is refused unless `overwrite`,
    and then only the export's own files are replaced: `llmopt.output_dir`)."""
    from llmopt.output_dir import output_directory

    try:
        with output_directory(out, kind, overwrite=overwrite) as stage:
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
