"""The GPU benchmark script runs end to end (on the CPU, tiny shapes) and records sane numbers.

Nobody here has an H100, so this is what keeps `benchmarks/fp8_gpu.py` from rotting: the same
code paths (variants, timing loop, error metric, JSON) with `--device cpu --preset tiny`.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from llmopt.plan.flops import matmul_params_per_layer

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    if str(ROOT / "benchmarks") not in sys.path:  # as `python benchmarks/x.py` sees it (_report)
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_block_benchmark_smoke_on_cpu(tmp_path):
    bench = _load("fp8_gpu")
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--preset", "tiny", "--batch", "2", "--seq", "32"]
    argv += ["--warmup", "0", "--iters", "1", "--modes", "fp8-current,bf16,fp8-delayed"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["results"]] == ["bf16", "fp8-current", "fp8-delayed"]
    by_mode = {r["mode"]: r for r in data["results"]}
    assert by_mode["bf16"]["err"] == 0.0
    # FP8 error of the block's residual branch: E4M3 GEMMs give a few percent, not 0, not 100%
    assert 0.005 < by_mode["fp8-current"]["err"] < 0.15
    # the planner's FLOP convention (causal): 3 x (2 x GEMM weights + 2 x seq x q_size) per token
    per_token = 2 * matmul_params_per_layer(bench.TINY) + 2 * 32 * bench.TINY.q_size
    assert data["flops_per_iter"] == 3 * per_token * 2 * 32
    assert data["threads"] >= 1 and data["date"].endswith("UTC")


def test_gpu_block_benchmark_refuses_a_device_without_fp8(tmp_path, capsys):
    bench = _load("fp8_gpu")
    assert bench.main(["--device", "meta", "--out", str(tmp_path / "x.json")]) == 2
    assert "no FP8 GEMM on device type 'meta'" in capsys.readouterr().out
    assert not (tmp_path / "x.json").exists()
