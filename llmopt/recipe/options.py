"""A recipe's prune and quantize stages read as the `llmopt prune` / `llmopt quantize` flags.

A stage's keys are the flags that make the command's config object (`CONFIG_FLAGS` of
`llmopt.compress.prune.cli` and `llmopt.compress.cli`), spelled with underscores
(`--group-size` -> `group_size`), with the command's own defaults and types; the stage becomes
the very `PruneConfig` / `QuantConfig` the command would build (`prune_config`,
`quant_config`). So a recipe stage and a command line mean the same thing, and there is no
second set of defaults or units to drift.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from llmopt.config_files import BOOL, FLOAT, INT, STR

# keys older recipes used, and what they are now called (with why)
RENAMED = {
    "quantize": {
        "calib_tokens": "calib_samples (calibration sequences of calib_seq_len tokens, as "
        "`llmopt quantize --calib-samples`)"
    },
}
# values the command parses from text that TOML may write as a number (sparsity = 0.5)
_ALSO_FLOAT = ("sparsity",)


@dataclass(frozen=True)
class StageOptions:
    """One command's config flags: recipe key -> the argparse action behind it."""

    command: str
    actions: dict[str, argparse.Action]
    defaults: dict[str, Any]  # every dest of the command's parser -> its default
    build: Callable[[argparse.Namespace], Any]  # the command's own flags -> config object

    def schema(self) -> dict[str, tuple[str, ...]]:
        """The stage keys' types, as `llmopt.config_files.check_fields` reads them."""
        return {key: _kinds(key, action) for key, action in self.actions.items()}

    def config(self, stage: dict[str, Any]) -> Any:
        """The command's config object for `stage` (keys checked by the caller)."""
        values = dict(self.defaults)
        for key, value in stage.items():
            if key in self.actions:
                dest = self.actions[key].dest
                values[dest] = str(value) if key in _ALSO_FLOAT else value
        return self.build(argparse.Namespace(**values))


def _kinds(key: str, action: argparse.Action) -> tuple[str, ...]:
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        return (BOOL,)
    if action.type is int:
        return (INT,)
    if action.type is float:
        return (FLOAT,)
    return (STR, FLOAT) if key in _ALSO_FLOAT else (STR,)


@cache
def stage_options(kind: str) -> StageOptions:
    """The options of the `prune` or `quantize` stage, read from the command's parser."""
    if kind == "prune":
        from llmopt.compress.prune import cli as command

        build: Callable[[argparse.Namespace], Any] = command.prune_config
    else:
        from llmopt.compress import cli as command  # type: ignore[no-redef]

        build = command.quant_config
    subparsers = argparse.ArgumentParser(add_help=False).add_subparsers()
    command.register(subparsers)
    name = "prune" if kind == "prune" else "quantize"
    parser = subparsers.choices[name]
    actions = {
        flag[2:].replace("-", "_"): action
        for action in parser._actions
        for flag in action.option_strings
        if flag in command.CONFIG_FLAGS
    }
    defaults = {a.dest: a.default for a in parser._actions if a.dest != "help"}
    return StageOptions(name, actions, defaults, build)
