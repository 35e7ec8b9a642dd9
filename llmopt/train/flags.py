"""`llmopt train`'s command-line flags, generated from `TrainConfig` (one per field), and the
precedence defaults < --config file < flags (`llmopt.train.config` module docstring)."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from llmopt.parallel.plan import ParallelPlan
from llmopt.train.config import RENAMED, RESIZING, TrainConfig, file_keys
from llmopt.train.field_help import FIELD_HELP


def _int_list(text: str) -> list[int]:
    """A comma-separated list of integers (`--layers-per-stage 3,5`)."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _flag_type(hint: Any):
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(hint) if a is not type(None)] if union else []
    base = args[0] if args else hint
    if typing.get_origin(base) in (list, tuple):
        return _int_list
    if typing.get_origin(base) is typing.Literal:
        return str  # the plan checks the choice and names the valid ones
    return base


class _Renamed(argparse.Action):
    """An old flag: refuse it, naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is now {self.metavar}")


def _fields() -> list[tuple[str, Any, Any]]:
    """(name, type hint, default) of every flag: one per config-file key (`file_keys`); an
    empty default list (layers_per_stage) shows as no default."""
    hints = {**typing.get_type_hints(ParallelPlan), **typing.get_type_hints(TrainConfig)}
    defaults = TrainConfig().to_dict()
    return [
        (name, hints[name], defaults[name] if defaults[name] != [] else None)
        for name in file_keys()
    ]


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` plus one flag per TrainConfig field and plan field (default: not given)."""
    parser.add_argument("--config", help="TOML (or JSON) training config; flags override it")
    for name, hint, default in _fields():
        flag = "--" + name.replace("_", "-")
        base = _flag_type(hint)
        help_text = FIELD_HELP[name] + (f" (default: {default})" if default is not None else "")
        if base is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(flag, type=base, default=None, help=help_text)
    for old, new in RENAMED.items():
        parser.add_argument(
            "--" + old,
            action=_Renamed,
            metavar="--" + new.replace("_", "-"),
            dest="renamed_" + old,
            help=argparse.SUPPRESS,
        )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults < --config file < flags; a size flag re-derives num_microbatches (module doc)."""
    base = TrainConfig.from_file(args.config) if getattr(args, "config", None) else TrainConfig()
    changes = {
        name: getattr(args, name)
        for name, _, _ in _fields()
        if getattr(args, name, None) is not None
    }
    resized = any(name in changes for name in RESIZING)
    if resized and "num_microbatches" not in changes:
        changes["num_microbatches"] = None
    return base.replace(**changes)
