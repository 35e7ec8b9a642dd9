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


def test_mtp_modules_load_the_last_pipeline_stage():
    """Megatron-Core places DeepSeek-V3's MTP module on the last stage with the output layer
    (Megatron-Bridge v0.2.1 recipes/deepseek/deepseek_v3.py: ["mtp"] * n + ["loss"] last): one
    more block, its 2h->h projection and the output layer again, priced there."""
    import dataclasses

    from llmopt.models.moe import attention_params, mlp_params, mtp_block_params
    from llmopt.plan.split import head_units, rank_layers

    ds = get_preset("deepseek-v3")
    no = ds.replace(moe=dataclasses.replace(ds.moe, mtp_layers=0))
    assert ds.moe.mtp_layers == 1
    mp = mlp_params(ds)
    block = attention_params(ds) + mp["dense"] + mp["active"] + mp["shared"] + mp["router"]
    head = ds.hidden_size * ds.vocab_size
    assert head_units(no) == pytest.approx(head / block, rel=1e-12)
    assert head_units(ds) == pytest.approx((2 * head + mtp_block_params(ds)) / block, rel=1e-12)
    # the heavier last stage holds fewer layers; the others no more than ceil(61/16), as in
    # NVIDIA's own layout for this mapping (E+4 | 4 x 14 | 1+mtp+loss)
    assert [int(x) for x in rank_layers(no, 16, 1)] == [3, 4, 2]
    assert [int(x) for x in rank_layers(ds, 16, 1)] == [4, 4, 1]

    # on 32 stages (2 layers each) the last holds no layer, only the MTP module and two heads,
    # and is the busiest stage
    assert [int(x) for x in rank_layers(ds, 32, 1)] == [1, 2, 0]
    cluster = get_cluster("dgx-b200", 64)
    work = Workload(seq_len=4096, global_batch=1024, precision="fp8")
    plan = ParallelPlan(tp=1, pp=32, dp=16, ep=8, micro_batch=1, num_microbatches=64,
                        zero_stage=1, precision="fp8")  # fmt: skip
    with_mtp = estimate(ds, work, cluster, plan).step_time_s
    without = estimate(no, work, cluster, plan).step_time_s
    assert with_mtp["compute"] > 1.3 * without["compute"]
    assert with_mtp["total"] > 1.1 * without["total"]
    parts = sum(v for k, v in with_mtp.items() if k != "total")
    assert parts == pytest.approx(with_mtp["total"], rel=1e-9)
    dense = get_preset("llama-3-70b")  # no MTP: the output layer alone
    dmp = mlp_params(dense)
    dblock = attention_params(dense) + dmp["dense"] + dmp["active"] + dmp["shared"] + dmp["router"]
    assert head_units(dense) == pytest.approx(dense.hidden_size * dense.vocab_size / dblock)
