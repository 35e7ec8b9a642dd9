"""Hardware presets: audited datasheet figures, and every preset plans a job."""

from __future__ import annotations

import pytest

from llmopt.models.presets import get_preset
from llmopt.plan.catalog import CLUSTER_PRESETS
from llmopt.plan.hardware import get_cluster
from llmopt.plan.search import search
from llmopt.plan.workload import Workload

# preset -> (HBM GiB the planner uses, dense bf16 TFLOPS, dense fp8 TFLOPS, HBM GB/s,
#            scale-up GB/s per direction, GPUs per scale-up domain); see catalog.py's table
AUDITED = {
    "dgx-a100-40gb": (39.6, 312, None, 1555, 300, 8),
    "dgx-a100-80gb": (79.2, 312, None, 2039, 300, 8),
    "dgx-h100": (79.2, 989, 1979, 3350, 450, 8),
    "h100-pcie": (79.2, 756, 1513, 2000, 64, 8),
    "dgx-h800": (79.2, 989, 1979, 3350, 200, 8),
    "dgx-h200": (139.6, 989, 1979, 4800, 450, 8),
    "dgx-b200": (178.2, 2250, 4500, 8000, 900, 8),
    "gb200-nvl72": (184.1, 2500, 5000, 8000, 900, 72),
    "mi300x": (190.1, 1307, 2615, 5300, 448, 8),
}


def test_every_preset_is_audited():
    assert set(CLUSTER_PRESETS) == set(AUDITED)


@pytest.mark.parametrize("name", sorted(AUDITED))
def test_preset_figures_match_the_audit(name):
    c = get_cluster(name, nodes=2)
    hbm, bf16, fp8, hbm_bw, link, per_node = AUDITED[name]
    g = c.gpu
    assert (g.hbm_gib, g.peak_bf16_tflops, g.peak_fp8_tflops) == (hbm, bf16, fp8)
    assert (g.hbm_bandwidth_gbs, c.intra_node.bandwidth_gbs, c.gpus_per_node) == (
        hbm_bw,
        link,
        per_node,
    )
    assert c.num_gpus == 2 * per_node


def test_hbm_is_the_quoted_capacity_not_a_decimal_conversion():
    # 141 GB and 180 GB boards: the driver reports ~140 / ~179 GiB, not 131 / 167
    assert get_cluster("h200").gpu.hbm_gib > 139
    assert get_cluster("b200").gpu.hbm_gib > 178
    assert get_cluster("mi300x").gpu.hbm_gib > 190


def test_nvl72_keeps_tensor_parallelism_on_nvlink_across_the_rack():
    model = get_preset("llama-3.1-405b")
    c = get_cluster("gb200-nvl72", nodes=1)
    top = search(model, Workload(seq_len=8192, global_batch=144), c, top_k=1).plans[0]
    assert top.fits and top.comm_bytes["inter_node"] == 0.0


@pytest.mark.parametrize("name", sorted(AUDITED))
def test_every_preset_plans_a_job(name):
    result = search(get_preset("llama-3-8b"), Workload(), get_cluster(name, nodes=1), top_k=1)
    assert result.plans[0].fits and result.valid > 0
