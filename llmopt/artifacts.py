"""Atomic writes for every file llmopt produces (checkpoints, model directories, reports, plots).

A reader (a resuming job, a concurrent `load_model`, CI) must never see half a file: each
writer fills a temporary file in the destination directory, then `os.replace` moves it into
place, which is atomic on POSIX file systems. A failed write leaves no temporary behind.
`mkstemp` creates its file 0600; before the rename it gets the mode a plain `open` would have
given it (0666 minus the umask), so others can read what llmopt writes where the umask allows.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_UMASK_LOCK = threading.Lock()


def _current_umask() -> int:
    """The process umask (reading it means setting it; the lock keeps the swap private)."""
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> None:
    """Call `write(tmp_path)` for a temporary file next to `path`, then move it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, payload: Any, indent: int = 1) -> None:
    atomic_write_text(path, json.dumps(payload, indent=indent) + "\n")


def atomic_save_figure(fig: Any, path: str | Path, dpi: int = 110) -> None:
    """Save a matplotlib figure; the format comes from `path`'s suffix, not the temp name."""
    fmt = Path(path).suffix.lstrip(".") or "png"
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=fmt))
