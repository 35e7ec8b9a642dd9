"""Where fine-tuning examples come from: JSON-lines / JSON / text files, a directory of them,
or a HF `datasets` dataset already in the local cache (`hf:NAME` or `hf:NAME:SPLIT`).

Every source yields plain dict records; what a record means (text, prompt/completion, chat
messages) is decided by `llmopt.data.sft`. Nothing here reaches the network: `hf:` sources are
opened with HF_DATASETS_OFFLINE=1, so a dataset that is not cached is an error naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llmopt.config_files import read_text
from llmopt.errors import LlmoptError

SUFFIXES = (".jsonl", ".json", ".txt")


class SFTDataError(LlmoptError, ValueError):
    """Fine-tuning data that cannot be read or does not fit the requested format."""


def read_records(source: str) -> list[dict[str, Any]]:
    """The records of `source` (see the module doc), in file order."""
    return [record for _, record in read_located_records(source)]


def read_located_records(source: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) for each record of `source`: `FILE:LINE` of a .jsonl line, `FILE[i]`
    of a .json list entry, `hf:NAME[i]` of a dataset row, so an error can name it."""
    if source.startswith("hf:"):
        return [(f"{source}[{i}]", r) for i, r in enumerate(_hf_records(source[3:]))]
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise SFTDataError(f"{path} holds no {', '.join(SUFFIXES)} files")
        return [r for f in files for r in _file_records(f)]
    if not path.is_file():
        raise SFTDataError(
            f"--data {source!r} is not a file or directory (nor hf:NAME); "
            f"give a {', '.join(SUFFIXES)} file, a directory of them or hf:NAME"
        )
    return _file_records(path)


def _file_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    text = read_text(path, "fine-tuning data")
    if path.suffix == ".txt":
        return [(str(path), {"text": text})]
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(data, list):
            raise SFTDataError(
                f"{path} must hold a JSON list of objects, got {type(data).__name__}"
            )
        records = [(f"{path}[{i}]", record) for i, record in enumerate(data)]
    elif path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise SFTDataError(f"{path}:{number} is not valid JSON: {exc}") from None
    else:
        raise SFTDataError(f"{path}: unsupported suffix {path.suffix!r}; use {SUFFIXES}")
    for where, record in records:
        if not isinstance(record, dict):
            raise SFTDataError(
                f"{where}: the record is a {type(record).__name__}, not an object with "
                "'messages', 'prompt' + 'completion' or 'text'"
            )
    return records


def _hf_records(name: str) -> list[dict[str, Any]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when `datasets` is imported
    try:
        import datasets
    except ImportError:
        raise SFTDataError(
            f"--data hf:{name} needs the `datasets` package (pip install datasets)"
        ) from None
    dataset, _, split = name.partition(":")
    try:
        data = datasets.load_dataset(dataset, split=split or "train")
    except Exception as exc:  # datasets raises many types for "not cached / not found"
        raise SFTDataError(
            f"hf:{name} could not be opened offline from the local datasets cache: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    return [dict(row) for row in data]
