"""Memory model against published, formula-exact test vectors.

Korthikanti et al. 2022 Fig. 1 (values as listed in llmopt/validate/data/README.md, reproduced from the
paper's formulas) and the ZeRO paper's 7.5B / 64-GPU example. Tolerance: the published figures
are rounded to 2 decimals (Korthikanti, GiB) or 1 decimal (ZeRO, GB), so we compare at that
rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmopt.models import build_model
from llmopt.models.config import ModelConfig
from llmopt.models.presets import get_preset
from llmopt.parallel.pipeline.schedule import build_schedule
from llmopt.parallel.pipeline.simulate import simulate
from llmopt.parallel.plan import ParallelPlan
from llmopt.parallel.recompute import apply_activation_checkpointing
from llmopt.plan.grid import to_grid
from llmopt.plan.hardware import GIB, get_cluster
from llmopt.plan.memory import (
    RC_FULL,
    RC_NONE,
    RC_SELECTIVE,
    activation_bytes_per_layer,
    layers_per_stage,
    memory_breakdown,
    microbatches_in_flight,
    microbatches_in_flight_on_rank,
    model_state_bytes,
    rope_table_bytes,
)
from llmopt.plan.workload import Workload
from llmopt.validate.pipeline_measure import SavedTensorMeter

# name, layers, hidden, heads, pp, micro_batch, virtual stages; t = 8, s = 2048, V = 51200.
KORTHIKANTI = [
    ("22B", 48, 6144, 64, 1, 4, 1, 45.56, 59.25, 9.56),
    ("175B", 96, 12288, 96, 8, 1, 3, 45.56, 66.84, 12.35),
    ("530B", 105, 20480, 128, 35, 1, 3, 31.64, 114.02, 23.08),
    ("1T", 128, 25600, 160, 64, 1, 1, 32.96, 131.25, 26.56),
]


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig(
        name=name,
        vocab_size=51200,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        max_seq_len=2048,
        mlp="gelu",
        tie_embeddings=True,
    )


@pytest.mark.parametrize("row", KORTHIKANTI, ids=[r[0] for r in KORTHIKANTI])
def test_korthikanti_figure1(row):
    name, layers, h, a, p, b, v, states_gib, act_gib, act_sp_sel_gib = row
    model = _gpt(name, layers, h, a)
    # Fig. 1 counts 12·l·h² parameters split over t·p ranks at Megatron's 18 bytes/param.
    states = model_state_bytes(12 * layers * h * h / (8 * p), 0, 1, "megatron")
    assert round(float(sum(states.values())) / GIB, 2) == states_gib
    sched = np.array(2 if v > 1 else 1)
    inflight = microbatches_in_flight(np.array(p), np.array(10**4), np.array(v), sched)
    n_layers = layers_per_stage(model, np.array(p), np.array(v))
    for sp, rc, expected in ((False, RC_NONE, act_gib), (True, RC_SELECTIVE, act_sp_sel_gib)):
        per_layer = activation_bytes_per_layer(
            model, 2048, b, 8, sp, 1, rc, flash_attention=False, dropout=True
        )
        assert round(float(per_layer * n_layers * inflight) / GIB, 2) == expected


def test_korthikanti_closed_forms():
    """sbh(10 + 24/t + 5as/(ht)) without SP, 34sbh/t with SP+selective, 2sbh under full."""
    model = _gpt("x", 4, 1024, 16)
    s, b, h, a, t = 2048, 2, 1024, 16, 4
    sbh = s * b * h
    none = activation_bytes_per_layer(model, s, b, t, False, 1, RC_NONE, False, True)
    assert float(none) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    sel = activation_bytes_per_layer(model, s, b, t, True, 1, RC_SELECTIVE, False, True)
    assert float(sel) == pytest.approx(sbh * 34 / t, rel=1e-12)
    full = activation_bytes_per_layer(model, s, b, t, False, 1, RC_FULL, False, True)
    assert float(full) == pytest.approx(2 * sbh, rel=1e-12)
    full_sp = activation_bytes_per_layer(model, s, b, t, True, 1, RC_FULL, False, True)
    assert float(full_sp) == pytest.approx(2 * sbh / t, rel=1e-12)


def test_zero_paper_figure1():
    """7.5B parameters, 64 GPUs, K=12: 120 / 31.4 / 16.6 / 1.9 GB."""
    states = model_state_bytes(7.5e9, np.arange(4), 64, "zero")
    totals = sum(states.values()) / 1e9
    assert [round(float(x), 1) for x in totals] == [120.0, 31.4, 16.6, 1.9]


def test_zero_stages_in_breakdown_match_formulas():
    """For llama-3-70b on 64 H100, per-rank model states follow 2Ψ+4Ψ+12Ψ/N_d etc."""
    model, cluster, work = get_preset("llama-3-70b"), get_cluster("dgx-h100", 8), Workload()
    base = dict(tp=8, pp=1, dp=8, micro_batch=1, num_microbatches=128, sequence_parallel=True)
    psi = None
    for z in range(4):
        grid = to_grid(ParallelPlan(zero_stage=z, **base))
        mem = memory_breakdown(model, work, cluster, grid)
        if psi is None:
            psi = float(mem["params"][0]) / 2  # parameters per TP rank
            assert psi == pytest.approx(model.num_parameters() / 8, rel=0.01)
        d = 8
        assert float(mem["params"][0]) == pytest.approx(2 * psi / (d if z >= 3 else 1))
        assert float(mem["grads"][0]) == pytest.approx(4 * psi / (d if z >= 2 else 1))
        assert float(mem["optimizer"][0]) == pytest.approx(12 * psi / (d if z >= 1 else 1))


def test_pipeline_in_flight_rules():
    p, m = np.array(8), np.array(32)
    assert microbatches_in_flight(p, m, np.array(1), np.array(0)) == 32  # GPipe holds all
    assert microbatches_in_flight(p, m, np.array(1), np.array(1)) == 8  # 1F1B holds p
    assert microbatches_in_flight(p, np.array(4), np.array(1), np.array(1)) == 4  # m < p
    assert microbatches_in_flight(p, m, np.array(4), np.array(2)) == pytest.approx(8 + 7 / 4)


def test_flash_attention_drops_quadratic_terms():
    model = get_preset("llama-3-8b")
    flash = activation_bytes_per_layer(model, 8192, 1, 1, False, 1, RC_NONE, True, False)
    plain = activation_bytes_per_layer(model, 8192, 1, 1, False, 1, RC_NONE, False, False)
    # Without flash the softmax output (2 bytes · heads · s² per sequence) is kept.
    assert float(plain - flash) == pytest.approx(8192 * (2 * 32 * 8192 - 4 * 32), rel=1e-12)


def test_memory_fits_flag_and_total():
    model, cluster, work = get_preset("llama-3-70b"), get_cluster("dgx-h100", 8), Workload()
    fits = to_grid(ParallelPlan(tp=8, pp=8, dp=1, sequence_parallel=True, num_microbatches=1024))
    nofit = to_grid(ParallelPlan(tp=1, pp=1, dp=64, micro_batch=16, num_microbatches=1))
    mem = memory_breakdown(model, work, cluster, {**fits})
    assert bool(mem["fits"][0])
    parts = sum(float(mem[k][0]) for k in ("params", "grads", "optimizer", "activations", "other"))
    assert float(mem["total"][0]) == pytest.approx(parts)
    assert not bool(memory_breakdown(model, work, cluster, nofit)["fits"][0])


@pytest.mark.parametrize(
    "name,pp,m,v",
    [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 3, 1), ("interleaved", 4, 8, 2),
     ("interleaved", 4, 4, 2), ("interleaved", 2, 2, 2), ("interleaved", 8, 16, 4),
     ("interleaved", 2, 3, 2), ("interleaved", 4, 9, 2), ("interleaved", 4, 10, 2),
     ("interleaved", 2, 3, 3), ("interleaved", 4, 5, 2), ("interleaved", 8, 21, 3)],
)  # fmt: skip
def test_in_flight_per_rank_equals_simulated_schedule(name, pp, m, v):
    """The planner's per-rank peak equals the peak (micro-batch, chunk) activations the engine's
    own schedule holds when simulated (in chunk units: ×v), including interleaved schedules
    whose m is not a multiple of pp (an enlarged last group)."""
    sim = simulate(build_schedule(name, pp, m, v))
    code = {"gpipe": 0, "1f1b": 1, "interleaved": 2}[name]
    for rank in range(pp):
        planned = microbatches_in_flight_on_rank(
            np.array(pp), np.array(m), np.array(v), np.array(code), rank
        )
        assert float(planned) * v == sim.peak_in_flight[rank], rank


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eager_activation_model_equals_saved_tensors(recompute, dtype):
    """The "eager" kernel mode counts exactly what autograd saves in one process's blocks
    (saved-tensor hooks, one count per storage) for bf16 and fp32, every recompute mode."""
    cfg = ModelConfig(
        name="tiny", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2,
        num_heads=6, num_kv_heads=2, max_seq_len=32,
    )  # fmt: skip
    b, s = 3, 12
    model = apply_activation_checkpointing(build_model(cfg, seed=0, dtype=dtype), recompute)
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(list(model.parameters()), only_inside=list(model.layers)) as meter:
        model(tokens).float().sum().backward()
    act = 2 if dtype == torch.bfloat16 else 4
    rc = {"none": RC_NONE, "selective": RC_SELECTIVE, "full": RC_FULL}[recompute]
    per_layer = activation_bytes_per_layer(
        cfg, s, b, 1, False, 1, rc, kernels="eager", act_bytes=act
    )
    # The model's RoPE tables were cast with it: its slices are views of the whole table.
    expected = cfg.num_layers * float(per_layer) + rope_table_bytes(cfg, cfg.max_seq_len, act)
    assert meter.peak == expected


def test_kernel_mode_errors_and_default_unchanged():
    model = get_preset("llama-3-8b")
    fused = activation_bytes_per_layer(model, 4096, 1, 8, True, 1, RC_NONE)
    assert float(fused) == float(
        activation_bytes_per_layer(model, 4096, 1, 8, True, 1, RC_NONE, kernels="fused")
    )
    eager = activation_bytes_per_layer(model, 4096, 1, 8, True, 1, RC_NONE, kernels="eager")
    assert float(eager) > float(fused)
    with pytest.raises(ValueError, match="kernels='cuda'; choose from fused, eager"):
        activation_bytes_per_layer(model, 4096, 1, 8, True, kernels="cuda")
    with pytest.raises(ValueError, match="act_bytes=4 needs 'eager'"):
        activation_bytes_per_layer(model, 4096, 1, 8, True, act_bytes=4)
