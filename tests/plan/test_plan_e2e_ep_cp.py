"""End to end for the new dimensions: a context-parallel and an expert-parallel plan, each
written by `llmopt plan --emit` and trained by `llmopt train --config` on 8 CPU processes,
with the engine's counted bytes per (group, op) equal to the planner's table in the run
config, row for row.

CP (cp = 2 and 4): the planner's table books ring attention as the engine runs it
(`llmopt.plan.comm`): per layer and micro-batch cp-1 point-to-point passes of one K/V block
(`llmopt.plan.ring.kv_block_bytes`) forward, cp-1 of the block with its gradients backward and
one hop of the gradients home ("cp" send and recv, calls and bytes exact); every other row's
bytes (TP, DP) equal the planner's as before.

EP (ep = 4 over dp = 8, and ep = 2 over dp = 4 with pp = 2): the emitted run config names
the MoE preset with the experts' shape overrides (`llmopt plan --num-experts
--expert-ffn-hidden`) and ep/expert_tp. The table's ("ep", "all-to-all") rows are the
planner's dispatch/combine payload (`llmopt.plan.dispatch.call_payload_bytes`, whose wire
share (ep-1)/ep is `call_bytes`) times its calls per micro-batch, for the MoE blocks of the
stage. The planner prices balanced routing (`--expert-imbalance 1`): a rank dispatches its
tokens' top_k copies whatever the routing, but combines (and, backward, returns the gradients
of) the rows its experts received, which only balanced routing makes equal to what it sent;
so the run adds `--moe-force-balance` (round-robin routing, every expert the same tokens).
Then every row is exact: all-to-all calls and bytes, dense ("dp") and expert ("edp")
gradient bytes (their calls are not compared: the engine reduces per block unit where the
planner counts one call) and the pipeline's send/recv bytes.

Not covered: EP with tp > 1. With expert_tp = tp the engine routes every TP rank's copy of
the tokens (tp times the all-to-all payload the planner books for Megatron's sequence-split
dispatch); with expert_tp = 1 it gathers the routed output over TP where the planner books a
dense MLP's TP collectives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = REPO
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--num-kv-heads", "2",
         "--intermediate-size", "128"]  # fmt: skip
# groups whose calls the engine issues one for one as the planner books them
EXACT_CALLS = ("cp", "ep")


def _llmopt(*argv: str, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "llmopt", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _emit(tmp: Path, model: list[str], where: str, global_batch: int) -> tuple[Path, dict]:
    run_toml = tmp / "run.toml"
    plan = _llmopt("plan", *model, "--cluster", "dgx-h100", "--nodes", "1", "--seq-len", "16",
                   "--global-batch", str(global_batch), "--where", where, "--emit", str(run_toml),
                   timeout=300)  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    return run_toml, tomllib.loads(run_toml.read_text())


def _train(config: Path, out: Path, *extra: str) -> dict:
    """Train 3 steps on 8 processes; the last step's record (rank 0)."""
    run = _llmopt("train", "--config", str(config), "--nproc-per-node", "8", "--steps", "3",
                  "--corpus", "random", "--out-dir", str(out), "--no-progress", *extra,
                  timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("event") == "step"]
    assert len(steps) == 3
    return steps[-1]


def _assert_counted_equal_predicted(counted: dict, predicted: dict) -> None:
    """Every (group, op) the planner books, and every one the engine counts, with equal bytes
    (and equal calls on EXACT_CALLS groups)."""

    def table(t: dict) -> dict:
        return {(g, op): v for g, ops in t.items() for op, v in ops.items()}

    got, want = table(counted), table(predicted)
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        assert got[key]["bytes"] == row["bytes"], key
        if key[0] in EXACT_CALLS:
            assert got[key]["calls"] == row["calls"], key


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("tp,cp,dp", [(2, 2, 2), (2, 4, 1)])
def test_emitted_cp_plan_trains_and_its_bytes_match_the_planners(tmp_path, tp, cp, dp):
    from llmopt.models.presets import get_preset
    from llmopt.parallel.plan import ParallelPlan
    from llmopt.plan.grid import to_grid
    from llmopt.plan.ring import kv_block_bytes

    where = f"tp={tp},cp={cp},dp={dp},pp=1,sequence_parallel=false,num_microbatches=2"
    model = ["--model", "smollm2-135m", *SHAPE]
    run_toml, config = _emit(tmp_path, model, where, global_batch=8)
    par = ParallelPlan.from_dict(config["parallel"])
    assert (par.tp, par.cp, par.dp, par.num_microbatches) == (tp, cp, dp, 2)
    predicted = config["planner"]["comm"]["first"]
    assert predicted == config["planner"]["comm"]["last"]  # pp = 1: one stage
    # the ring the planner books, in the engine's units
    shape = get_preset("smollm2-135m").replace(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
        head_dim=None,
    )  # fmt: skip
    block = int(kv_block_bytes(shape, to_grid(par), 16)[0])
    passes = shape.num_layers * par.num_microbatches
    ring = {"calls": (2 * cp - 1) * passes, "bytes": (3 * cp - 2) * block * passes}
    assert predicted["cp"] == {"send": ring, "recv": ring}
    comm = _train(run_toml, tmp_path / "train")["comm"]
    _assert_counted_equal_predicted(comm, predicted)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("where", ["pp=1,dp=8,ep=4", "pp=2,dp=4,ep=2"])
def test_emitted_ep_plan_trains_and_its_bytes_match_the_planners(tmp_path, where):
    from llmopt.parallel.plan import ParallelPlan
    from llmopt.plan.dispatch import call_bytes, calls_per_microbatch
    from llmopt.plan.grid import to_grid
    from llmopt.plan.hardware import get_cluster
    from llmopt.plan.split import rank_layers
    from llmopt.train.config import TrainConfig
    from llmopt.train.shapes import model_config

    where += ",tp=1,cp=1,sequence_parallel=false,zero_stage=1,micro_batch=1,num_microbatches=2"
    model = ["--model", "mixtral-8x7b", *SHAPE, "--num-experts", "8", "--expert-ffn-hidden", "128"]
    run_toml, config = _emit(tmp_path, model, where, global_batch=16 if "dp=8" in where else 8)
    assert f"ep={config['parallel']['ep']}" in where
    par = ParallelPlan.from_dict(config["parallel"])
    assert par.ep > 1 and par.resolved_expert_tp == 1
    trained = model_config(TrainConfig.from_file(run_toml))
    assert (trained.moe.num_experts, trained.moe.expert_ffn_hidden) == (8, 128)
    predicted = config["planner"]["comm"]["first"]
    # the all-to-all rows are the planner's dispatch/combine: wire share = call_bytes
    cluster = get_cluster("dgx-h100", nodes=1, gpus_per_node=8)
    intra, inter = call_bytes(trained, cluster, to_grid(par), 16 * par.micro_batch, "alltoall")
    first_stage_layers = int(rank_layers(trained, par.pp)[0][()])
    calls = int(calls_per_microbatch(trained, False)) * first_stage_layers * par.num_microbatches
    a2a = predicted["ep"]["all_to_all"]
    assert a2a["calls"] == calls
    wire = a2a["bytes"] * (par.ep - 1) / par.ep
    assert wire == pytest.approx(calls * float((intra + inter)[0]), rel=1e-12)
    record = _train(run_toml, tmp_path / "train", "--moe-force-balance")
    assert record["moe_imbalance"] == 1.0  # the balanced routing the planner prices
    _assert_counted_equal_predicted(record["comm"], predicted)
