"""Property tests over every `llmopt` argument parser: random flags and values, parsed by the
real `build_parser` and checked by the command's own validation (`llmopt.cli.check_arguments`,
and `config_from_args` for train) without doing the work. Each outcome must be a parse, an
argparse refusal (exit 2), or an error the CLI prints as one line naming a flag it was given.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmopt import cli

TOKENS = [
    "0", "1", "2", "3", "8", "-1", "1000000000", "1.5", "nan", "inf", "-inf", "", " ", "x",
    "a\udcffb", "tp=2", "tp=0,pp=2", "zero_stage=4", "mem<=70GiB", "tp<=x", "2:4", "0.5",
    "corpus:web-bible", "corpus:nope", "gpipe", "fp8", "none", "out", "sub/out", "run.toml",
]  # fmt: skip
REQUIRED = {"prompt": "hi", "model": "smollm2-135m", "out": "out", "ref": "smollm2-135m",
            "url": "http://127.0.0.1:9", "format": "hf", "dir": "."}  # fmt: skip


def leaves() -> list[tuple[str, tuple[str, ...], argparse.ArgumentParser]]:
    """(command, argv prefix, parser) for every parser that parses flags (plan estimate, ...)."""
    found = []
    for command in cli.COMMANDS:
        stack = [((command,), _sub(cli.build_parser(command), command))]
        while stack:
            prefix, parser = stack.pop()
            found.append((command, prefix, parser))
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    stack += [((*prefix, name), p) for name, p in action.choices.items()]
    return found


def _sub(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


LEAVES = leaves()


def _value(action: argparse.Action) -> st.SearchStrategy[str]:
    pool = st.sampled_from(TOKENS)
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        return st.sampled_from([str(c) for c in action.choices]) | pool
    return pool


def argv_for(parser: argparse.ArgumentParser) -> st.SearchStrategy[list[str]]:
    optional, required, positional = [], [], []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if not action.option_strings:
            positional.append(action)
        elif action.required:
            required.append(action)
        else:
            optional.append(action)

    @st.composite
    def build(draw) -> list[str]:
        argv: list[str] = []
        for action in required:
            default = REQUIRED.get(action.dest, "x")
            argv += [action.option_strings[-1], draw(st.just(default) | _value(action))]
        for action in positional:
            if action.nargs in ("*", "?"):
                argv += draw(st.lists(_value(action), max_size=2))
            else:
                argv.append(draw(st.just(REQUIRED.get(action.dest, "x")) | _value(action)))
        for action in draw(
            st.lists(st.sampled_from(optional), max_size=4, unique=True)
            if optional
            else st.just([])
        ):
            flag = draw(st.sampled_from(action.option_strings))
            argv += [flag] if action.nargs == 0 else [flag, draw(_value(action))]
        return argv

    return build()


@contextlib.contextmanager
def inside(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def named(message: str, argv: list[str]) -> bool:
    names = set()
    for token in argv:
        if token.startswith("--"):
            names |= {token, token[2:], token[2:].replace("-", "_")}
    names |= {t for t in argv if len(t) > 2 and not t.startswith("-")}  # a value it repeats
    names |= {repr(t) for t in argv}  # ... or quotes
    return any(n in message for n in names)


def validate(command: str, prefix: tuple[str, ...], parser, argv: list[str], capsys) -> None:
    try:
        args = cli.build_parser(command).parse_args([*prefix, *argv])
    except SystemExit as exc:
        assert exc.code == 2 and "error:" in capsys.readouterr().err
        return
    try:
        cli.check_arguments(command, args)
        if command == "train":
            from llmopt.train.flags import config_from_args

            config_from_args(args)
    except Exception as exc:  # noqa: BLE001 - the property: only input errors come out
        message = cli.error_message(exc)
        assert message is not None, f"{type(exc).__name__} escaped: {exc}"
        assert "\n" not in message and message.strip()
        assert named(message, argv), f"{message!r} names nothing of {argv}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.mark.parametrize("command, prefix, parser", LEAVES, ids=[" ".join(p) for _, p, _ in LEAVES])
def test_any_arguments_parse_or_fail_cleanly(command, prefix, parser, scratch, capsys):
    @given(argv_for(parser))
    def check(argv):
        with inside(scratch):
            validate(command, prefix, parser, argv, capsys)

    check()


def test_the_leaves_cover_every_command():
    commands = {c for c, _, _ in LEAVES}
    assert commands == set(cli.COMMANDS)
    assert ("plan", "estimate") in {p for _, p, _ in LEAVES}
    assert ("eval", "gate") in {p for _, p, _ in LEAVES}
