"""Model directory formats that other packages add to `load_model` (e.g. quantized ones).

A package registers its format (a marker file name and the dotted path of its loader) from its
own `__init__`; `llmopt.models.loading` then recognises such directories without importing, or
even knowing about, the package that writes them. Registration imports nothing (no torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DirectoryFormat:
    kind: str  # what `resolve_spec` reports, e.g. "quant"
    marker: str  # a file whose presence identifies the format
    loader: str  # "package.module:function", called as loader(path, dtype=..., device=...)

    def load_function(self) -> Callable:
        module, _, name = self.loader.partition(":")
        return getattr(importlib.import_module(module), name)


_FORMATS: dict[str, DirectoryFormat] = {}


def register_directory_format(kind: str, marker: str, loader: str) -> None:
    if ":" not in loader:
        raise ValueError(f"loader={loader!r} must be 'package.module:function'")
    existing = _FORMATS.get(kind)
    if existing is not None and existing != DirectoryFormat(kind, marker, loader):
        raise ValueError(f"directory format {kind!r} is already registered as {existing}")
    _FORMATS[kind] = DirectoryFormat(kind, marker, loader)


def directory_format(directory: Path) -> DirectoryFormat | None:
    """The registered format whose marker file `directory` holds, if any."""
    for fmt in _FORMATS.values():
        if (directory / fmt.marker).is_file():
            return fmt
    return None


def get_directory_format(kind: str) -> DirectoryFormat:
    return _FORMATS[kind]


def registered_markers() -> list[str]:
    return [fmt.marker for fmt in _FORMATS.values()]
