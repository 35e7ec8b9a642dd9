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

from llmopt import dtypes
from llmopt.dtypes import DTYPES
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


OVERWRITE_HELP = (
    "write into an --out that holds other files: replace only the files this command writes, "
    "keep the others (without it such an --out is refused)"
)


def add_overwrite(parser: argparse.ArgumentParser) -> None:
    """The one `--overwrite` every command that writes a directory takes."""
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def output_dir(
    args: argparse.Namespace, kind: str, dest: str = "out", source: str | None = "model"
) -> None:
    """`--out` is not the input (`--model` where it is a path) and is new, empty, an earlier
    output of `kind` or `--overwrite` is given, before any work (`llmopt.output_dir`)."""
    from llmopt.artifacts import check_distinct
    from llmopt.output_dir import check_output_dir

    value = getattr(args, dest, None)
    if value is None:
        return
    model = getattr(args, source, None) if source else None
    if isinstance(model, str) and model and Path(model).expanduser().exists():
        check_distinct(value, model, flag(dest))
    overwrite = bool(getattr(args, "overwrite", False))
    check_output_dir(value, kind, overwrite=overwrite, flag=flag(dest))


def output_file(args: argparse.Namespace, dest: str, magic: bytes, what: str) -> None:
    """A single-file output that exists must be an earlier one (its first bytes are `magic`)
    unless `--overwrite`: a user's file of that name is never replaced unasked."""
    value = getattr(args, dest, None)
    if value is None or getattr(args, "overwrite", False):
        return
    path = Path(value)
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb") as handle:
        head = handle.read(len(magic))
    if head != magic:
        raise ArgumentError(
            f"{flag(dest)} {path} exists and is not {what}; choose a new file name, or pass "
            "--overwrite to replace it"
        )


DEVICE_TYPES = ("cpu", "cuda")  # what llmopt runs on (torch.device accepts many more names)


def device(args: argparse.Namespace, dest: str = "device") -> None:
    """`--device` is cpu or cuda[:N]; torch's own error lists twenty device types."""
    value = getattr(args, dest, None)
    if value is None:
        return
    kind, _, index = value.partition(":")
    if kind not in DEVICE_TYPES or (index and not (index.isdigit() and kind == "cuda")):
        raise ArgumentError(
            f"{flag(dest)} {value!r} is not a device llmopt runs on; use cpu, cuda or cuda:N"
        )


# ---- one dtype vocabulary (`llmopt.dtypes`): torch's names, the short spellings as aliases ----
# load-time choice of `serve`/`generate`: "auto" keeps a quantized GGUF's blocks as the file
# holds them (what the fused kernels read), every other source loads as float32
LOAD_DTYPES = ("auto", *DTYPES)


def dtype_name(value: str) -> str:
    """argparse type of every `--dtype`-like flag: the canonical name (`llmopt.dtypes`); the
    flag's choices then refuse a dtype it does not offer, listing the ones it does."""
    if value in dtypes.NOT_DTYPES:
        return value  # "auto"/"keep" where a flag offers them: its choices decide
    try:
        return dtypes.dtype_name(value)
    except dtypes.DtypeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_dtype(
    parser: argparse.ArgumentParser,
    flag: str = "--dtype",
    default: str = "float32",
    help: str = "dtype of the weights and compute",
    choices: tuple[str, ...] = DTYPES,
) -> None:
    parser.add_argument(
        flag,
        type=dtype_name,
        choices=choices,
        default=default,
        metavar="{" + ",".join(choices) + "}",
        help=help,
    )


def load_dtype(name: str):
    """What `load_model(dtype=...)` takes for a --dtype of LOAD_DTYPES."""
    return name if name == "auto" else dtypes.torch_dtype(name)
