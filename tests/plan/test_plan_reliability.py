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


def test_a_search_nothing_fits_names_the_switch_that_fits(capsys):
    """Issue 27 item 5: the fp32-gradient default rejected runs that bf16 gradients fit."""
    err = _error(["plan", "--nodes", "2", "--global-batch", "32"], capsys)
    assert "does not fit on 2x8 H100-SXM5-80GB" in err
    assert "fits with --reduce-dtype bf16: tp=" in err and "GiB per GPU" in err


def test_why_not_names_the_switch_that_fits(capsys):
    argv = ["plan", "--nodes", "4", "--global-batch", "32", "--why-not",
            "tp=8,recompute=none,micro_batch=4"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rejected, no plan with these settings is valid" in out
    assert "Fits with recompute=selective: tp=8" in out


def test_best_plan_a_framework_runs_is_found_when_none_runs_the_top():
    import argparse

    from llmopt.models.presets import get_preset
    from llmopt.plan.cli.run import _best_framework_plan
    from llmopt.plan.hardware import get_cluster
    from llmopt.plan.search import search
    from llmopt.plan.workload import Workload

    model, cluster, work = get_preset("llama-3-70b"), get_cluster("dgx-h100", 8), Workload()
    result = search(model, work, cluster, top_k=2)
    args = argparse.Namespace(framework="llmopt", model="llama-3-70b")
    for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                 "vocab_size", "mlp_kind", "tied"):  # fmt: skip
        setattr(args, name, None)
    refused = {f: "refused" for f in ("llmopt", "megatron", "nemo", "torchtitan", "deepspeed")}
    rank, plan, names = _best_framework_plan(args, model, work, cluster, result, dict(refused))
    assert rank >= 1 and names and plan.rank == rank
    # when some framework runs #1, nothing more is printed
    assert _best_framework_plan(args, model, work, cluster, result, {**refused, "nemo": ""}) is None
