"""Rebuild docs/benchmarks.md from the per-area sections in docs/benchmarks/*.md.

Each area keeps its recorded results in its own file (so parallel work never edits one file);
this joins them in a fixed order under one title and rewrites image links,
which are relative to docs/benchmarks/, to be relative to docs/.
"""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ORDER = [
    "decode",
    "serving",
    "planner",
    "engine",
    "pipeline",
    "quant",
    "prune",
    "distill",
    "export",
    "speculative",
    "fp8",
    "finetune",
]
HEADER = """# Benchmarks and validation results

Every figure comes from a script in `benchmarks/` (the command is given with each table), run
on the machine and date stated in its section. Sections are edited in `docs/benchmarks/*.md`;
this file is rebuilt from them with `python docs/build_benchmarks.py`.

Unless a section says otherwise the machine is a 2-core CPU VM (AMD EPYC, AVX-512, 24 GiB, no
GPU), torch 2.13.0+cpu, 2026-11-29, shared with other jobs during most runs: read ratios
measured inside one run, not absolute times. No GPU figures exist yet
(`benchmarks/fp8_gpu.py` is ready for an H100/H200).

"""


def _section(name: str) -> str:
    text = (DOCS / "benchmarks" / f"{name}.md").read_text(encoding="utf-8").strip()
    if not text.startswith("## "):
        raise ValueError(f"docs/benchmarks/{name}.md must start with a level-2 heading")

    def relink(match: re.Match[str]) -> str:
        target = match.group(2)
        if "://" in target or target.startswith("/"):
            return match.group(0)
        fixed = target[3:] if target.startswith("../") else f"benchmarks/{target}"
        return f"{match.group(1)}({fixed})"

    return re.sub(r"(!\[[^\]]*\])\(([^)]+)\)", relink, text)


def build() -> str:
    return HEADER + "\n\n".join(_section(name) for name in ORDER) + "\n"


if __name__ == "__main__":
    (DOCS / "benchmarks.md").write_text(build(), encoding="utf-8")
    print(f"wrote {DOCS / 'benchmarks.md'}")
