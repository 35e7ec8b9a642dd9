"""The marker file of a compressed model directory (`llmopt_quant.json`, `llmopt_prune.json`):
one reader, so every format validates its marker the same way and names the file it refuses."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def read_marker(
    directory: str | Path,
    marker: str,
    format_name: str,
    version: int,
    required: tuple[str, ...],
    error: type[ValueError],
    what: str,
) -> dict[str, Any]:
    """The parsed marker of `directory`, checked for format, version and required keys.

    FileNotFoundError when the directory has no marker (it is not `what`); `error` for a
    marker that is not valid JSON, of another format or version, or missing a key."""
    path = Path(directory) / marker
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not {what} (no {marker})")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != format_name:
        raise error(f"{path} is not an {format_name} file")
    if meta.get("version") != version:
        raise error(
            f"{path} has format version {meta.get('version')!r}; this llmopt reads "
            f"version {version}"
        )
    for key in required:
        if key not in meta:
            raise error(f"{path} lacks the key {key!r}")
    return meta


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_weights(
    weights: Path, expected_sha256: str, marker: str, error: type[ValueError]
) -> None:
    """Refuse a weights file whose SHA-256 differs from the one its marker recorded."""
    if not weights.is_file():
        raise FileNotFoundError(f"{weights.parent} lacks {weights.name}")
    digest = sha256_file(weights)
    if digest != expected_sha256:
        raise error(
            f"{weights} is corrupted or was replaced: its SHA-256 {digest[:12]}... does not "
            f"match {expected_sha256[:12]}... recorded in {marker}"
        )
