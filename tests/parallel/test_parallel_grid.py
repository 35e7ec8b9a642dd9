"""Rank grid layout and communication accounting."""

from __future__ import annotations

import pytest
import torch

from llmopt.models import ModelConfig
from llmopt.parallel.comm import CommCounter, local_group
from llmopt.parallel.grid import ParallelDims, RankGrid
from tests.dist_helpers import run_distributed


def test_layout_tp_innermost_pp_outermost():
    dims = ParallelDims(8, tp=2, pp=2)
    assert dims.dp == 2
    assert dims.group_ranks("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert dims.group_ranks("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert dims.group_ranks("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    for rank in range(8):
        assert dims.rank_of(**dims.coords(rank)) == rank


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=8, tp=3), r"tp\*pp\*cp=3 .* does not divide world_size=8"),
        (dict(world_size=4, tp=2, dp=3), "does not equal world_size=4"),
        (dict(world_size=4, tp=0), "tp=0 must be a positive integer"),
        (dict(world_size=4, ep=3), r"expert_tp\*ep = 1\*3 does not divide"),
        (dict(world_size=4, tp=2, expert_tp=3), "expert_tp=3 must be 1 or tp=2"),
    ],
)
def test_bad_dims_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_model_validation_names_the_bad_value():
    cfg = ModelConfig("m", 192, 72, 144, 2, num_heads=9, num_kv_heads=3)
    with pytest.raises(ValueError, match="tp=2 does not divide num_heads=9"):
        ParallelDims(2, tp=2).validate_model(cfg)
    with pytest.raises(ValueError, match="tp=3 does not divide the sequence length 16"):
        ParallelDims(3, tp=3).validate_model(cfg, seq_len=16, sequence_parallel=True)


def test_single_process_grid_is_identity():
    grid = RankGrid.create(ParallelDims(1))
    x = torch.ones(4)
    grid.dp.all_reduce(x)
    assert torch.equal(grid.tp.all_gather(x), x)
    assert grid.counter.snapshot() == {}


def test_counter_delta():
    group = local_group("tp")
    counter = CommCounter()
    counter.record("tp", "all_reduce", 10)
    before = counter.snapshot()
    counter.record("tp", "all_reduce", 6)
    counter.record("dp", "send", 4)
    assert CommCounter.delta(counter.snapshot(), before) == {
        "tp": {"all_reduce": {"calls": 1, "bytes": 6}},
        "dp": {"send": {"calls": 1, "bytes": 4}},
    }
    assert counter.bytes("tp") == 16 and counter.calls(op="send") == 1
    with pytest.raises(ValueError, match="unknown communication op 'gather'"):
        counter.record("tp", "gather", 1)
    assert group.size == 1


def _collectives(rank: int, world: int) -> dict:
    grid = RankGrid.create(ParallelDims(world, tp=2))
    tp, dp = grid.tp, grid.dp
    x = torch.full((3,), float(rank))
    tp.all_reduce(x)  # 12 bytes
    gathered = tp.all_gather(torch.full((2, 5), float(rank)), dim=1)  # output 2x10 fp32
    scattered = dp.reduce_scatter(torch.ones(4, 2))  # input 4x2 fp32
    nxt = (dp.rank + 1) % dp.size
    buf = torch.empty(6, dtype=torch.bfloat16)
    dp.batch_p2p([("send", torch.ones(6, dtype=torch.bfloat16), nxt), ("recv", buf, nxt)], True)
    return {
        "x": x.tolist(),
        "gathered": gathered.tolist(),
        "scattered": scattered.tolist(),
        "counts": grid.counter.snapshot(),
        "groups": (grid.tp.ranks, grid.dp.ranks),
    }


@pytest.mark.dist
def test_collectives_and_byte_convention():
    results = run_distributed(_collectives, 4)
    for rank, res in enumerate(results):
        pair = (rank // 2) * 2
        assert res["x"] == [float(pair + pair + 1)] * 3
        assert res["gathered"] == [[float(pair)] * 5 + [float(pair + 1)] * 5] * 2
        assert res["scattered"] == [[2.0, 2.0]] * 2
        assert res["groups"] == ((pair, pair + 1), (rank % 2, rank % 2 + 2))
        assert res["counts"] == {
            "tp": {
                "all_reduce": {"calls": 1, "bytes": 12},
                "all_gather": {"calls": 1, "bytes": 80},
            },
            "dp": {
                "reduce_scatter": {"calls": 1, "bytes": 32},
                "send": {"calls": 1, "bytes": 12},
                "recv": {"calls": 1, "bytes": 12},
            },
        }
