"""Find the optimization results in a directory: write-ups, plots and result JSON files.

Sources, searched recursively:
- Markdown write-ups (`docs/benchmarks/*.md`): sections with their tables, commands (fenced
  shell code), machine description (the paragraph starting `Machine`) and referenced plots;
- PNG/SVG plots, whether a write-up references them or not;
- JSON results that llmopt commands write: `llmopt profile` (ops.json), `llmopt eval gate|kl
  --json`, `llmopt quantize --json`; other JSON files are listed by name only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError
from llmopt.report.markdown import Block, images_in, parse

IMAGE_SUFFIXES = (".png", ".svg")
MAX_JSON_BYTES = 16 * 2**20
SKIP_DIRS = {".git", "__pycache__", ".venv", "node_modules", ".pytest_cache", ".ruff_cache"}


class ReportSourceError(LlmoptError, ValueError):
    """A report directory that does not exist or holds no results."""


@dataclass
class Writeup:
    path: Path  # relative to the report root
    title: str
    blocks: list[Block]
    machine: list[str]
    commands: list[str]
    image_map: dict[str, Path]  # reference as written -> existing file (may lie beside the root)
    missing_images: list[str]

    @property
    def images(self) -> list[Path]:
        return list(self.image_map.values())


@dataclass
class Results:
    root: Path
    writeups: list[Writeup] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)  # every plot found (relative)
    json_results: dict[str, list[tuple[Path, dict[str, Any]]]] = field(default_factory=dict)
    other_json: list[Path] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)  # (file, why): listed, skipped


def _files(root: Path) -> list[Path]:
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts):
            continue
        if path.is_file():
            out.append(path)
    return out


def json_kind(data: Any) -> str | None:
    """Which llmopt result a JSON object is (None: not one we know)."""
    if not isinstance(data, dict):
        return None
    if {"decode", "prefill", "peaks"} <= data.keys():
        return "profile"
    if isinstance(data.get("kl"), dict) and "gates" in data:
        return "gate"
    if {"mean", "top1_agreement", "ppl", "ref_ppl"} <= data.keys():
        return "kl"
    if {"quant_linear_bytes", "quant_linear_fp16_bytes", "other_bytes"} <= data.keys():
        return "quantize"
    return None


def _writeup(root: Path, path: Path) -> Writeup:
    blocks = parse(path.read_text(encoding="utf-8"))
    title = next((b.text for b in blocks if b.kind == "heading"), path.stem)
    machine = [b.text for b in blocks if b.kind == "paragraph" and b.text.startswith("Machine")]
    commands = [
        b.text
        for b in blocks
        if b.kind == "code" and b.lang in ("", "bash", "sh", "shell", "console")
    ]
    refs = [b.src for b in blocks if b.kind == "image"]
    for b in blocks:
        for text in [b.text, *b.items, *(c for row in b.rows for c in row)]:
            refs += images_in(text) if b.kind != "image" else []
    images: dict[str, Path] = {}
    missing: list[str] = []
    for ref in dict.fromkeys(refs):
        if "://" in ref or ref.startswith("data:"):
            missing.append(ref)  # remote images would not load offline: reported, not linked
            continue
        target = (path.parent / ref).resolve()
        if target.is_file() and target.suffix.lower() in IMAGE_SUFFIXES:
            images[ref] = target
        else:
            missing.append(ref)
    return Writeup(path.relative_to(root), title, blocks, machine, commands, images, missing)


def collect(root: str | Path) -> Results:
    """Everything report-worthy under `root`."""
    root = Path(root)
    if not root.is_dir():
        raise ReportSourceError(f"report source {root} is not a directory")
    results = Results(root)
    for path in _files(root):
        rel = path.relative_to(root)
        if path.suffix == ".md":
            results.writeups.append(_writeup(root, path))
        elif path.suffix.lower() in IMAGE_SUFFIXES:
            results.images.append(rel)
        elif path.suffix == ".json":
            if path.stat().st_size > MAX_JSON_BYTES:  # traces, not results
                results.other_json.append(rel)
                continue
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                # a run still writing its output must not sink the whole report
                results.unreadable.append((rel, f"not valid JSON: {exc}"))
                continue
            kind = json_kind(data)
            if kind is None:
                results.other_json.append(rel)
            else:
                results.json_results.setdefault(kind, []).append((rel, data))
    if not results.writeups and not results.json_results and not results.images:
        raise ReportSourceError(
            f"no results under {root}: expected Markdown write-ups, plots (.png/.svg) or llmopt "
            "result JSON (profile ops.json, eval gate/kl --json, quantize --json)"
        )
    return results
