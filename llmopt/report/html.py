"""Render collected results as one self-contained HTML page (plots inlined as data URIs).

Self-contained so the page can be attached to a PR or a release and opened anywhere, offline:
no external CSS, fonts, scripts or image files. All text from the sources is HTML-escaped.
"""

from __future__ import annotations

import base64
import html
import platform
import re
from datetime import datetime, timezone
from pathlib import Path

from llmopt.errors import UsageError
from llmopt.report.collect import Results, Writeup
from llmopt.report.markdown import Block
from llmopt.report.tradeoff import CATEGORIES, TradeoffRow, tradeoff_rows

_MIME = {".png": "image/png", ".svg": "image/svg+xml"}
_CSS = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:1200px;color:#222;padding:0 1rem}
h1{border-bottom:2px solid #345}h2{margin-top:2.5rem;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:1rem 0;font-size:.85rem}
td,th{border:1px solid #ccc;padding:.25rem .5rem;vertical-align:top}th{background:#eef2f6}
tr:nth-child(even) td{background:#fafafa}pre{background:#f4f4f4;padding:.6rem;overflow-x:auto}
code{background:#f4f4f4;padding:0 .2rem}img{max-width:100%;border:1px solid #ddd;margin:.5rem 0}
.machine{background:#fff8e1;padding:.5rem;border-left:4px solid #f0b400}
.meta{color:#666;font-size:.85rem}figure{margin:1rem 0}figcaption{font-size:.8rem;color:#555}
"""
_INLINE = [
    (re.compile(r"`([^`]+)`"), r"<code>\1</code>"),
    (re.compile(r"\*\*([^*]+)\*\*"), r"<b>\1</b>"),
    (re.compile(r"(?<!\*)\*([^*\s][^*]*)\*(?!\*)"), r"<i>\1</i>"),
]
_LINKED_IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")


def data_uri(path: Path) -> str:
    mime = _MIME.get(path.suffix.lower())
    if mime is None:
        raise UsageError(f"{path}: only {', '.join(_MIME)} images can be inlined")
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def inline(text: str) -> str:
    """Escaped text with Markdown code/bold/italic spans (inline image syntax dropped)."""
    out = html.escape(_LINKED_IMAGE.sub("", text))
    for pattern, repl in _INLINE:
        out = pattern.sub(repl, out)
    return out


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{inline(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(path: Path, caption: str) -> str:
    return (
        f'<figure><img src="{data_uri(path)}" alt="{html.escape(caption)}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def _block(block: Block, writeup: Writeup) -> str:
    if block.kind == "heading":
        level = min(block.level + 1, 6)
        return f"<h{level}>{inline(block.text)}</h{level}>"
    if block.kind == "paragraph":
        css = ' class="machine"' if block.text.startswith("Machine") else ""
        return f"<p{css}>{inline(block.text)}</p>"
    if block.kind == "bullets":
        return "<ul>" + "".join(f"<li>{inline(i)}</li>" for i in block.items) + "</ul>"
    if block.kind == "code":
        return f"<pre><code>{html.escape(block.text)}</code></pre>"
    if block.kind == "table":
        return _table(block.header, block.rows)
    if block.kind == "image":
        match = writeup.image_map.get(block.src)
        if match is None:
            return f"<p><i>missing image {html.escape(block.src)}</i></p>"
        return _figure(match, block.text or match.name)
    return ""


def _tradeoff(rows: list[TradeoffRow]) -> str:
    if not rows:
        return "<p>No table or result JSON with accuracy, size, speed or memory figures found.</p>"
    header = ["source", "variant", "baseline", *CATEGORIES]
    body = [
        [
            r.source,
            r.variant,
            r.baseline,
            *(r.cells[c].render() if c in r.cells else "" for c in CATEGORIES),
        ]
        for r in rows
    ]
    return (
        "<p>Ratios in parentheses are value / baseline value (rows with no recognised baseline "
        "show values only; speedup columns are already ratios).</p>" + _table(header, body)
    )


def render(results: Results, title: str = "llmopt optimization report") -> str:
    """The whole page as a string."""
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">Generated {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} from '
        f"<code>{html.escape(str(results.root))}</code> on {html.escape(platform.node())} "
        f"({html.escape(platform.platform())}, Python {platform.python_version()}).</p>",
        "<h2>Trade-offs</h2>",
        _tradeoff(tradeoff_rows(results)),
        "<h2>Machines and commands</h2>",
    ]
    for w in results.writeups:
        machine = (
            "".join(f'<p class="machine">{inline(m)}</p>' for m in w.machine)
            or "<p>(not stated)</p>"
        )
        commands = "".join(f"<pre><code>{html.escape(c)}</code></pre>" for c in w.commands)
        parts.append(
            f"<h3>{inline(w.title)} <small>({html.escape(str(w.path))})</small></h3>{machine}{commands}"
        )
    shown: set[Path] = set()
    for w in results.writeups:
        parts.append(f'<h2 id="{html.escape(str(w.path))}">{inline(w.title)}</h2>')
        first = next((b for b in w.blocks if b.kind == "heading"), None)
        parts += [_block(b, w) for b in w.blocks if b is not first]
        shown |= set(w.images)
        if w.missing_images:
            parts.append(
                f"<p><i>images not found: {html.escape(', '.join(w.missing_images))}</i></p>"
            )
    others = [p for p in results.images if (results.root / p).resolve() not in shown]
    if others:
        parts.append("<h2>Other plots</h2>")
        parts += [_figure(results.root / p, str(p)) for p in others]
    if results.other_json:
        names = ", ".join(f"<code>{html.escape(str(p))}</code>" for p in results.other_json)
        parts.append(f"<h2>Other result files</h2><p>{names}</p>")
    if results.unreadable:
        items = "".join(
            f"<li><code>{html.escape(str(p))}</code>: {html.escape(why)}</li>"
            for p, why in results.unreadable
        )
        parts.append(f"<h2>Unreadable files (skipped)</h2><ul>{items}</ul>")
    body = "\n".join(parts)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}'
        f"</title><style>{_CSS}</style></head><body>\n{body}\n</body></html>\n"
    )
