"""FLOP conventions: causal by default, Megatron's full s² and PaLM's 6N + 12LHQT on request;
FP8 MFU against the FP8 peak."""

from __future__ import annotations

import pytest

from llmopt.models.presets import get_preset
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.flops import FlopsConventionError, model_flops_per_token
from llmopt.plan.hardware import get_cluster
from llmopt.plan.search import estimate
from llmopt.plan.workload import Workload, megatron_flops

GPT = get_preset("gpt3-175b")
L, H, V = 96, 12288, 51200


@pytest.mark.parametrize("s", [2048, 131072])
def test_conventions_follow_their_formulas(s):
    megatron = megatron_flops(1, s, L, H, V, recompute=False) / s
    assert model_flops_per_token(GPT, s, "megatron") == pytest.approx(megatron, rel=1e-12)
    # causal: half of the 12·L·h·s attention-core term of the full-s² count
    causal = megatron - 0.5 * 12 * L * H * s
    assert model_flops_per_token(GPT, s) == pytest.approx(causal, rel=1e-12)
    n = GPT.num_parameters() - V * H  # PaLM's N: no input embedding (the head is tied)
    palm = 6 * n + 12 * L * H * s
    assert model_flops_per_token(GPT, s, "palm") == pytest.approx(palm, rel=1e-12)


def test_long_context_mfu_switches_as_the_formulas_say():
    model, cluster = get_preset("llama-3.1-8b"), get_cluster("dgx-h100", 1)
    plan = ParallelPlan(tp=1, pp=1, dp=1, cp=8, micro_batch=1, num_microbatches=1, zero_stage=1)
    s = 131072
    out = {}
    for conv in ("causal", "megatron", "palm"):
        work = Workload(seq_len=s, global_batch=1, flops_convention=conv)
        out[conv] = estimate(model, work, cluster, plan)
    t = out["causal"].step_time_s["total"]
    assert out["megatron"].step_time_s["total"] == t  # the convention never changes the timing
    ratio = model_flops_per_token(model, s, "megatron") / model_flops_per_token(model, s)
    assert out["megatron"].mfu / out["causal"].mfu == pytest.approx(ratio, rel=1e-12)
    assert ratio > 1.3  # at 128K the full-s² count inflates MFU by more than a third
    assert out["causal"].mfu < 1.0


def test_fp8_mfu_uses_the_fp8_peak():
    model, cluster = get_preset("llama-3-8b"), get_cluster("dgx-h100", 1)
    plan = ParallelPlan(tp=1, pp=1, dp=8, micro_batch=1, num_microbatches=4, zero_stage=1)
    fp8 = estimate(
        model, Workload(seq_len=4096, global_batch=32), cluster, plan.replace(precision="fp8")
    )
    flops = model_flops_per_token(model, 4096) * 4096 * 32
    per_gpu = flops / fp8.step_time_s["total"] / 8
    assert fp8.mfu == pytest.approx(per_gpu / cluster.gpu.peak_flops("fp8"), rel=1e-9)
    assert fp8.mfu_bf16_peak == pytest.approx(per_gpu / cluster.gpu.peak_flops("bf16"), rel=1e-9)
    assert fp8.to_dict()["tokens_per_s_per_gpu"] == pytest.approx(fp8.tokens_per_s / 8, abs=0.1)
    bf16 = estimate(model, Workload(seq_len=4096, global_batch=32), cluster, plan)
    assert bf16.mfu_bf16_peak is None


def test_unknown_convention_is_refused():
    with pytest.raises(FlopsConventionError, match="choose from causal, megatron, palm"):
        model_flops_per_token(GPT, 2048, "hardware")
    with pytest.raises(ValueError, match="flops_convention='x'"):
        Workload(flops_convention="x")
