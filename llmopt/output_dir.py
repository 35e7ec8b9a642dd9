"""Output directories: every command that writes a directory (export, quantize, prune, merge,
distill, compress, train) claims and fills it the same way, so a user's files are never lost.

The rules, checked before any work starts (`check_output_dir`) and again when the output is
published (`output_directory`):
- a new, missing or empty `--out` is simply used;
- an `--out` that holds an earlier output of the same kind (its record `llmopt_output.json`
  says so, or the format's own marker of an older llmopt, e.g. `llmopt_quant.json`) is
  replaced: the earlier output's files go, the new ones come;
- anything else (a directory with the user's files, another kind of output) is refused,
  naming it and offering `--overwrite`;
- with `--overwrite`, only the files this command writes are replaced (and those an earlier
  llmopt output recorded); every other file in the directory stays as it was.

A staged output is built in a hidden sibling (`llmopt.artifacts`), so a failed or interrupted
run leaves `--out` as it was. When the directory holds nothing but the earlier output, the new
one is swapped in whole (one atomic exchange); otherwise each file the command wrote is renamed
into place (each rename atomic), the earlier output's leftovers are deleted and the record is
written last. The record lists the top-level entries the output consists of; it is what makes a
later run recognise the directory as its own.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from llmopt.artifacts import (
    OutputPathError,
    _current_umask,
    _owner_tag,
    atomic_write_json,
    clean_stale,
    replace_directory,
)

RECORD = "llmopt_output.json"
RECORD_FORMAT = "llmopt-output"
RECORD_VERSION = 1
# the marker files that identify an output of that kind written before records existed
LEGACY_MARKERS = {"quantize:llmopt": "llmopt_quant.json", "prune": "llmopt_prune.json"}


@dataclass(frozen=True)
class Claim:
    """What `--out` holds now: `ours` were written by an earlier llmopt output (replaced),
    `foreign` by someone else (kept); `same_kind` when that output was of this kind."""

    out: Path
    kind: str
    ours: frozenset[str] = frozenset()
    foreign: frozenset[str] = frozenset()
    same_kind: bool = False


def read_record(out: Path) -> dict | None:
    """The record of an earlier llmopt output in `out`, or None (absent or unreadable: then
    nothing in the directory counts as ours)."""
    path = out / RECORD
    if not path.is_file() or path.is_symlink():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
        return None
    files = data.get("files")
    if not isinstance(files, list) or not all(_plain_name(f) for f in files):
        return None
    return data


def _plain_name(name: object) -> bool:
    """A top-level entry name (no path separators, not . or ..): records never reach outside."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name


def check_output_dir(
    out: str | Path, kind: str, *, overwrite: bool = False, flag: str = "--out"
) -> Claim:
    """Refuse `out` unless it is new, empty, an earlier output of `kind`, or `overwrite` is
    set; what it holds. `kind` names the command and layout (`export:hf`, `quantize:gptq`);
    outputs of the same command in another layout count as another kind."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{flag} {out} is a file, not a directory; choose a directory")
    if not out.is_dir():
        return Claim(out, kind)
    entries = {p.name for p in out.iterdir()}
    if not entries:
        return Claim(out, kind)
    record = read_record(out)
    legacy = LEGACY_MARKERS.get(kind)
    if record is not None:
        ours = frozenset(set(record["files"]) & entries | {RECORD})
        same = record.get("kind") == kind
        earlier = f"an earlier `{_describe(record.get('kind'))}` output"
    elif legacy is not None and legacy in entries:
        ours, same, earlier = frozenset({legacy}), True, "an earlier output"
    else:
        ours, same, earlier = frozenset(), False, ""
    foreign = frozenset(entries - ours)
    claim = Claim(out, kind, ours, foreign, same)
    if same or overwrite:
        return claim
    shown = ", ".join(sorted(foreign)[:3]) + (", ..." if len(foreign) > 3 else "")
    if earlier:
        what = f"holds {earlier}, not a `{_describe(kind)}` one"
    else:
        what = f"holds files llmopt did not write ({shown})"
    raise OutputPathError(
        f"{flag} {out} exists and {what}; choose a new or empty directory, or pass --overwrite "
        f"to replace only the files `{_describe(kind)}` writes (the others are kept)"
    )


def _describe(kind: object) -> str:
    """`export:hf` -> `llmopt export --format hf` (how a user would have run it)."""
    if not isinstance(kind, str):
        return "llmopt"
    command, _, layout = kind.partition(":")
    return f"llmopt {command}" + (f" --format {layout}" if layout else "")


@contextmanager
def output_directory(
    out: str | Path, kind: str, *, overwrite: bool = False, flag: str = "--out"
) -> Iterator[Path]:
    """A hidden staging directory to fill; when the block succeeds its entries become `out`
    (see the module doc), with a record of them. Until then `out` is untouched; an error or
    interrupt removes the staging directory (a killed writer's is swept by the next one)."""
    out = Path(out).expanduser()
    check_output_dir(out, kind, overwrite=overwrite, flag=flag)
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out)
    staging = Path(
        tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.{_owner_tag()}.", suffix=".tmp")
    )
    try:
        os.chmod(staging, 0o777 & ~_current_umask())  # mkdtemp's 0700 is for staging only
        yield staging
        claim = check_output_dir(out, kind, overwrite=overwrite, flag=flag)  # changed since?
        publish(staging, claim)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, claim: Claim) -> None:
    """Move the finished `staging` entries to `claim.out` and record them."""
    out = claim.out
    files = sorted(p.name for p in staging.iterdir() if p.name != RECORD)
    write_record(staging, claim.kind, files)
    if not out.exists() or (out.is_dir() and not out.is_symlink() and not claim.foreign):
        replace_directory(staging, out)  # nothing of anyone else's there: swap whole
        return
    for name in files:  # the user's files are there: replace ours one by one
        _replace_entry(staging / name, out / name)
    for name in claim.ours - set(files) - {RECORD}:  # an earlier output's leftovers
        _remove(out / name)
    os.replace(staging / RECORD, out / RECORD)  # last: the output is complete


def write_record(directory: Path, kind: str, files: list[str]) -> None:
    payload = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "kind": kind, "files": files}
    atomic_write_json(directory / RECORD, payload, indent=1)


def record_in_place(out: str | Path, kind: str, files: list[str]) -> None:
    """For outputs written in place (a recipe's stages, a run directory): record `files`
    (top-level names in `out`) together with those an earlier record of `kind` listed."""
    out = Path(out)
    earlier = read_record(out)
    known = set(earlier["files"]) if earlier and earlier.get("kind") == kind else set()
    present = sorted(n for n in known | set(files) if (out / n).exists() and _plain_name(n))
    write_record(out, kind, present)


def _replace_entry(new: Path, old: Path) -> None:
    if old.is_dir() and not old.is_symlink() and new.is_dir():
        replace_directory(new, old)
        return
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    os.replace(new, old)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
