"""`llmopt profile`: exact FLOP/byte counts, phase attribution, and the CLI's artifacts on SmolLM2."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.cli import main
from llmopt.models.spec import get_spec, spec_for
from llmopt.peaks import measure_peaks
from llmopt.profile.costs import op_cost
from llmopt.profile.phases import DECODE_STEP, PREFILL, PhaseMarker
from llmopt.profile.session import profile_generate


def test_op_costs_from_shapes():
    assert op_cost("aten::mm", [[3, 64], [64, 32]], ["float", "float"]) == (
        2 * 3 * 64 * 32,
        4 * (3 * 64 + 64 * 32 + 3 * 32),
    )
    assert op_cost("aten::addmm", [[32], [3, 64], [64, 32]], ["c10::BFloat16"] * 3) == (
        2 * 3 * 64 * 32,
        2 * (32 + 3 * 64 + 64 * 32 + 3 * 32),
    )
    q, kv = [1, 8, 5, 16], [1, 8, 12, 16]
    assert op_cost(
        "aten::_scaled_dot_product_flash_attention_for_cpu", [q, kv, kv], ["float"] * 3
    ) == (
        4 * 8 * 5 * 12 * 16,
        4 * (2 * 8 * 5 * 16 + 2 * 8 * 12 * 16),
    )
    assert op_cost("aten::mul", [[1, 4, 64], [64]], ["float", "float"]) == (
        256,
        4 * (256 + 64 + 256),
    )
    assert op_cost("aten::copy_", [[2, 8], [2, 8], []], ["float", "float", "Scalar"]) == (0, 128)
    assert op_cost("aten::view", [[2, 8], []], ["float", "ScalarList"]) == (0, 0)
    assert op_cost("aten::rms_norm", [[1, 4]], ["float"]) == (None, None)


def test_measured_peaks_are_positive_and_named():
    peaks = measure_peaks("cpu", torch.float32, matmul_n=128, copy_mib=4, repeats=2)
    assert peaks.flops_per_s > 0 and peaks.bytes_per_s > 0
    assert peaks.ridge == peaks.flops_per_s / peaks.bytes_per_s
    assert (peaks.matmul_n, peaks.copy_bytes, peaks.dtype) == (128, 2 * 4 * 2**20, "float32")
    with pytest.raises(ValueError, match="matmul_n=8 must be >= 16"):
        measure_peaks("cpu", matmul_n=8)


def test_phase_marker_refuses_nvtx_without_cuda_and_unknown_phases():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nvtx=True needs CUDA"):
            PhaseMarker(nvtx=True)
    marker = PhaseMarker()
    assert marker.nvtx == torch.cuda.is_available()
    with pytest.raises(ValueError, match="unknown phase 'llmopt.nap'"):
        marker.begin("llmopt.nap")
    with marker.phase(PREFILL):
        assert marker.depth == 1
    assert marker.depth == 0


def test_decode_step_matmul_flops_equal_two_per_linear_weight(tiny_model):
    peaks = measure_peaks("cpu", matmul_n=64, copy_mib=1, repeats=1)
    summary = profile_generate(tiny_model, [1, 2, 3, 4, 5], 6, peaks)
    decode = summary["decode"]
    assert decode["steps"] == 5
    linears = [m for m in tiny_model.modules() if isinstance(m, torch.nn.Linear)]
    rows = {r["name"]: r for r in decode["table"]}
    # one token per step: every linear is one [1, in] x [in, out] product
    assert rows["aten::mm"]["calls"] == len(linears)
    assert rows["aten::mm"]["flops"] == sum(2 * m.weight.numel() for m in linears)
    weight_bytes = sum(4 * m.weight.numel() for m in linears)
    act_bytes = sum(4 * (m.in_features + m.out_features) for m in linears)
    assert rows["aten::mm"]["bytes"] == weight_bytes + act_bytes
    # prefill scores 5 positions but only the last goes through the LM head
    prefill = {r["name"]: r for r in summary["prefill"]["table"]}
    head = spec_for(tiny_model).top_module(tiny_model, "head").weight.numel()
    assert prefill["aten::mm"]["flops"] == 5 * (rows["aten::mm"]["flops"] - 2 * head) + 2 * head
    assert sum(r["percent"] for r in decode["table"]) == pytest.approx(100.0)
    assert decode["ops_per_step"] > decode["kernel_launches_per_step"] >= len(linears)
    assert summary["memory"]["peak_bytes"] >= summary["memory"]["baseline_bytes"] > 0


@pytest.mark.slow
def test_profile_cli_writes_trace_table_launches_and_roofline(tmp_path, capsys):
    out = tmp_path / "prof"
    new_tokens = 6
    assert (
        main(
            [
                "profile",
                "--model",
                "smollm2-135m",
                "--new-tokens",
                str(new_tokens),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps at the console width
    assert "aten::mm" in printed and "kernel launches/step" in printed
    trace = json.loads((out / "trace.json").read_text())
    names = [e.get("name") for e in trace["traceEvents"]]
    assert names.count(DECODE_STEP) == new_tokens - 1 and names.count(PREFILL) == 1
    assert "aten::mm" in names
    summary = json.loads((out / "ops.json").read_text())
    decode = summary["decode"]
    assert decode["steps"] == new_tokens - 1
    total_self_ms = sum(r["self_cpu_us"] for r in decode["table"]) / 1e3
    assert total_self_ms == pytest.approx(decode["op_self_ms_per_step"])
    # the op table plus the time between ops accounts for the wall-clock step time within 10%
    wall_ms = decode["wall_ms_per_step"]
    assert total_self_ms + decode["outside_ops_ms_per_step"] == pytest.approx(wall_ms, rel=0.10)
    # self times are not double counted, and for a 135M model the ops hold a large share
    assert 0.3 * wall_ms < total_self_ms <= 1.02 * wall_ms
    assert decode["op_coverage"] == pytest.approx(total_self_ms / wall_ms)
    assert decode["kernel_launches_per_step"] > 0 and decode["ops_per_step"] > 0
    mm = next(r for r in decode["table"] if r["name"] == "aten::mm")
    spec = get_spec("llama")  # SmolLM2 is a Llama
    assert mm["calls"] == 30 * len(spec.block_linears) + 1  # 30 layers x 7 linears + the head
    assert summary["roofline_points"]["decode"][0]["name"] == "mm"
    for png in ("roofline.png", "memory.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["memory"]["peak_bytes"] > 0 and summary["peaks"]["flops_per_s"] > 0


def test_profile_cli_bad_input(tmp_path, capsys):
    assert main(["profile", "--new-tokens", "1", "--out", str(tmp_path)]) == 2
    assert "--new-tokens 1 must be >= 2" in capsys.readouterr().err
