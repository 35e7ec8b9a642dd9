"""One CLI vocabulary (issue 31, item 6): one dtype spelling, vLLM's flag names where the
concept is the same (old names answered in one line naming the new), help text and shown
defaults for every flag, `--json` where the README promises it, progress on long steps."""

from __future__ import annotations

import argparse
import json

import pytest

from llmopt import cli
from llmopt.dtypes import ALIASES, DTYPES
from tests.house.test_fuzz_cli import LEAVES

OWN = [(c, p, parser) for c, p, parser in LEAVES if c != "plan"]  # plan's help: the planner's


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]  # fmt: skip


@pytest.mark.parametrize("command, prefix, parser", OWN, ids=[" ".join(p) for _, p, _ in OWN])
def test_every_flag_has_help_and_its_default_is_shown(command, prefix, parser):
    text = " ".join(parser.format_help().split())
    for action in _flags(parser):
        if action.help == argparse.SUPPRESS:  # a renamed flag, answered with its new name
            continue
        assert action.help and action.help.strip(), f"{' '.join(prefix)} {action.option_strings}"
        informative = action.default not in (None, False) and not isinstance(action.default, list)
        if informative:
            assert f"default: {action.default}" in text or "default" in action.help.lower(), (
                f"{' '.join(prefix)} {action.option_strings[-1]} hides its default"
            )


def test_shown_defaults_reach_every_subparser():
    serve = next(p for c, pre, p in LEAVES if pre == ("serve",))
    assert "tokens per KV block (default: 16)" in " ".join(serve.format_help().split())
    quantize = next(p for c, pre, p in LEAVES if pre == ("quantize",))
    assert "(default: awq)" in " ".join(quantize.format_help().split())


@pytest.mark.parametrize(
    "argv, offered",
    [
        (["export", "--model", "x", "--format", "hf", "--out", "o", "--dtype"], ("float32", "float16")),
        (["serve", "--model", "x", "--dtype"], DTYPES),
        (["eval", "kl", "--model", "x", "--ref", "y", "--ref-dtype"], DTYPES),
    ],
)  # fmt: skip
@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_one_dtype_vocabulary_reads_an_alias_as_its_canonical_name(argv, offered, alias, capsys):
    parser, name = cli.build_parser(argv[0]), ALIASES[alias]
    if name not in offered:  # export writes float32/float16 only: refused, listing those
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([*argv, alias])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and all(choice in err for choice in offered)
        return
    args = parser.parse_args([*argv, alias])
    assert name in (getattr(args, "dtype", None), getattr(args, "ref_dtype", None))


@pytest.mark.parametrize("bad", ["fp8", "int4", "float64"])
def test_an_unknown_dtype_is_refused_listing_the_valid_ones(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser("serve").parse_args(["serve", "--model", "x", "--dtype", bad])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"dtype={bad!r} is not supported" in err
    assert all(name in err for name in DTYPES)


@pytest.mark.parametrize("name", DTYPES)
def test_the_torch_names_are_accepted(name):
    args = cli.build_parser("serve").parse_args(["serve", "--model", "x", "--dtype", name])
    assert args.dtype == name


RENAMES = [(c, old, new) for c, table in cli.RENAMED_FLAGS.items() for old, new in table.items()]


@pytest.mark.parametrize("command, old, new", RENAMES, ids=[f"{c} {o}" for c, o, _ in RENAMES])
def test_a_renamed_flag_names_its_new_name_in_one_line(command, old, new, capsys):
    assert cli.main([command, old, "1"]) == 2
    err = capsys.readouterr().err
    assert err == f"llmopt {command}: error: {old} was renamed {new} (one flag vocabulary across commands)\n"  # fmt: skip
    assert any(new in a.option_strings for _, pre, p in LEAVES if pre[0] == command for a in _flags(p))  # fmt: skip


def test_unrecognized_flags_are_one_line_named_after_the_command(capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's refusals exit 2 from parse_args
        cli.main(["serve", "--model", "x", "--bogus"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "llmopt serve: error: unrecognized arguments: --bogus\n"


def test_report_json(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("# A result\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    out = tmp_path / "r.html"
    assert cli.main(["report", str(tmp_path), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["writeups"] == 1 and out.is_file()


def test_profile_json_and_export_progress(tmp_path, capsys):
    from tests.finetune_fixtures import tiny_hf_model

    model = tiny_hf_model(tmp_path / "m")
    out = tmp_path / "prof"
    argv = ["profile", "--model", str(model), "--new-tokens", "3", "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["decode"]["steps"] == 2
    assert summary == {"out": str(out), **json.loads((out / "ops.json").read_text())}
    code = cli.main(
        ["export", "--model", str(model), "--format", "hf", "--out", str(tmp_path / "hf")]
    )
    err = capsys.readouterr().err.splitlines()
    assert code == 0 and err[0] == f"llmopt export: loading {model}"
    assert err[1].startswith("llmopt export: writing HF float32") and err[2].startswith(
        "llmopt export: done in"
    )
