"""Typed readers for the files users hand us (TOML/JSON configs, HF `config.json`,
`tokenizer_config.json`, safetensors index, compression markers, checkpoint manifests).

One layer, so every bad file gets the same kind of one-line error: the file, the key, the bad
value and what was expected. Bools are not integers; NaN and infinity are not numbers; unknown
keys are refused in files we write (`unknown="refuse"`) and kept in files other tools write.
This module imports only `llmopt.errors`, so any reader can use it without an import cycle.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# expected-type names: what a schema value may be, and how the error message says it
INT, FLOAT, STR, BOOL, LIST, TABLE, NONE = "int", "float", "str", "bool", "list", "table", "none"
INT_LIST, STR_LIST = "int-list", "str-list"
_NAMES = {
    INT: "an integer",
    FLOAT: "a finite number",
    STR: "a string",
    BOOL: "true or false",
    LIST: "a list",
    TABLE: "a table (object)",
    NONE: "null",
    INT_LIST: "a list of integers",
    STR_LIST: "a list of strings",
}
MIN_FREE_BYTES = 1 << 20  # an output check refuses a disk with less free space
Schema = Mapping[str, str | tuple[str, ...]]


class ConfigFileError(LlmoptError, ValueError):
    """A user file that is unreadable, malformed or holds a wrongly typed value."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _matches(value: Any, kind: str) -> bool:
    if kind == INT:
        return _is_int(value)
    if kind == FLOAT:
        return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if kind == STR:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == LIST:
        return isinstance(value, list)
    if kind == TABLE:
        return isinstance(value, dict)
    if kind == NONE:
        return value is None
    if kind == INT_LIST:
        return isinstance(value, list) and all(_is_int(v) for v in value)
    if kind == STR_LIST:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    raise KeyError(f"unknown schema type {kind!r}")


def expected_name(kinds: str | tuple[str, ...]) -> str:
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    return " or ".join(_NAMES[k] for k in kinds)


def check_value(
    where: str,
    key: str,
    value: Any,
    kinds: str | tuple[str, ...],
    error: type[ValueError] = ConfigFileError,
) -> None:
    """Refuse `value` unless it is one of `kinds`, naming where, the key and the value."""
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    if not any(_matches(value, k) for k in kinds):
        raise error(
            f"{where}: {key} = {_show(value)} must be {expected_name(kinds)}"
            f" (got {_type_name(value)})"
        )


def check_fields(
    where: str,
    data: Mapping[str, Any],
    schema: Schema,
    *,
    required: tuple[str, ...] = (),
    unknown: str = "refuse",
    error: type[ValueError] = ConfigFileError,
) -> None:
    """Check every key of `data` that `schema` knows; `unknown="refuse"` refuses the others."""
    for key in required:
        if key not in data:
            raise error(f"{where}: missing required key {key!r}")
    if unknown == "refuse":
        extra = sorted(set(data) - set(schema))
        if extra:
            raise error(
                f"{where}: unknown key{'s' if len(extra) > 1 else ''} {', '.join(extra)}; "
                f"valid keys: {', '.join(sorted(schema))}"
            )
    for key, kinds in schema.items():
        if key in data:
            check_value(where, key, data[key], kinds, error)


_HINTS = {
    int: INT,
    float: FLOAT,
    str: STR,
    bool: BOOL,
    type(None): NONE,
    list: LIST,
    tuple: LIST,
    dict: TABLE,
}


def dataclass_schema(cls: type) -> dict[str, tuple[str, ...]]:
    """The schema of a dataclass's fields from its type hints (`int | None` -> INT or NONE;
    `Literal[...]` -> STR: the dataclass checks the choice itself)."""
    schema: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        parts = typing.get_args(hint) if _is_union(hint) else (hint,)
        kinds = []
        for part in parts:
            origin = typing.get_origin(part) or part
            kinds.append(STR if origin is typing.Literal else _HINTS.get(origin, TABLE))
        schema[f.name] = tuple(dict.fromkeys(kinds))
    return schema


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, float) and not math.isfinite(value):
        return "a non-finite number"
    return {int: "an integer", float: "a number", str: "a string", list: "a list"}.get(
        type(value), "a table" if isinstance(value, dict) else type(value).__name__
    )


