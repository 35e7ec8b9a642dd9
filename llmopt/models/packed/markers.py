"""The marker file of a compressed model directory (`llmopt_quant.json`, `llmopt_prune.json`):
one reader, so every format validates its marker the same way and names the file it refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmopt.artifacts import sha256_file
from llmopt.config_files import (
    INT,
    STR,
    TABLE,
    ConfigFileError,
    check_fields,
    check_value,
    read_json,
)

# the keys the quant and prune markers share or hold (both are versioned formats: a newer
# writer may add keys, so unknown ones are kept; a known key of the wrong type is refused)
MARKER_FIELDS = {
    "format": STR,
    "version": INT,
    "model_config": TABLE,
    "quant_config": TABLE,
    "prune_config": TABLE,
    "modules": TABLE,
    "weights_file": STR,
    "weights_sha256": STR,
    "float_dtype": STR,
    "report": TABLE,
    "pruned_linear_bytes": INT,
    "pruned_linear_fp16_bytes": INT,
}


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
        meta = read_json(path, "marker", top="")
    except ConfigFileError as exc:
        raise error(str(exc)) from None
    if not isinstance(meta, dict):
        raise error(f"{path} is not an {format_name} file: its top level is not an object")
    if meta.get("format") != format_name:
        raise error(
            f"{path} is not an {format_name} file: format = {meta.get('format')!r}, "
            f"expected {format_name!r}"
        )
    if meta.get("version") != version or isinstance(meta.get("version"), bool):
        raise error(
            f"{path} has format version {meta.get('version')!r}; this llmopt reads "
            f"version {version}"
        )
    try:
        check_fields(str(path), meta, MARKER_FIELDS, required=required, unknown="keep")
        for name, entry in meta.get("modules", {}).items():
            check_value(str(path), f"modules[{name!r}]", entry, TABLE)
    except ConfigFileError as exc:
        raise error(str(exc)) from None
    return meta


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
