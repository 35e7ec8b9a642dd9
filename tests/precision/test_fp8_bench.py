"""The GPU benchmark script runs end to end (on the CPU, tiny shapes) and records sane numbers.

Nobody here has an H100, so this is what keeps `benchmarks/fp8_gpu.py` from rotting: the same
code paths (variants, timing loop, error metric, JSON) with `--device cpu --preset tiny`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmopt.models import ModelConfig
from llmopt.plan.flops import matmul_params_per_layer
from tests.paths import REPO

ROOT = REPO


def _run(name: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`python benchmarks/<name>.py ARGV` as a user runs it (tests never import benchmarks/)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = ROOT / "benchmarks" / f"{name}.py"
    return subprocess.run(
        [sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_gpu_block_benchmark_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--preset", "tiny", "--batch", "2", "--seq", "32"]
    argv += ["--warmup", "0", "--iters", "1", "--modes", "fp8-current,bf16,fp8-delayed"]
    assert _run("fp8_gpu", [*argv, "--out", str(out)]).returncode == 0
    data = json.loads(out.read_text())
    tiny = ModelConfig.from_dict(data["config"])  # the benchmark's --preset tiny
    assert (tiny.name, tiny.hidden_size, tiny.num_layers) == ("tiny", 128, 1)
    assert [r["mode"] for r in data["results"]] == ["bf16", "fp8-current", "fp8-delayed"]
    by_mode = {r["mode"]: r for r in data["results"]}
    assert by_mode["bf16"]["err"] == 0.0
    # FP8 error of the block's residual branch: E4M3 GEMMs give a few percent, not 0, not 100%
    assert 0.005 < by_mode["fp8-current"]["err"] < 0.15
    # the planner's FLOP convention (causal): 3 x (2 x GEMM weights + 2 x seq x q_size) per token
    per_token = 2 * matmul_params_per_layer(tiny) + 2 * 32 * tiny.q_size
    assert data["flops_per_iter"] == 3 * per_token * 2 * 32
    assert data["threads"] >= 1 and data["date"].endswith("UTC")


def test_gpu_block_benchmark_refuses_a_device_without_fp8(tmp_path):
    proc = _run("fp8_gpu", ["--device", "meta", "--out", str(tmp_path / "x.json")])
    assert proc.returncode == 2
    assert "no FP8 GEMM on device type 'meta'" in proc.stdout
    assert not (tmp_path / "x.json").exists()
