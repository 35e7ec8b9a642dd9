"""Accuracy gates: threshold checks on exact statistics, and `llmopt eval gate` on SmolLM2."""

from __future__ import annotations

import json
import math

import pytest

from llmopt.cli import main
from llmopt.eval.gate import GateConfigError, GateThresholds, apply_gates, ppl_increase_pct
from llmopt.eval.kl import KLResult

RESULT = KLResult(
    mean=0.2,
    median=0.1,
    p99=1.0,
    top1_agreement=0.8,
    rms_delta_p=0.05,
    tokens=100,
    ppl=11.0,
    ref_ppl=10.0,
)


def test_gates_judge_each_statistic_against_its_threshold():
    assert ppl_increase_pct(RESULT) == pytest.approx(10.0)
    report = apply_gates(
        RESULT, GateThresholds(max_kl=0.25, max_ppl_increase_pct=10.5, min_top1=0.8)
    )
    assert report.passed and [g.name for g in report.gates] == ["kl", "ppl_increase", "top1"]
    report = apply_gates(RESULT, GateThresholds(max_kl=0.1, max_ppl_increase_pct=9.0, min_top1=0.9))
    assert [g.name for g in report.failed] == ["kl", "ppl_increase", "top1"]
    assert report.reason() == (
        "gate failed: mean KL 0.2 nats > max 0.1 nats; perplexity increase 10% > max 9%; "
        "top-1 agreement 0.8 < min 0.9"
    )
    only_top1 = apply_gates(RESULT, GateThresholds(max_kl=1.0, min_top1=0.81))
    assert only_top1.reason() == "gate failed: top-1 agreement 0.8 < min 0.81"
    assert only_top1.to_dict()["gates"][0] == {
        "name": "kl",
        "value": 0.2,
        "threshold": 1.0,
        "passed": True,
    }


def test_nan_statistic_fails_its_gate():
    nan = KLResult(math.nan, 0, 0, 1.0, 0, 10, ppl=math.nan, ref_ppl=10.0)
    report = apply_gates(nan, GateThresholds(max_kl=10.0, max_ppl_increase_pct=10.0, min_top1=0.5))
    assert [g.name for g in report.failed] == ["kl", "ppl_increase"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_kl": -1.0}, "max_kl=-1.0 must be a finite number in [0.0, inf]"),
        ({"min_top1": 1.5}, "min_top1=1.5 must be a finite number in [0.0, 1.0]"),
        ({"max_kl": math.inf}, "max_kl=inf must be a finite number"),
        ({"max_ppl_increase_pct": math.nan}, "max_ppl_increase_pct=nan must be a finite"),
        ({"max_kl": "0.1"}, "max_kl='0.1' must be a number"),
        ({}, "no gate given"),
    ],
)
def test_bad_thresholds_are_refused(kwargs, message):
    with pytest.raises(
        GateConfigError, match="^" + message.replace("[", r"\[").replace("]", r"\]")
    ):
        GateThresholds(**kwargs)


GATE_ARGS = ["--text", "corpus:web-bible", "--max-tokens", "160", "--ctx", "64"]


@pytest.mark.slow
def test_gate_passes_the_model_against_itself(capsys):
    argv = ["eval", "gate", "--model", "smollm2-135m", "--ref", "smollm2-135m", *GATE_ARGS]
    code = main(
        [*argv, "--max-kl", "1e-6", "--max-ppl-increase", "0.01%", "--min-top1", "100%", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["passed"] is True
    assert out["kl"]["tokens"] == 159 and out["kl"]["top1_agreement"] == 1.0
    assert [g["name"] for g in out["gates"]] == ["kl", "ppl_increase", "top1"]


@pytest.fixture(scope="module")
def rtn_w3_dir(tmp_path_factory):
    from llmopt.compress.quant import quantize_model, save_quantized
    from llmopt.models.loading import load_model, load_tokenizer

    q = quantize_model(load_model("smollm2-135m"), "rtn", bits=3, group_size=128)
    return save_quantized(
        q, tmp_path_factory.mktemp("w3") / "rtn-w3", load_tokenizer("smollm2-135m")
    )


@pytest.mark.slow
def test_gate_fails_rtn_w3_naming_the_kl(rtn_w3_dir, capsys):
    argv = ["eval", "gate", "--model", str(rtn_w3_dir), "--ref", "smollm2-135m", *GATE_ARGS]
    code = main([*argv, "--max-kl", "0.05", "--min-top1", "0.2", "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert code == 1 and out["passed"] is False
    kl = out["kl"]["mean"]
    assert kl > 0.05
    line = captured.err.strip()
    assert "\n" not in line
    assert line == f"llmopt eval gate: gate failed: mean KL {kl:.6g} nats > max 0.05 nats"
    assert out["reason"] == line.removeprefix("llmopt eval gate: ")


def test_gate_cli_refuses_bad_thresholds(capsys):
    base = ["eval", "gate", "--model", "smollm2-135m", "--ref", "smollm2-135m"]
    assert main([*base, "--min-top1", "1.5"]) == 2
    assert capsys.readouterr().err.strip() == (
        "llmopt eval: error: --min-top1 1.5 must be >= 0 and <= 1"
    )
    with pytest.raises(SystemExit) as exc:
        main([*base, "--max-kl", "nan"])
    assert exc.value.code == 2
    assert "'nan' must be finite" in capsys.readouterr().err
