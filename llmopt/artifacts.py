"""Atomic writes for every file llmopt produces (checkpoints, model directories, reports, plots).

A reader (a resuming job, a concurrent `load_model`, CI) must never see half a file: each
writer fills a temporary file in the destination directory, then `os.replace` moves it into
place, which is atomic on POSIX file systems. A failed write leaves no temporary behind; one a killed writer left (its name carries host and pid)
is swept by the next write of the same path.
`mkstemp` creates its file 0600; before the rename it gets the mode a plain `open` would have
given it (0666 minus the umask), so others can read what llmopt writes where the umask allows.

Whole directories (a quantized or pruned model, an export) are built in a temporary sibling
and swapped into place by `replace_directory` (`llmopt.output_dir` decides what an output
directory may replace): the previous directory stays intact until the new one is complete.
`check_distinct` refuses an output that is, contains or lies in the input.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError

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
    clean_stale(path)
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.{_owner_tag()}.", suffix=".tmp"
    )
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


# ---- whole directories (quantize, prune, export, distill outputs) ----


class OutputPathError(LlmoptError, ValueError):
    """An output path that would overwrite, contain or sit inside the input, or hold other data."""


def check_distinct(out: str | Path, source: str | Path | None, flag: str = "--out") -> Path:
    """`out` as a Path, refused when it is the input, lies inside it, or contains it: writing
    there would overwrite (or, on a directory replace, delete) the input."""
    out = Path(out).expanduser()
    if source is None or not Path(source).expanduser().exists():
        return out
    src_r, out_r = Path(source).expanduser().resolve(), out.resolve()
    if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
        relation = "is" if out_r == src_r else "is inside" if src_r in out_r.parents else "contains"
        raise OutputPathError(
            f"{flag} {out} {relation} the input {source}; choose a directory outside the input"
        )
    return out


def _owner_tag() -> str:
    """host-pid of this process, embedded in temporary names so only dead owners' are swept."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def _dead_owner(name: str) -> bool:
    """Whether a temporary `.<dest>.<host>-<pid>.<random>.<tmp|old>` belongs to a dead process
    of this host (others' hosts and live processes are left alone)."""
    match = _TAG.search(name)
    if match is None or match["host"] != socket.gethostname().split(".")[0]:
        return False
    try:
        os.kill(int(match["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


_TAG = re.compile(r"\.(?P<host>[^.]+)-(?P<pid>\d+)\.[^.]*\.(?:tmp|old)$")


def clean_stale(path: str | Path) -> list[Path]:
    """Remove temporaries of `path` that a killed writer left beside it; when a replace was cut
    between its two renames (`path` missing, the old copy aside), the old copy is put back.
    Returns what was removed."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    removed = []
    for leftover in sorted(path.parent.glob(f".{glob.escape(path.name)}.*")):
        if not _dead_owner(leftover.name):
            continue
        if leftover.name.endswith(".old") and not path.exists():
            os.replace(leftover, path)
            continue
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
        removed.append(leftover)
    return removed


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    status = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return status == 0


def replace_directory(staging: Path, out: Path) -> None:
    """Put the finished `staging` directory at `out`. An old `out` is swapped out in one atomic
    exchange where the kernel and file system allow it, else moved aside under a name
    `clean_stale` restores if the process dies between the two renames; then it is deleted."""
    if not out.exists():
        os.replace(staging, out)
        return
    if _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)  # now the old directory
        return
    aside = out.with_name(f".{out.name}.{_owner_tag()}.{os.urandom(3).hex()}.old")
    os.replace(out, aside)
    os.replace(staging, out)
    shutil.rmtree(aside, ignore_errors=True)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks (checkpoints, markers, token caches)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
