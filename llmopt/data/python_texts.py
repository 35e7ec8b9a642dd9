"""Real English text that every Python installation ships: documentation, docstrings, comments.

Written by people for people, offline and reproducible for a pinned environment, and of
kinds the Bible lacks (technical prose, API documentation, terse code comments, Markdown).
Each builder returns one whitespace-normalised string in a fixed (sorted) file order.

Calibration corpora (standard library): `py-docs` (the language reference and library
topics of `pydoc_data.topics`), `stdlib-docs` (module, class and function docstrings of the
top-level standard-library modules), `stdlib-comments` (their `#` comments).
Evaluation-only corpora (third-party, never in a calibration mix): `torch-docs` (docstrings
of `torch.nn`, `torch.optim` and `torch.distributions`), `pkg-readmes` (the long
descriptions of a fixed list of installed distributions).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import io
import sysconfig
import tokenize
from collections.abc import Callable, Iterable
from pathlib import Path

# distributions pinned by the project's environment; the order fixes the text
README_DISTRIBUTIONS = (
    "numpy",
    "pandas",
    "matplotlib",
    "networkx",
    "nltk",
    "click",
    "jinja2",
    "rich",
    "hypothesis",
    "pydantic",
    "httpx",
    "attrs",
    "pygments",
    "datasets",
    "accelerate",
    "pytest",
)
TORCH_DOC_PACKAGES = ("nn/modules", "optim", "distributions")
_MIN_COMMENT_WORDS = 3
_README_CHARS = 20_000  # the start of each description: the prose, not a long changelog


def _normalise(parts: Iterable[str]) -> str:
    return " ".join(" ".join(p.split()) for p in parts if p and not p.isspace())


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if not p.name.startswith(("_", "test")))


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for n in ast.walk(tree) if isinstance(n, kinds) if (d := ast.get_docstring(n))]


def _comments(path: Path) -> list[str]:
    try:
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
        found = [t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT]
    except (SyntaxError, UnicodeDecodeError, tokenize.TokenError):
        return []
    skip = ("!", "-*-", "noqa", "type:", "pragma", "fmt:", "XXX")
    return [c for c in found if len(c.split()) >= _MIN_COMMENT_WORDS and not c.startswith(skip)]


def py_docs() -> str:
    from pydoc_data.topics import topics

    return _normalise(topics[k] for k in sorted(topics))


def stdlib_docs() -> str:
    return _normalise(d for p in _stdlib_files() for d in _docstrings(p))


def stdlib_comments() -> str:
    return _normalise(c for p in _stdlib_files() for c in _comments(p))


def torch_docs() -> str:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise LookupError("corpus torch-docs needs torch installed")
    root = Path(spec.origin).parent
    files = sorted(f for sub in TORCH_DOC_PACKAGES for f in (root / sub).glob("*.py"))
    return _normalise(d for f in files for d in _docstrings(f))


def pkg_readmes() -> str:
    parts = []
    for name in README_DISTRIBUTIONS:
        try:
            meta = importlib.metadata.metadata(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        parts.append((meta.get_payload() or meta.get("Description") or "")[:_README_CHARS])
    return _normalise(parts)


BUILDERS: dict[str, Callable[[], str]] = {
    "py-docs": py_docs,
    "stdlib-docs": stdlib_docs,
    "stdlib-comments": stdlib_comments,
    "torch-docs": torch_docs,
    "pkg-readmes": pkg_readmes,
}
