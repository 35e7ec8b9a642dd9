"""`llmopt train`'s command-line flags, generated from `TrainConfig` (one per field), and the
precedence defaults < --config file < flags (`llmopt.train.config` module docstring)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from llmopt.train.config import RENAMED, RESIZING, TrainConfig
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
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    if typing.get_origin(base) is list:
        return _int_list
    return base


class _Renamed(argparse.Action):
    """An old flag: refuse it, naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} is now {self.metavar}")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` plus one flag per TrainConfig field (default: not given)."""
    parser.add_argument("--config", help="TOML (or JSON) training config; flags override it")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        base = _flag_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = FIELD_HELP[f.name] + (f" (default: {default})" if default is not None else "")
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
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if getattr(args, f.name, None) is not None
    }
    resized = any(name in changes for name in RESIZING)
    if resized and "num_microbatches" not in changes:
        changes["num_microbatches"] = None
    return base.replace(**changes)
