"""End to end for the new dimensions: a context-parallel plan that `llmopt plan --emit` writes
and an expert-parallel run config, each trained by `llmopt train --config` on 8 CPU
processes, with the engine's counted bytes held against the planner's.

CP: the planner picks tp2 x cp2 x dp2 and writes its predicted calls/bytes per (group, op).
The engine's TP and DP bytes equal them exactly. Its ring attention passes K/V blocks
point-to-point ("cp" send/recv) where the planner's table books CP as an all-gather of K/V
forward and a reduce-scatter of their gradients backward (`llmopt.plan.comm`); the block is
the planner's own (`llmopt.plan.ring.kv_block_bytes`), the ring moves cp-1 of them forward
and 2(cp-1)+1 backward (K/V with their gradients, then the gradients home) per layer and
micro-batch, which at cp=2 is exactly the payload the planner's table lists.

EP: the run config's trainer side (the planner's run-config emitter refuses MoE models, see
`llmopt.plan.emit.runconfig`) with ep=4 over dp=8 and round-robin routing (every expert the
same tokens, the planner's "force-balanced benchmark" case): dense ("dp") and expert ("edp")
gradient bytes equal the planner's table exactly, and the engine's all-to-all bytes on the
wire equal the planner's dispatch/combine bytes (`llmopt.plan.dispatch.call_bytes`) times its
calls per micro-batch (`calls_per_microbatch`): its table has no all-to-all rows yet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--num-kv-heads", "2",
         "--intermediate-size", "128"]  # fmt: skip


def _llmopt(*argv: str, timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "llmopt", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _train(config: Path, out: Path) -> dict:
    """Train 3 steps on 8 processes; the last step's record (rank 0)."""
    run = _llmopt("train", "--config", str(config), "--nproc-per-node", "8", "--steps", "3",
                  "--corpus", "random", "--out-dir", str(out), "--no-progress", timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("event") == "step"]
    assert len(steps) == 3
    return steps[-1]


@pytest.mark.dist
@pytest.mark.slow
def test_emitted_cp_plan_trains_and_its_bytes_match_the_planners(tmp_path):
    from llmopt.models.presets import get_preset
    from llmopt.parallel.plan import ParallelPlan
    from llmopt.plan.grid import to_grid
    from llmopt.plan.ring import kv_block_bytes

    run_toml = tmp_path / "cp.toml"
    where = "tp=2,cp=2,dp=2,pp=1,sequence_parallel=false,num_microbatches=2"
    plan = _llmopt("plan", "--model", "smollm2-135m", "--cluster", "dgx-h100", "--nodes", "1",
                   *SHAPE, "--seq-len", "16", "--global-batch", "8", "--where", where,
                   "--emit", str(run_toml), timeout=300)  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    config = tomllib.loads(run_toml.read_text())
    par = ParallelPlan.from_dict(config["parallel"])
    assert (par.tp, par.cp, par.dp, par.num_microbatches) == (2, 2, 2, 2)
    comm = _train(run_toml, tmp_path / "train")["comm"]
    predicted = config["planner"]["comm"]["first"]

    def nbytes(table: dict, groups) -> dict:
        return {
            (g, op): v["bytes"] for g, ops in table.items() if g in groups for op, v in ops.items()
        }

    assert nbytes(comm, ("tp", "dp")) == nbytes(predicted, ("tp", "dp"))
    model = get_preset("smollm2-135m").replace(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
        head_dim=None,
    )  # fmt: skip
    block = int(kv_block_bytes(model, to_grid(par), 16)[0])
    cp, passes = par.cp, model.num_layers * par.num_microbatches
    ring = {"calls": (2 * cp - 1) * passes, "bytes": (3 * cp - 2) * block * passes}
    assert comm["cp"] == {"send": ring, "recv": ring}
    planner_cp = sum(v["bytes"] for v in predicted["cp"].values())
    assert comm["cp"]["send"]["bytes"] == planner_cp  # cp = 2: 3cp - 2 = 2cp blocks


@pytest.mark.dist
@pytest.mark.slow
def test_ep_run_config_trains_and_its_all_to_all_bytes_match_the_planners(tmp_path):
    from llmopt.parallel.plan import ParallelPlan
    from llmopt.plan.dispatch import call_bytes, calls_per_microbatch
    from llmopt.plan.grid import to_grid
    from llmopt.plan.hardware import get_cluster
    from llmopt.plan.predict import predicted_comm
    from llmopt.train.config import TrainConfig
    from llmopt.train.shapes import model_config

    par = ParallelPlan(dp=8, ep=4, micro_batch=1, num_microbatches=2, precision="bf16")
    model_table = {"model": "mixtral-8x7b", "num_layers": 2, "hidden_size": 64,
                   "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
                   "num_experts": 8, "expert_ffn_hidden": 128, "moe_force_balance": True}  # fmt: skip
    data = {"seq_len": 16, "global_batch": 16}
    lines = [f"{k} = {json.dumps(v)}" for k, v in model_table.items()]
    text = "[model]\n" + "\n".join(lines) + "\n\n[data]\n"
    text += "\n".join(f"{k} = {v}" for k, v in data.items()) + "\n\n" + par.to_toml()
    run_toml = tmp_path / "ep.toml"
    run_toml.write_text(text)
    record = _train(run_toml, tmp_path / "train")
    assert record["moe_imbalance"] == 1.0  # round robin: every expert the same tokens

    model = model_config(TrainConfig.from_file(run_toml))
    # dense gradients over dp, expert gradients over edp: the planner's bytes exactly (calls
    # are not compared: the engine reduces per block unit, the planner counts one call)
    predicted = predicted_comm(model, data["seq_len"], data["global_batch"], par, "first")
    for group in ("dp", "edp"):
        got = {op: v["bytes"] for op, v in record["comm"][group].items()}
        assert got == {op: v["bytes"] for op, v in predicted[group].items()}, group
    assert "ep" not in predicted  # the planner's table has no all-to-all rows yet
    cluster = get_cluster("dgx-h100", nodes=1, gpus_per_node=8)
    intra, inter = call_bytes(model, cluster, to_grid(par), data["seq_len"] * par.micro_batch,
                              "alltoall")  # fmt: skip
    calls = int(calls_per_microbatch(model, False)) * model.num_layers * par.num_microbatches
    counted = record["comm"]["ep"]["all_to_all"]
    assert counted["calls"] == calls
    # the counter books each call's whole input; 1/ep of it stays on this rank
    wire = counted["bytes"] * (par.ep - 1) / par.ep
    assert wire == pytest.approx(calls * float((intra + inter)[0]), rel=1e-12)
