"""Ring-attention CP cost: cp-1 K/V passes per layer hidden behind one block's attention,
zig-zag load balance, activations divided by cp."""

from __future__ import annotations

import numpy as np
import pytest

from llmopt.models.presets import get_preset
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan import ring
from llmopt.plan.grid import to_grid
from llmopt.plan.hardware import customize, get_cluster
from llmopt.plan.search import estimate
from llmopt.plan.workload import Workload

MODEL = get_preset("llama-3-8b")  # 8 KV heads of 128
CLUSTER = get_cluster("dgx-h100", 1)
S = 32768
PLAN = ParallelPlan(tp=1, pp=1, dp=2, cp=4, micro_batch=1, num_microbatches=4, zero_stage=1)


def _exposed(attn_s: float, full: bool = False) -> float:
    grid = to_grid(PLAN)
    out = ring.ring_exposed_seconds(MODEL, CLUSTER, grid, S, np.array([attn_s]),
                                    np.array([False]), np.array([full]))  # fmt: skip
    return float(out[0])


def test_kv_block_by_hand():
    # 1 x 8192 tokens x (K+V) x 8 heads x 128 x 2 bytes
    assert float(ring.kv_block_bytes(MODEL, to_grid(PLAN), S)[0]) == 8192 * 2 * 8 * 128 * 2


def test_exposed_only_beyond_the_blocks_attention():
    block = 8192 * 2 * 8 * 128 * 2
    bw, lat = CLUSTER.intra_node.bytes_per_s, CLUSTER.intra_node.latency_us * 1e-6
    step = lat + block / bw
    # attention long enough to hide both the forward and the backward (2x bytes, 2x compute)
    assert _exposed(attn_s=4 * 2 * step) == 0.0
    # no compute to hide behind: 3 forward steps + 3 backward steps of twice the bytes
    want = 3 * (step + lat + 2 * block / bw)
    assert _exposed(attn_s=0.0) == pytest.approx(want, rel=1e-12)
    # half-hidden forward: each block's attention covers half a step
    a = 4 * step / 2
    want = 3 * (step / 2 + max(0.0, lat + 2 * block / bw - 2 * a / 4))
    assert _exposed(attn_s=a) == pytest.approx(want, rel=1e-12)
    # full recomputation runs the forward ring again
    assert _exposed(0.0, full=True) - _exposed(0.0) == pytest.approx(3 * step, rel=1e-12)


def test_zig_zag_balances_the_causal_triangle(monkeypatch):
    assert ring.causal_imbalance(np.array([1, 2, 4, 8])).tolist() == [1, 1, 1, 1]
    assert ring.causal_imbalance(np.array([4]), balanced=False)[0] == pytest.approx(8 / 5)
    block = 8192 * 2 * 8 * 128 * 2
    step = CLUSTER.intra_node.latency_us * 1e-6 + block / CLUSTER.intra_node.bytes_per_s
    a = 4 * step / 2  # hides half a forward step when balanced
    assert _exposed(a * 8 / 5) < _exposed(a)  # the busiest rank's 8/5 x hides more...
    monkeypatch.setattr(ring, "CP_LOAD_BALANCED", False)
    work = Workload(seq_len=S, global_batch=8)
    slow = estimate(MODEL, work, CLUSTER, PLAN).step_time_s["total"]
    monkeypatch.setattr(ring, "CP_LOAD_BALANCED", True)
    fast = estimate(MODEL, work, CLUSTER, PLAN).step_time_s["total"]
    assert fast < slow  # ...but the step waits for it: zig-zag is faster overall


def test_slow_links_expose_the_ring_and_cp_divides_activations():
    work = Workload(seq_len=S, global_batch=8)
    fast = estimate(MODEL, work, CLUSTER, PLAN)
    assert fast.step_time_s["cp_comm_exposed"] == 0.0  # NVLink hides 8 MiB blocks
    slow_link = customize(CLUSTER, **{"intra_node.bandwidth_gbs": 2.0})
    slow = estimate(MODEL, work, slow_link, PLAN)
    assert slow.step_time_s["cp_comm_exposed"] > 0.1
    one = estimate(MODEL, Workload(seq_len=S, global_batch=8), get_cluster("dgx-h100", 1),
                   PLAN.replace(cp=2, dp=4, num_microbatches=2))  # fmt: skip
    assert one.memory_bytes["activations"] == pytest.approx(
        2 * fast.memory_bytes["activations"], rel=0.01
    )