def read_text(path: str | Path, what: str) -> str:
    """A UTF-8 file's text; a missing, unreadable or non-UTF-8 file is one error naming it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if path.is_dir():
        raise ConfigFileError(f"{what} {path} is a directory, not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(
            f"{path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})"
        ) from None
    except OSError as exc:
        raise ConfigFileError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def read_json(path: str | Path, what: str, *, top: str = TABLE) -> Any:
    """A JSON file (NaN/Infinity refused), whose top level must be `top` (a table by default)."""
    path = Path(path)
    text = read_text(path, what)
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:  # JSONDecodeError is a ValueError, as is a refused constant
        raise ConfigFileError(f"{path} is not valid JSON: {exc}") from None
    if top and not _matches(data, top):
        raise ConfigFileError(
            f"{path}: the top level must be {expected_name(top)}, got {_type_name(data)}"
        )
    return data


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    path = Path(path)
    text = read_text(path, what)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path} is not valid TOML: {exc}") from None
    _refuse_nonfinite(path, data, "")
    return data


def _refuse_nonfinite(path: Path, data: Any, prefix: str) -> None:
    """TOML allows `nan` and `inf`; no config of ours means them."""
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for key, value in items:
        name = f"{prefix}{key}" if isinstance(data, dict) else f"{prefix[:-1]}[{key}]"
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigFileError(f"{path}: {name} = {value!r} must be a finite number")
        if isinstance(value, (dict, list)):
            _refuse_nonfinite(path, value, f"{name}.")


def read_config(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML or JSON config file by suffix (.json is JSON, anything else TOML)."""
    path = Path(path)
    return read_json(path, what) if path.suffix == ".json" else read_toml(path, what)


def inside(directory: Path, name: Any, where: str, key: str) -> Path:
    """`directory / name`, refused unless `name` is a relative path staying inside it."""
    check_value(where, key, name, STR)
    candidate = Path(name)
    resolved = (directory / candidate).resolve()
    if candidate.is_absolute() or not resolved.is_relative_to(directory.resolve()):
        raise ConfigFileError(f"{where}: {key} = {name!r} points outside {directory}")
    return directory / candidate


def check_output(path: str | Path, flag: str, kind: str = "dir") -> None:
    """Before any work: refuse an output whose parent cannot take it (missing parents are
    fine where they can be created), a directory output that is a file, or the reverse."""
    path = Path(path)
    if kind not in ("dir", "file"):
        raise ValueError(f"kind={kind!r}: choose 'dir' or 'file'")
    if path.exists():
        if kind == "dir" and not path.is_dir():
            raise ConfigFileError(f"{flag} {path} is a file; it must be a directory")
        if kind == "file" and path.is_dir():
            raise ConfigFileError(f"{flag} {path} is a directory; it must be a file path")
    parent = path.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigFileError(f"{flag} {path}: {parent} is a file, not a directory")
    target = path if kind == "dir" and path.is_dir() else parent
    try:  # a real write: os.access says yes to root on a read-only mount
        handle, probe = tempfile.mkstemp(prefix=".llmopt-probe-", dir=target)
    except OSError as exc:
        raise ConfigFileError(
            f"{flag} {path}: cannot write in {target} ({exc.strerror or exc})"
        ) from None
    os.close(handle)
    os.unlink(probe)
    free = shutil.disk_usage(target).free
    if free < MIN_FREE_BYTES:
        raise ConfigFileError(f"{flag} {path}: {target} has only {free} bytes free")


# a training checkpoint's manifest.json (versioned by its writer: unknown keys are kept)
CHECKPOINT_MANIFEST = {
    "step": INT,
    "layout": TABLE,
    "world_size": INT,
    "files": STR_LIST,
    "time": STR,
    "config": TABLE,
}


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """A checkpoint's manifest, typed; every file it lists must lie inside the checkpoint."""
    directory = Path(directory)
    path = directory / "manifest.json"
    data = read_json(path, "checkpoint manifest")
    check_fields(str(path), data, CHECKPOINT_MANIFEST, required=("step", "layout"), unknown="keep")
    for i, name in enumerate(data.get("files", [])):
        inside(directory, name, str(path), f"files[{i}]")
    return data


def read_pointer(root: str | Path, name: str) -> Path:
    """The entry of `root` that the pointer file `root/name` names (e.g. a checkpoint's
    `latest`), refused if the pointer is empty or leads outside `root`."""
    root = Path(root)
    pointer = root / name
    target = read_text(pointer, "pointer file").strip()
    if not target:
        raise ConfigFileError(f"{pointer} is empty; it should name an entry of {root}")
    return inside(root, target, str(pointer), "target")
