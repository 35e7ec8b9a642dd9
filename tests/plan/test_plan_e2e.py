"""End to end: `llmopt plan --emit run.toml` picks a tp2·pp2·dp2 plan for a small model on one
8-GPU node, `llmopt train --config run.toml` runs it on 8 CPU processes for 3 steps, and the
bytes per (group, op) the planner wrote into the run config's [planner] table equal the bytes
the engine counted in the last step of its training log (rank 0: first pipeline stage).
Checked by hand on 2026-12-01 against the trainer then on main (its config keys translated):
tp/all_reduce 40960, pp/send and pp/recv 6299648, dp/reduce_scatter 6365696 and
dp/all_gather 3182848 bytes, all equal to the prediction.

The run-config format is the one in the project rules; the trainer reads it once the engine
branch (TrainConfig on ParallelPlan's names) is merged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = REPO
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--num-kv-heads", "2",
         "--intermediate-size", "128"]  # fmt: skip
WHERE = "tp=2,pp=2,dp=2,sequence_parallel=false,num_microbatches=2,schedule=1f1b"


def _llmopt(*argv: str, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "llmopt", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.dist
def test_emitted_plan_trains_and_moves_the_predicted_bytes(tmp_path):
    run_toml = tmp_path / "run.toml"
    plan = _llmopt("plan", "--model", "smollm2-135m", "--cluster", "dgx-h100", "--nodes", "1",
                   *SHAPE, "--seq-len", "16", "--global-batch", "8", "--where", WHERE,
                   "--emit", str(run_toml), timeout=120)  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    config = tomllib.loads(run_toml.read_text())
    par = config["parallel"]
    assert (par["tp"], par["pp"], par["dp"], par["num_microbatches"]) == (2, 2, 2, 2)
    assert config["model"]["num_layers"] == 2 and config["data"]["global_batch"] == 8

    out = tmp_path / "train"
    train = _llmopt("train", "--config", str(run_toml), "--nproc-per-node", "8", *SHAPE,
                    "--steps", "3", "--corpus", "random", "--out-dir", str(out),
                    "--no-progress", timeout=600)  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("event") == "step"]
    assert len(steps) == 3

    def nbytes(table: dict) -> dict:
        return {(g, op): v["bytes"] for g, ops in table.items() for op, v in ops.items()}

    # Bytes, exactly, for every (group, op). Calls are not compared: the engine may split a
    # step's ZeRO-1 reduce-scatter / all-gather into several buckets of the same total (today:
    # one for the blocks, one for the embedding/head unit), the planner counts one.
    assert nbytes(steps[-1]["comm"]) == nbytes(config["planner"]["comm"]["first"])
