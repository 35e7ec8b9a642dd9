"""MoE cost terms against hand computations: expert weight traffic, kernel-level launch bound."""

from __future__ import annotations

import numpy as np
import pytest

from llmopt.models.presets import get_preset
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan import experts
from llmopt.plan.grid import to_grid
from llmopt.plan.hardware import get_cluster
from llmopt.plan.search import estimate
from llmopt.plan.workload import Workload

QWEN = get_preset("qwen3-30b-a3b")  # 128 experts, top-8, expert ffn 768, hidden 2048, 48 blocks
PLAN = ParallelPlan(tp=1, pp=1, dp=8, ep=8, micro_batch=1, num_microbatches=8, zero_stage=1)


def test_expert_weight_traffic_matches_hand_count():
    grid = to_grid(PLAN)
    hbm = 8000e9 * 0.8
    local = 128 / 8 * 3 * 2048 * 768  # SwiGLU weights of the 16 local experts
    # forward and input-gradient GEMMs read bf16 weights (2+2), fp32 wgrad read + write (4+4)
    want = local * 12 / hbm
    got = experts.expert_weight_seconds(QWEN, grid, 4, hbm)
    assert float(got[0]) == pytest.approx(want, rel=1e-12)
    assert float(experts.expert_weight_seconds(QWEN, to_grid(PLAN.replace(ep=4)), 4, hbm)[0]) == (
        pytest.approx(2 * want, rel=1e-12)
    )


def test_launches_hide_only_behind_the_expert_gemms():
    grid = to_grid(PLAN)
    work = Workload(seq_len=4096, global_batch=64)
    block = experts.KERNELS_PER_MOE_BLOCK * experts.LAUNCH_S
    per_expert = experts.KERNELS_PER_EXPERT["bf16"] * experts.LAUNCH_S
    busy = experts.host_seconds_per_block(QWEN, work, grid, np.array([1.0]))
    assert float(busy[0]) == pytest.approx(block, rel=1e-12)  # GEMMs longer than launches
    idle = experts.host_seconds_per_block(QWEN, work, grid, np.array([0.0]))
    assert float(idle[0]) == pytest.approx(block + 16 * per_expert, rel=1e-12)
    half = experts.host_seconds_per_block(QWEN, work, grid, np.array([8 * per_expert]))
    assert float(half[0]) == pytest.approx(block + 8 * per_expert, rel=1e-12)


def test_larger_micro_batches_amortise_the_per_micro_batch_expert_costs():
    cluster = get_cluster("dgx-b200", 1)
    work = Workload(seq_len=4096, global_batch=64, precision="fp8")
    fp8 = PLAN.replace(precision="fp8")
    one = estimate(QWEN, work, cluster, fp8)
    four = estimate(QWEN, work, cluster, fp8.replace(micro_batch=4, num_microbatches=2))
    # same tokens per step; fewer micro-batches pay the weight traffic and launches fewer times
    assert four.step_time_s["moe_host_bound"] < one.step_time_s["moe_host_bound"] / 3
    assert four.step_time_s["total"] < 0.8 * one.step_time_s["total"]
