"""The subset of Markdown that llmopt's benchmark write-ups use, parsed into blocks.

`docs/benchmarks/*.md` hold the recorded results (tables), the commands that produced them
(fenced code) and the machine they ran on (a `Machine:` paragraph). The report needs those as
data, not as rendered text, so this parser returns typed blocks: headings, paragraphs, bullet
lists, fenced code, pipe tables and images. Anything else is kept as a paragraph.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_BULLET = re.compile(r"^\s*[-*]\s+(.*)$")
_RULE = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")


@dataclass
class Block:
    kind: str  # heading | paragraph | bullets | code | table | image
    text: str = ""
    level: int = 0  # heading level
    lang: str = ""  # code fence language
    items: list[str] = field(default_factory=list)  # bullets
    header: list[str] = field(default_factory=list)  # table
    rows: list[list[str]] = field(default_factory=list)  # table
    src: str = ""  # image


def _cells(line: str) -> list[str]:
    line = line.strip()
    if line.startswith("|"):
        line = line[1:]
    if line.endswith("|") and not line.endswith("\\|"):
        line = line[:-1]
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)]


def parse(text: str) -> list[Block]:
    """Blocks of a Markdown document, in order."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            i += 1
            continue
        if stripped.startswith("```"):
            lang = stripped[3:].strip()
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append(Block("code", text="\n".join(body), lang=lang))
            i += 1
            continue
        heading = _HEADING.match(stripped)
        if heading:
            blocks.append(Block("heading", text=heading.group(2), level=len(heading.group(1))))
            i += 1
            continue
        if stripped.startswith("|") and i + 1 < len(lines) and _RULE.match(lines[i + 1].strip()):
            header = _cells(stripped)
            rows = []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            blocks.append(Block("table", header=header, rows=rows))
            continue
        image = _IMAGE.fullmatch(stripped)
        if image:
            blocks.append(Block("image", text=image.group(1), src=image.group(2)))
            i += 1
            continue
        if _BULLET.match(line):
            items: list[str] = []
            while i < len(lines) and lines[i].strip():
                bullet = _BULLET.match(lines[i])
                if bullet:
                    items.append(bullet.group(1))
                elif items:
                    items[-1] += " " + lines[i].strip()
                i += 1
            blocks.append(Block("bullets", items=items))
            continue
        para = []
        while i < len(lines) and lines[i].strip() and not _starts_block(lines, i):
            para.append(lines[i].strip())
            i += 1
        blocks.append(Block("paragraph", text=" ".join(para)))
    return blocks


def _starts_block(lines: list[str], i: int) -> bool:
    s = lines[i].strip()
    if s.startswith("```") or _HEADING.match(s) or _IMAGE.fullmatch(s) or _BULLET.match(lines[i]):
        return True
    return s.startswith("|") and i + 1 < len(lines) and bool(_RULE.match(lines[i + 1].strip()))


def images_in(text: str) -> list[str]:
    """Image targets referenced inline in a text."""
    return [m.group(2) for m in _IMAGE.finditer(text)]
