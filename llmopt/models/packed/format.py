"""What a model directory format declares to `load_model`: the marker file that identifies it
and the function that loads it (`llmopt.models.directory_formats` lists them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DirectoryFormat:
    kind: str  # what `resolve_spec` reports, e.g. "quant"
    marker: str  # a file whose presence identifies the format
    load: Callable  # called as load(path, dtype=..., device=...)
