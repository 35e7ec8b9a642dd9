"""The trade-off table: each optimization's accuracy, size, speed and memory against its baseline.

Two sources feed it:
- write-up tables: a column is classified by its header (memory, size, speed, accuracy
  keywords); the baseline is the row whose first cells name one (fp32, bf16, baseline, plain,
  reference, unquantized, none, off); each value is shown with its ratio to the baseline's.
  Columns that are already ratios (speedup, x) are shown as they are.
- llmopt result JSON grouped by directory: `eval gate|kl` gives accuracy against its reference
  (KL, perplexity ratio), `quantize` gives size against fp16, `profile` gives decode speed and
  peak memory (against the profile of the gate's reference model when one is present).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from llmopt.report.collect import Results

CATEGORIES = ("accuracy", "size", "speed", "memory")
# checked in this order: "peak MiB" is memory and "GB/s" is speed, not size
_KEYWORDS = [
    ("memory", ("memory", "peak", " mem", "mem ")),
    ("accuracy", ("ppl", "perplexity", "kl", "top-1", "top1", "accuracy", "acc", "loss", "exact")),
    ("speed", ("/s", "speedup", " ms", "(ms", "step", "throughput", "time", "s/it", "mfu", "tflop")),
    ("size", ("size", "mib", "gib", "mb", "gb", "bytes", "disk", "params")),
]  # fmt: skip
_BASELINE = re.compile(
    r"^(fp32|bf16|fp16|baseline|plain|reference|ref|unquantized|none|off|dense|transformers|ddp)\b",
    re.I,
)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", re.I)


@dataclass
class Cell:
    value: str
    ratio: float | None = None  # value / baseline value

    def render(self) -> str:
        if self.ratio is None:
            return self.value
        return f"{self.value} ({self.ratio:.2f}x)"


@dataclass
class TradeoffRow:
    source: str
    variant: str
    baseline: str
    cells: dict[str, Cell] = field(default_factory=dict)


def classify(header: str) -> str | None:
    """The category a column header belongs to, or None."""
    h = f" {header.lower().replace('*', '').strip()} "
    for category, words in _KEYWORDS:
        if any(w in h for w in words):
            return category
    return None


def number(cell: str) -> float | None:
    """The first number in a table cell (`**9.77**`, `1.23x`, `12 MiB`), or None."""
    match = _NUMBER.search(cell.replace(",", ""))
    return float(match.group(0)) if match else None


def _numeric(cell: str) -> bool:
    """A cell that is only a number (with `**`, `x`, `%` decorations): a value, not a label."""
    words = cell.replace("**", "").replace(",", "").split()
    return all(_NUMBER.fullmatch(w.rstrip("x%")) or w in ("-", "—") for w in words)


def _is_ratio(header: str, cells: list[str]) -> bool:
    return "speedup" in header.lower() or all(c.strip().endswith("x") for c in cells if c.strip())


def table_rows(source: str, header: list[str], rows: list[list[str]]) -> list[TradeoffRow]:
    """Trade-off rows of one write-up table (none if no column is a known metric)."""
    columns: dict[str, int] = {}
    for i, name in enumerate(header[1:], start=1):
        category = classify(name)
        if category is not None and category not in columns:
            columns[category] = i
    if not columns or not rows:
        return []
    label_cols = [
        i
        for i in range(len(header))
        if i not in columns.values()
        and (i == 0 or not all(_numeric(r[i]) for r in rows if i < len(r)))
    ][:2]

    def label(row: list[str]) -> str:
        return " ".join(row[i] for i in label_cols if i < len(row)).replace("**", "")

    base = next((r for r in rows if r and _BASELINE.match(r[0].replace("*", "").strip())), None)
    out = []
    for row in rows:
        cells = {}
        for category, i in columns.items():
            if i >= len(row):
                continue
            value = row[i].replace("**", "")
            ratio = None
            column = [r[i] for r in rows if i < len(r)]
            if base is not None and row is not base and not _is_ratio(header[i], column):
                mine, ref = number(row[i]), number(base[i]) if i < len(base) else None
                if mine is not None and ref:
                    ratio = mine / ref
            cells[category] = Cell(f"{header[i]}: {value}", ratio)
        out.append(TradeoffRow(source, label(row), label(base) if base else "", cells))
    return out


def _bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def json_rows(results: Results) -> list[TradeoffRow]:
    """One row per directory holding llmopt result JSON."""
    by_dir: dict[Path, dict[str, dict]] = {}
    for kind, items in results.json_results.items():
        for path, data in items:
            by_dir.setdefault(path.parent, {})[kind] = data
    profiles = {d["profile"].get("model"): d["profile"] for d in by_dir.values() if "profile" in d}
    rows = []
    for directory, kinds in sorted(by_dir.items()):
        cells: dict[str, Cell] = {}
        variant, baseline = str(directory), ""
        acc = kinds.get("gate", {}).get("kl") or kinds.get("kl")
        meta = kinds.get("gate") or kinds.get("kl") or {}
        if acc:
            baseline = str(meta.get("ref", "reference"))
            variant = str(meta.get("model", variant))
            cells["accuracy"] = Cell(
                f"KL {acc['mean']:.4f}, ppl {acc['ppl']:.3f} vs {acc['ref_ppl']:.3f}, "
                f"top-1 {100 * acc['top1_agreement']:.1f}%",
                acc["ppl"] / acc["ref_ppl"],
            )
            if "gate" in kinds:
                cells["accuracy"].value += " — gates " + (
                    "passed" if kinds["gate"]["passed"] else "FAILED"
                )
        if "quantize" in kinds:
            q = kinds["quantize"]
            size = q["quant_linear_bytes"] + q["other_bytes"]
            fp16 = q["quant_linear_fp16_bytes"] + q["other_bytes"]
            variant = f"{q.get('method', '?')} W{q.get('bits', '?')} g{q.get('group_size', '?')}"
            cells["size"] = Cell(f"{_bytes(size)} vs fp16 {_bytes(fp16)}", size / fp16)
            baseline = baseline or "fp16"
        if "profile" in kinds:
            p = kinds["profile"]
            ref = profiles.get(meta.get("ref")) if meta else None
            ref = ref if ref is not p else None
            step = p["decode"]["unprofiled_wall_ms_per_step"]
            peak = p["memory"]["peak_bytes"]
            cells["speed"] = Cell(
                f"decode {step:.2f} ms/step",
                step / ref["decode"]["unprofiled_wall_ms_per_step"] if ref else None,
            )
            cells["memory"] = Cell(
                f"peak {_bytes(peak)}", peak / ref["memory"]["peak_bytes"] if ref else None
            )
            variant = variant if acc or "quantize" in kinds else str(p.get("model", variant))
        rows.append(TradeoffRow(str(directory), variant, baseline, cells))
    return rows


def tradeoff_rows(results: Results) -> list[TradeoffRow]:
    rows = json_rows(results)
    for writeup in results.writeups:
        heading = writeup.title
        for block in writeup.blocks:
            if block.kind == "heading":
                heading = block.text
            elif block.kind == "table":
                rows += table_rows(f"{writeup.path} — {heading}", block.header, block.rows)
    return rows
