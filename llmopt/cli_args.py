"""Checks of parsed command-line values, run before a command does any work.

argparse only checks that `--threads 0` is an int; these refuse what the command cannot use
(0 threads, a NaN temperature, an empty `--draft`, a prompt that is not UTF-8) with one line
naming the flag, instead of the value being silently reinterpreted (`--threads 0` meaning
"default") or failing minutes later.
"""

from __future__ import annotations

import argparse
import codecs
import math
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError


class ArgumentError(LlmoptError, ValueError):
    """A command-line value the command cannot use; the message names the flag."""


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def integer(args: argparse.Namespace, dest: str, minimum: int, maximum: int | None = None) -> None:
    """`--dest` is None (not given) or an integer in [minimum, maximum]."""
    value = getattr(args, dest, None)
    if value is None:
        return
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ArgumentError(f"{flag(dest)} {value} must be {bound}")


def number(
    args: argparse.Namespace,
    dest: str,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    above: bool = False,
) -> None:
    """`--dest` is None or a finite number >= minimum (> minimum with `above`) and <= maximum."""
    value = getattr(args, dest, None)
    if value is None:
        return
    if not math.isfinite(value):
        raise ArgumentError(f"{flag(dest)} {value} must be a finite number")
    low = minimum is not None and (value <= minimum if above else value < minimum)
    if low or (maximum is not None and value > maximum):
        lo = "" if minimum is None else f"{'>' if above else '>='} {minimum:g}"
        hi = "" if maximum is None else f"<= {maximum:g}"
        raise ArgumentError(
            f"{flag(dest)} {value:g} must be {' and '.join(b for b in (lo, hi) if b)}"
        )


def text(args: argparse.Namespace, dest: str, *, empty: bool = False) -> None:
    """`--dest` is None or UTF-8 text (argv holds undecodable bytes as lone surrogates), and
    not empty unless `empty`: `--draft ''` must not mean "no --draft"."""
    value: Any = getattr(args, dest, None)
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ArgumentError(
            f"{flag(dest)} is not valid UTF-8 (undecodable byte at character {exc.start})"
        ) from None
    if not empty and not value.strip():
        raise ArgumentError(f"{flag(dest)} is empty; give a value or leave the flag out")


def text_file(args: argparse.Namespace, dest: str, head_bytes: int = 1 << 16) -> None:
    """`--dest` names a file whose first `head_bytes` are UTF-8 (the reader checks the rest)."""
    path = Path(getattr(args, dest))
    if not path.is_file():
        raise ArgumentError(f"{flag(dest)}: text file not found: {path}")
    with open(path, "rb") as handle:
        head = handle.read(head_bytes)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as exc:
        raise ArgumentError(
            f"{flag(dest)} {path} is not UTF-8 text (byte {head[exc.start]:#04x} at offset "
            f"{exc.start})"
        ) from None
