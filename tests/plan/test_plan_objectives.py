"""--objective and --require: what the search minimises and the hard limits it keeps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from llmopt.cli import main
from llmopt.models.presets import get_preset
from llmopt.plan.fewest import cluster_sizes, search_fewest_gpus
from llmopt.plan.hardware import GIB, get_cluster
from llmopt.plan.objectives import RequireError, parse_require
from llmopt.plan.search import build_grid, estimate, evaluate, search
from llmopt.plan.workload import Workload

MODEL = get_preset("llama-3-70b")
CLUSTER = get_cluster("dgx-h100", 8)
WORK = Workload()


def test_seed_question_internode_bytes():
    """llama-3-70b on 8 x 8 H100, fewest inter-node bytes: TP inside the node, PP across nodes,
    fits; with no forward all-gather and a memory limit ZeRO-1 misses, the answer is ZeRO-2."""
    result = search(MODEL, WORK, CLUSTER, top_k=3, objective="internode-bytes")
    top = result.plans[0]
    p = top.parallel
    assert p.tp <= 8 and p.tp * p.dp * p.cp <= 8 and p.pp == 8  # one stage per node
    assert top.fits
    ev = result.evaluation
    inter = ev.comm["inter_node"][ev.valid]
    assert top.comm_bytes["inter_node"] <= inter.min() * 1.01
    # the memory limit: below what the answer would need with ZeRO-1
    limit = 40 * GIB
    reqs = (parse_require("no-forward-allgather"), parse_require("mem<=40GiB"))
    answer = search(MODEL, WORK, CLUSTER, top_k=1, objective="internode-bytes", requires=reqs)
    best = answer.plans[0]
    assert best.parallel.zero_stage == 2 and best.memory_bytes["total"] <= limit
    z1 = estimate(MODEL, WORK, CLUSTER, dataclasses.replace(best.parallel, zero_stage=1))
    assert z1.memory_bytes["total"] > limit
    assert best.comm_bytes["inter_node"] <= inter.min() * 1.01
    # no valid plan keeps ZeRO-3, none exceeds the limit
    aev = answer.evaluation
    assert not (aev.valid & (aev.grid["zero"] == 3)).any()
    assert (aev.memory["total"][aev.valid] <= limit).all()


def test_seed_question_on_the_command_line(capsys):
    argv = ["plan", "--objective", "internode-bytes", "--require", "no-forward-allgather"]
    argv += ["--require", "mem<=40GiB", "--top-k", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "internode-bytes" in out and "GB over the network per step" in out
    assert "ZeRO-2 shards optimizer states and gradients" in out
    assert (
        "Answer (internode-bytes): tp=4,pp=8,dp=2 zero_stage=2 recompute=selective sends 8.6 GB"
        in out
    )


@pytest.mark.parametrize(
    "exprs, predicate",
    [
        (["zero_stage<=1", "tp<=4"], lambda g, m: (g["zero"] <= 1) & (g["tp"] <= 4)),
        (["pp>2", "dp!=8"], lambda g, m: (g["pp"] > 2) & (g["dp"] != 8)),
        (["mem<=60GiB"], lambda g, m: m <= 60 * GIB),
        (["mem<64GB", "tp-in-node"], lambda g, m: (m < 64e9) & (g["tp"] <= 8)),
        (["no-forward-allgather", "micro_batch==1"], lambda g, m: (g["zero"] < 3) & (g["mb"] == 1)),
    ],
)
def test_requirements_keep_exactly_the_plans_that_meet_them(exprs, predicate):
    reqs = tuple(parse_require(e) for e in exprs)
    result = search(MODEL, WORK, CLUSTER, top_k=5, requires=reqs)
    grid = build_grid(MODEL, WORK, CLUSTER)
    free = evaluate(MODEL, WORK, CLUSTER, grid, with_comm=False)
    want = free.valid & predicate(grid, free.memory["total"])
    assert result.valid == int(want.sum()) > 0
    assert np.array_equal(result.evaluation.valid, want)


@pytest.mark.parametrize(
    "expr, message",
    [
        ("tp<=eight", "expected FIELD<=N"),
        ("warp<=2", "unknown field 'warp'"),
        ("tp<=8GiB", "tp takes a plain number"),
        ("mem<=70TB", "unit 'tb'"),
        ("mem<=nan", "expected FIELD<=N"),
        ("zero_stage~2", "expected FIELD<=N"),
    ],
)
def test_bad_requirements_are_one_line_errors(expr, message):
    with pytest.raises(RequireError, match=message) as info:
        parse_require(expr)
    assert "\n" not in str(info.value)


def test_nothing_meets_the_requirements_says_which():
    reqs = (parse_require("mem<=1GiB"),)
    with pytest.raises(ValueError, match=r"meets --require mem<=1GiB: e.g. .* fits but"):
        search(MODEL, WORK, CLUSTER, requires=reqs)


def test_memory_objective_picks_the_leanest_band():
    result = search(MODEL, WORK, CLUSTER, top_k=3, objective="memory")
    ev = result.evaluation
    lean = ev.memory["total"][ev.valid].min()
    assert result.plans[0].memory_bytes["total"] <= lean * 1.01
    # within the band, faster first
    times = [p.step_time_s["total"] for p in result.plans if p.memory_bytes["total"] <= lean * 1.01]
    assert times == sorted(times) or len(times) == 1


def test_gpus_objective_finds_the_smallest_slice_that_runs():
    size, result = search_fewest_gpus(MODEL, WORK, CLUSTER, top_k=2)
    assert result.plans[0].fits and size.num_gpus < CLUSTER.num_gpus
    smaller = [c for c in cluster_sizes(CLUSTER) if c.num_gpus < size.num_gpus]
    assert smaller
    for c in smaller:
        with pytest.raises(ValueError):
            search(MODEL, WORK, c, top_k=1)
    assert result.plans[0].parallel.world_size == size.num_gpus


def test_cli_rejects_bad_objective_and_require(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--objective", "cost"])
    assert "invalid choice: 'cost'" in capsys.readouterr().err
    assert main(["plan", "--require", "tp<=x"]) != 0
    err = capsys.readouterr().err
    assert "--require 'tp<=x' is not valid" in err and len(err.strip().splitlines()) == 1
