"""Failure model: job MTBF, checkpoint cost, Young/Daly interval, lost work, goodput."""

from __future__ import annotations

import json
import math

import pytest

from llmopt.cli import main
from llmopt.models.presets import get_preset
from llmopt.plan.goodput import (
    CHECKPOINT_BYTES_PER_PARAM,
    GoodputError,
    cluster_mtbf_s,
    goodput,
    waste_fraction,
    young_daly_interval,
)

MODEL = get_preset("llama-3-8b")


def test_job_mtbf_from_either_rate():
    assert cluster_mtbf_s(1000, gpu_mtbf_hours=50_000) == pytest.approx(50 * 3600)
    assert cluster_mtbf_s(1000, failures_per_day=4) == pytest.approx(6 * 3600)
    with pytest.raises(GoodputError, match="give one of"):
        cluster_mtbf_s(8, 1.0, 1.0)
    with pytest.raises(GoodputError, match="--failures-per-day=nan"):
        cluster_mtbf_s(8, failures_per_day=float("nan"))


def test_young_daly_interval_is_the_optimum_of_the_waste():
    c, m, r = 60.0, 6 * 3600.0, 600.0
    tau = young_daly_interval(c, m)
    assert tau == pytest.approx(math.sqrt(2 * 60 * 21600))  # 1610 s
    best = waste_fraction(tau, c, r, m)
    for other in (0.5 * tau, 0.9 * tau, 1.1 * tau, 2 * tau):
        assert waste_fraction(other, c, r, m) > best
    assert best == pytest.approx(c / tau + (tau / 2 + r) / m)


def test_goodput_by_hand():
    # 8B model: checkpoint bytes = params x 14; 100 GB/s; 2 failures per day; 10 min restart
    g = goodput(MODEL, 1024, 100.0, failures_per_day=2, restart_minutes=10)
    c = MODEL.num_parameters() * CHECKPOINT_BYTES_PER_PARAM / 100e9
    m = 43200.0
    tau = math.sqrt(2 * c * m)
    assert g.checkpoint_s == pytest.approx(c)
    assert g.interval_s == pytest.approx(tau)
    assert g.lost_per_failure_s == pytest.approx(tau / 2 + 600)
    assert g.goodput == pytest.approx(1 - (c / tau + (tau / 2 + 600) / m))


def test_hopeless_failure_rates_are_refused():
    with pytest.raises(GoodputError, match="no progress"):
        goodput(MODEL, 8, 1.0, failures_per_day=1000, restart_minutes=5)
    with pytest.raises(GoodputError, match="--ckpt-gbs=0"):
        goodput(MODEL, 8, 0, failures_per_day=1)


def test_cli_goodput_stretches_the_budget(capsys):
    base = ["plan", "estimate", "--model", "llama-3-8b", "--nodes", "1", "--tp", "2"]
    base += ["--global-batch", "64", "--json", "--tokens", "100B"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["budget"]
    assert main(base + ["--gpu-mtbf-hours", "1000", "--ckpt-gbs", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    g = data["goodput"]
    assert g["mtbf_s"] == pytest.approx(1000 * 3600 / 8)
    assert data["budget"]["wall_seconds"] == pytest.approx(plain["wall_seconds"] / g["goodput"])
    assert main(base + ["--gpu-mtbf-hours", "1000"]) == 2
    assert "needs --ckpt-gbs" in capsys.readouterr().err
