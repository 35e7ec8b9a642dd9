"""Token budget -> steps, days, GPU-hours, cost; bad budgets are one-line errors."""

from __future__ import annotations

import json
import math

import pytest

from llmopt.cli import main
from llmopt.plan.budget import BudgetError, parse_tokens, training_budget

EST = ["plan", "estimate", "--model", "llama-3-8b", "--nodes", "1", "--tp", "2"]
EST += ["--global-batch", "64", "--zero-stage", "1"]


@pytest.mark.parametrize(
    "text, tokens",
    [("15T", 15 * 10**12), ("300B", 3 * 10**11), ("2.5e12", 25 * 10**11), ("1.5 k", 1500),
     ("7", 7), (4096, 4096), ("2G", 2 * 10**9)],
)  # fmt: skip
def test_token_counts_parse(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["3Q", "-1", "0", "nan", "inf", "", "1e400", "T", "15TT"])
def test_bad_token_counts_are_refused(text):
    with pytest.raises(BudgetError, match="--tokens="):
        parse_tokens(text)


def test_budget_arithmetic_by_hand():
    # 1e12 tokens, 4M tokens per step -> 238,419 steps (the last one rounded up to whole)
    b = training_budget(10**12, 4 * 2**20, 10.0, 1024, price=2.5, goodput=0.9)
    assert b.steps == math.ceil(10**12 / (4 * 2**20)) == 238419
    assert b.train_seconds == pytest.approx(2384190.0)
    assert b.wall_seconds == pytest.approx(2384190.0 / 0.9)
    assert b.days == pytest.approx(2384190.0 / 0.9 / 86400)
    assert b.gpu_hours == pytest.approx(2384190.0 / 0.9 * 1024 / 3600)
    assert b.cost == pytest.approx(b.gpu_hours * 2.5)
    assert training_budget(10**12, 4 * 2**20, 10.0, 1024).cost is None


@pytest.mark.parametrize("price", [float("nan"), float("inf"), -1.0])
def test_bad_prices_are_refused(price):
    with pytest.raises(BudgetError, match="--gpu-hour-price="):
        training_budget(10**9, 4096, 1.0, 8, price=price)


def test_estimate_reports_the_budget_of_its_own_step_time(capsys):
    assert main(EST + ["--json", "--tokens", "1T", "--gpu-hour-price", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    step = data["plan"]["step_time_s"]["total"]
    b = data["budget"]
    per_step = 64 * 4096
    assert b["steps"] == -(-(10**12) // per_step)
    assert b["wall_seconds"] == pytest.approx(b["steps"] * step, rel=1e-5)
    assert b["gpu_hours"] == pytest.approx(b["wall_seconds"] * 8 / 3600)
    assert b["cost"] == pytest.approx(2 * b["gpu_hours"])
    assert "goodput" not in data


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tokens", "-1"], "--tokens='-1' must be a finite count"),
        (["--tokens", "3Q"], "--tokens='3Q' is not a token count"),
        (["--tokens", "1T", "--gpu-hour-price", "nan"], "--gpu-hour-price=nan must be"),
        (["--gpu-hour-price", "2"], "--gpu-hour-price needs --tokens"),
    ],
)
def test_cli_budget_errors_are_one_line(capsys, extra, message):
    assert main(["plan", "--model", "llama-3-8b", "--nodes", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
