"""Exporters: one evaluated plan written as a config another framework (or llmopt's own
trainer) runs. One module per framework; each refuses, with a one-line `EmitError`, what its
framework cannot express. `write` builds every file aside and renames it into place.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from llmopt.artifacts import atomic_write_text
from llmopt.plan.emit.base import EmitError, Emitted, PlannedRun

FORMATS = ("llmopt", "megatron", "nemo", "torchtitan", "deepspeed")

__all__ = ["FORMATS", "EmitError", "Emitted", "PlannedRun", "check", "emit", "format_for", "write"]


def format_for(path: str | Path, fmt: str | None = None) -> str:
    """The explicit format, else a framework named in the file name ("x.megatron.sh"), else
    llmopt's run config for a .toml or .json file."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise EmitError(
                f"--emit-format={fmt!r} is not valid; choose one of {', '.join(FORMATS)}"
            )
        return fmt
    path = Path(path)
    parts = path.name.lower().split(".")
    named = [f for f in FORMATS if f in parts[1:-1] or f in parts[0].split("-")]
    if named:
        return named[0]
    if path.suffix in (".toml", ".json"):
        return "llmopt"
    raise EmitError(
        f"cannot tell which framework {path.name} is for: name it like x.megatron.sh, "
        "x.nemo.sh, x.torchtitan.toml, x.deepspeed.json, or pass --emit-format"
    )


def _module(fmt: str) -> ModuleType:
    if fmt not in FORMATS:
        raise EmitError(f"format {fmt!r} is not valid; choose one of {', '.join(FORMATS)}")
    name = "runconfig" if fmt == "llmopt" else fmt
    return importlib.import_module(f"llmopt.plan.emit.{name}")


def check(run: PlannedRun, fmt: str) -> None:
    """Raise EmitError when `fmt` cannot express the run."""
    _module(fmt).check(run)


def emit(run: PlannedRun, fmt: str, path: str | Path = "run.toml") -> Emitted:
    """The document(s) for one format; `path` picks TOML vs JSON for llmopt's run config and
    is the config path the DeepSpeed launcher line names."""
    module = _module(fmt)
    if fmt == "llmopt":
        return module.emit(run, as_json=Path(path).suffix == ".json")
    if fmt == "deepspeed":
        return module.emit(run, config_path=Path(path).name)
    return module.emit(run)


def side_path(path: Path, suffix: str) -> Path:
    """Where a side file goes: `ds.json` + ".launch.sh" -> `ds.launch.sh`."""
    return path.with_name(path.stem + suffix)


def write(run: PlannedRun, path: str | Path, fmt: str | None = None) -> list[Path]:
    """Write the plan in `fmt` (see `format_for`) to `path` (and its side files); every file is
    complete before it appears. Returns the paths written."""
    path = Path(path)
    out = emit(run, format_for(path, fmt), path)
    written = [path]
    atomic_write_text(path, out.text)
    for suffix, text in out.side_files.items():
        side = side_path(path, suffix)
        atomic_write_text(side, text)
        written.append(side)
    return written
