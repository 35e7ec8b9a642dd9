"""Issue 30's planner cases: each bad input is one line naming the value and what is valid,
before any search runs (never a traceback, never an answer as if the input were valid)."""

from __future__ import annotations

import json

import pytest

from llmopt.cli import main


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--num-layers", "99999999999999999999"],
         "--num-layers=99999999999999999999 must be a positive integer up to 2147483647"),
        (["plan", "--nodes", "99999999999999999999"], "--nodes=99999999999999999999 is too large"),
        (["plan", "--why-not", ""], "--why-not '' names no setting; give key=value pairs"),
        (["plan", "--where", " "], "--where ' ' names no setting"),
        (["plan", "--why-not", "tp=8,tp=4"], "tp is given twice (tp=8, tp=4); give it once"),
        (["plan", "serve", "--tp", "0"], "--tp=0 must be a positive integer"),
    ],
)  # fmt: skip
def test_bad_plan_flags_are_one_line_errors(argv, message, capsys):
    assert message in _error(argv, capsys)


def test_cluster_files_must_say_what_they_describe(tmp_path, capsys):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert f"{empty} is empty: give at least base" in _error(
        ["plan", "--cluster", str(empty)], capsys
    )
    base_only = tmp_path / "base.toml"
    base_only.write_text('base = "dgx-h100"\n')
    err = _error(["plan", "--cluster", str(base_only)], capsys)
    assert f"{base_only} sets no nodes: add nodes = N" in err
    # with --nodes, or with nodes in the file, it plans
    assert (
        main(["plan", "--cluster", str(base_only), "--nodes", "8", "--top-k", "1", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["cluster"]["nodes"] == 8


def test_moe_config_with_zero_kv_heads_is_refused(tmp_path, capsys):
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
           "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 0, "vocab_size": 32000,
           "num_local_experts": 8, "num_experts_per_tok": 2}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    err = _error(["plan", "--model", str(path)], capsys)
    assert "num_key_value_heads=0 must be a positive integer" in err
    cfg["num_key_value_heads"] = 8  # the same config with its real KV heads is planned
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(path), "--top-k", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"][0]["ep"] >= 1
