"""The trainer drives pipeline parallelism (llmopt.parallel.pipeline) when pp > 1."""

from __future__ import annotations

import pytest

from llmopt.train.config import TrainConfig
from llmopt.train.trainer import train
from tests.dist_helpers import run_distributed

RUN = dict(
    corpus="random",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    seq_len=16,
    global_batch=4,
    micro_batch=1,
    steps=3,
    lr=1e-3,
    warmup_steps=1,
    progress=False,
    peak_tflops=1.0,
    timeout_s=30,
)


def _worker(rank: int, world: int, cfg: dict) -> dict:
    result = train(TrainConfig().replace(**cfg))
    return {"losses": result.losses, "comm": result.comm_per_step}


@pytest.mark.dist
def test_pp2_matches_one_process(tmp_path):
    reference = train(TrainConfig().replace(**RUN, out_dir=str(tmp_path / "one"))).losses
    piped = run_distributed(
        _worker, 2, dict(RUN, out_dir=str(tmp_path / "pp"), pp=2, schedule="gpipe")
    )
    for res in piped:
        # fp32; only the order of the micro-batch gradient sums differs (1e-5 relative).
        assert all(abs(a - b) / b < 1e-5 for a, b in zip(res["losses"], reference))
        assert res["comm"]["pp"]["send"]["calls"] > 0  # the stages really exchanged tensors


RUN_CONFIG = """
[model]
model = "smollm2-135m"
[data]
seq_len = 4096
global_batch = 1024
[parallel]
tp = 2
pp = 2
dp = 1
cp = 1
ep = 1
sequence_parallel = true
zero_stage = 1
micro_batch = 1
num_microbatches = 1024
schedule = "1f1b"
virtual_stages = 1
recompute = "selective"
precision = "bf16"
fp8_recipe = "current"
reduce_dtype = "fp32"
[planner]
predicted_step_time_s = 9.5
"""


@pytest.mark.dist
def test_cli_runs_an_emitted_run_config_with_smaller_sizes(tmp_path):
    """`llmopt train --config run.toml` on top of size overrides runs the file's mapping,
    with num_microbatches re-derived for the new global batch (4 / (dp 1 x 1) = 4)."""
    import json
    import os
    import subprocess
    import sys

    config = tmp_path / "run.toml"
    config.write_text(RUN_CONFIG)
    out = tmp_path / "run"
    args = [sys.executable, "-m", "llmopt", "train", "--config", str(config)]
    args += ["--nproc-per-node", "4", "--corpus", "random", "--num-layers", "2"]
    args += ["--hidden-size", "64", "--intermediate-size", "128", "--num-heads", "4"]
    args += ["--num-kv-heads", "2", "--seq-len", "16", "--global-batch", "4", "--steps", "1"]
    args += ["--no-progress", "--peak-tflops", "1", "--out-dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    plan = records[0]["plan"]
    assert (plan["tp"], plan["pp"], plan["dp"], plan["num_microbatches"]) == (2, 2, 1, 4)
    assert (plan["zero_stage"], plan["recompute"], plan["precision"]) == (1, "selective", "bf16")
    step = records[1]
    assert step["comm"]["pp"]["send"]["calls"] > 0 and step["comm"]["tp"]["all_gather"]["calls"]
