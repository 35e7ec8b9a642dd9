"""The planner's memory model of LoRA/QLoRA fine-tuning: adapters alone get gradients and
optimizer states, the frozen base is bf16 (INT4 with QLoRA). The adapter count is checked
against what `apply_lora` actually creates."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmopt.cli import main
from llmopt.models import ModelConfig, build_model
from llmopt.models.presets import get_preset
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.grid import to_grid
from llmopt.plan.hardware import get_cluster
from llmopt.plan.memory import adapter_params_per_layer, memory_breakdown
from llmopt.plan.workload import Workload
from llmopt.train.lora import LoraSettings, apply_lora

TINY = ModelConfig(
    name="tiny",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=8,
    num_kv_heads=2,
    max_seq_len=64,
)


def test_adapter_count_matches_apply_lora():
    model = build_model(TINY, seed=0)
    apply_lora(model, LoraSettings(rank=8))
    trained = sum(p.numel() for p in model.parameters())
    assert trained == TINY.num_layers * adapter_params_per_layer(TINY, 8, np.array([1]))[0]


def _states(work: Workload, zero: int = 0) -> dict[str, float]:
    model, cluster = get_preset("llama-3-8b"), get_cluster("dgx-h100", 1)
    plan = ParallelPlan(dp=8, zero_stage=zero, micro_batch=1, num_microbatches=4)
    mem = memory_breakdown(model, work, cluster, to_grid(plan))
    return {k: float(mem[k][0]) for k in ("params", "grads", "optimizer", "total")}


def test_lora_states_only_for_adapters_and_qlora_shrinks_the_base():
    model = get_preset("llama-3-8b")
    full = _states(Workload(seq_len=2048, global_batch=32))
    lora = _states(Workload(seq_len=2048, global_batch=32, lora_rank=16))
    qlora = _states(Workload(seq_len=2048, global_batch=32, lora_rank=16, qlora=True))
    n_adapt = model.num_layers * adapter_params_per_layer(model, 16, np.array([1]))[0]
    assert lora["grads"] == pytest.approx(4 * n_adapt)  # fp32 grads of the adapters only
    assert lora["optimizer"] == pytest.approx(12 * n_adapt)
    assert lora["params"] == pytest.approx(2 * model.num_parameters() + 2 * n_adapt, rel=1e-3)
    assert full["grads"] / lora["grads"] > 100
    # INT4 block linears: ~0.55 B/param instead of 2 (embeddings and head stay bf16)
    assert 0.3 < qlora["params"] / lora["params"] < 0.45
    assert qlora["total"] < lora["total"] < full["total"]
    sharded = _states(Workload(seq_len=2048, global_batch=32, lora_rank=16), zero=1)
    assert sharded["optimizer"] == pytest.approx(lora["optimizer"] / 8)


def test_plan_cli_takes_lora_flags(capsys):
    args = ["plan", "--model", "llama-3-8b", "--cluster", "dgx-h100", "--nodes", "1",
            "--seq-len", "2048", "--global-batch", "32", "--json", "--top-k", "1"]  # fmt: skip
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out)
    assert main([*args, "--lora-rank", "16", "--qlora"]) == 0
    qlora = json.loads(capsys.readouterr().out)
    mem = lambda out: out["plans"][0]["memory_gib"]  # noqa: E731
    assert mem(qlora)["grads"] < mem(full)["grads"] / 100
    assert main([*args, "--qlora"]) == 2
    assert "qlora=True needs lora_rank" in capsys.readouterr().err
