"""A MoE model end to end on one process: `llmopt train` on real text (the loss falls over 50
steps, routing statistics in every step record), then `llmopt quantize` of its HF export with
the experts' linears quantized."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.cli import main as cli_main
from llmopt.compress.quant.apply import quant_linears
from llmopt.models.experts import MoE
from llmopt.models.loading import load_model
from llmopt.train.config import TrainConfig, TrainConfigError
from llmopt.train.trainer import model_config, train

SHAPE = dict(
    model="mixtral-8x7b",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=49152,  # the run's tokenizer (SmolLM2's)
    num_experts=4,
    expert_ffn_hidden=128,
)
STEPS, SEQ, BATCH = 50, 64, 8


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-run")
    cfg = TrainConfig().replace(
        **SHAPE,
        moe_aux_loss_coef=0.01,
        moe_z_loss_coef=1e-3,
        steps=STEPS,
        seq_len=SEQ,
        global_batch=BATCH,
        micro_batch=4,
        lr=3e-3,
        warmup_steps=5,
        precision="fp32",
        out_dir=str(out),
        progress=False,
        save_format="both",
    )
    return cfg, train(cfg), out


@pytest.mark.slow
def test_moe_model_trains_on_real_text_with_balance_metrics(trained):
    cfg, result, out = trained
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert first > 10 and last < first - 3, (first, last)  # 10.8 -> 6.5 on the Bible
    records = [json.loads(line) for line in open(out / "train_log.jsonl")]
    steps = [r for r in records if r.get("event") == "step"]
    assert len(steps) == STEPS
    for r in steps:
        # every token's top-2 assignments of both MoE blocks, counted once
        assert sum(r["moe_tokens_per_expert"]) == BATCH * SEQ * 2 * 2
        assert r["moe_max_imbalance"] >= r["moe_imbalance"] >= 1.0
        assert r["moe_dropped_fraction"] == 0.0  # dropless
        assert 0.9 < r["moe_aux_loss"] < 4.0 and r["moe_z_loss"] > 0
    assert steps[-1]["moe_z_loss"] < steps[0]["moe_z_loss"]  # the z-loss pulls logits in


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_llmopt_quantize_covers_the_experts(trained, tmp_path, method):
    _, result, _ = trained
    hf = f"{result.checkpoint}/hf"
    out = tmp_path / method
    argv = ["quantize", "--model", hf, "--method", method, "--bits", "4", "--group-size", "32"]
    assert (
        cli_main([*argv, "--calib-samples", "8", "--calib-seq-len", "64", "--out", str(out)]) == 0
    )
    base, quantized = load_model(hf), load_model(out)
    names = set(quant_linears(quantized))
    experts = {f"layers.{i}.mlp.experts.{e}.{p}" for i in range(2) for e in range(4)
               for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    assert experts <= names and len(names) == len(experts) + 2 * 4  # + q, k, v, o per block
    assert all(isinstance(b.mlp, MoE) for b in quantized.layers)
    ids = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = base(ids), quantized(ids)
    assert 0 < ((got - ref).norm() / ref.norm()).item() < 0.01  # 4-bit: ~6e-4 here


def test_moe_overrides_need_a_model_with_experts():
    with pytest.raises(
        TrainConfigError, match="--num-experts: model 'smollm2-135m' has no experts"
    ):
        model_config(TrainConfig(num_experts=4))
    with pytest.raises(TrainConfigError, match="top_k=9 exceeds num_experts=4"):
        model_config(TrainConfig().replace(**SHAPE, moe_top_k=9))
    moe = model_config(TrainConfig().replace(**SHAPE, moe_capacity_factor=1.25)).moe
    assert (moe.num_experts, moe.expert_ffn_hidden, moe.capacity_factor) == (4, 128, 1.25)
