"""Quantizing mixture-of-experts models: tiny Mixtral- and DeepSeek-V3-style HF directories
through `llmopt quantize` (RTN, AWQ, GPTQ) and `quantize_model`.

Every routed expert's linears are quantized (the spec's `mlp.experts.*` names), and the
quantized model's logits stay near the fp32 model's. An expert that no calibration token was
routed to has no Hessian (GPTQ) and no activations (AWQ): it is rounded to nearest instead,
listed in the report's `rtn_fallback` and warned of, rather than crashing GPTQ's Cholesky or
leaving NaN statistics. (AWQ scales no expert inputs: the MoE specs name no expert scaling
groups, so AWQ's experts get its clipping search only.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmopt.compress.quant.apply import quant_linears, quantize_model
from llmopt.models.loading import load_model
from llmopt.models.packed.metadata import compression_metadata
from tests.finetune_fixtures import small_tokenizer
from tests.model_parity import save_tiny_hf
from tests.paths import REPO

ROOT = REPO
ARCHS = ("mixtral", "deepseek_v3")
EXPERTS = 8
PROJ = ("gate_proj", "up_proj", "down_proj")


def _hf_config(arch: str, vocab: int):
    import transformers as tf

    common = dict(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    if arch == "mixtral":
        return tf.MixtralConfig(
            **common, intermediate_size=64, num_local_experts=EXPERTS, num_experts_per_tok=2,
            architectures=["MixtralForCausalLM"],
        )  # fmt: skip
    return tf.DeepseekV3Config(  # MLA, a dense first block, shared expert, grouped routing
        **{**common, "num_key_value_heads": 4}, intermediate_size=64, moe_intermediate_size=32,
        n_shared_experts=1, n_routed_experts=EXPERTS, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        architectures=["DeepseekV3ForCausalLM"],
    )  # fmt: skip


@pytest.fixture(scope="module", params=ARCHS)
def moe_dir(request, tmp_path_factory) -> tuple[str, Path]:
    """A tiny random HF MoE directory with a (small) tokenizer, so the CLI can calibrate."""
    directory = tmp_path_factory.mktemp(request.param)
    tokenizer = small_tokenizer()
    save_tiny_hf(_hf_config(request.param, tokenizer.vocab_size), directory)
    tokenizer.save(directory)
    return request.param, directory


def _moe_blocks(model) -> dict[int, torch.nn.Module]:
    return {i: b.mlp for i, b in enumerate(model.layers) if hasattr(b.mlp, "experts")}


def _expert_linears(model) -> set[str]:
    return {
        f"layers.{i}.mlp.experts.{e}.{p}"
        for i in _moe_blocks(model)
        for e in range(EXPERTS)
        for p in PROJ
    }


def _ids(vocab: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def _unrouted(model, ids: torch.Tensor) -> set[str]:
    """Expert linears of the fp model that `ids` routes no token to."""
    rows: dict[tuple[int, int], int] = {}
    hooks = []
    for i, moe in _moe_blocks(model).items():
        for e, expert in moe.experts.items():

            def hook(_m, args, key=(i, int(e))):
                rows[key] = rows.get(key, 0) + args[0].shape[0]

            hooks.append(expert.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return {f"layers.{i}.mlp.experts.{e}.{p}" for (i, e), n in rows.items() if n == 0 for p in PROJ}


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_experts_quantized_and_logits_close_to_fp32(moe_dir, method):
    _, directory = moe_dir
    model = load_model(directory, dtype=torch.float32)
    vocab = model.config.vocab_size
    calib = _ids(vocab, 8, 64, seed=0)  # 1024 tokens: every expert gets some
    assert not _unrouted(model, calib)
    held_out = _ids(vocab, 2, 48, seed=1)
    with torch.no_grad():
        ref = model(held_out)
        rtn = quantize_model(model, "rtn", bits=4, group_size=32)(held_out)
        q8 = quantize_model(model, method, bits=8, group_size=32, calib_tokens=calib)
        q4 = quantize_model(model, method, bits=4, group_size=32, calib_tokens=calib)
        err8, err4 = _rel_err(q8(held_out), ref), _rel_err(q4(held_out), ref)
    assert _expert_linears(model) <= set(quant_linears(q4))  # every expert's linears
    assert compression_metadata(q4).quant_report["rtn_fallback"] == []
    rtn_err = _rel_err(rtn, ref)
    assert err8 < 1e-2, err8  # 8 bits: close to fp32 (routing near a tie may flip)
    # 4 bits: better than round-to-nearest on held-out tokens (tiny random weights: RTN ~7%)
    assert err4 < 0.08 and err4 < rtn_err, (err4, rtn_err)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_unrouted_experts_fall_back_to_rtn(moe_dir, method):
    _, directory = moe_dir
    model = load_model(directory, dtype=torch.float32)
    calib = _ids(model.config.vocab_size, 1, 3, seed=2)  # 6 top-2 picks: experts left out
    unrouted = _unrouted(model, calib)
    assert unrouted
    with pytest.warns(UserWarning, match="saw no calibration tokens"):
        q = quantize_model(model, method, bits=4, group_size=32, calib_tokens=calib)
    fallback = set(compression_metadata(q).quant_report["rtn_fallback"])
    if method == "awq":  # AWQ feeds every block full-precision inputs: the fp routing exactly
        assert fallback == unrouted
    else:  # GPTQ feeds quantized outputs on: later routing may differ, not the first block
        first = min(_moe_blocks(model))
        prefix = f"layers.{first}."
        assert {n for n in fallback if n.startswith(prefix)} == {
            n for n in unrouted if n.startswith(prefix)
        }
        assert fallback <= _expert_linears(model)
    # a fallback expert is exactly RTN; nothing is NaN
    rtn = quant_linears(quantize_model(model, "rtn", bits=4, group_size=32))
    ql = quant_linears(q)
    for name in fallback:
        torch.testing.assert_close(ql[name].dequantize(), rtn[name].dequantize())
    with torch.no_grad():
        assert torch.isfinite(q(_ids(model.config.vocab_size, 1, 16, seed=3))).all()


def _quantize_cli(directory: Path, out: Path, method: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = ["quantize", "--model", str(directory), "--method", method, "--bits", "4",
            "--group-size", "32", "--calib", "corpus:web-bible", "--calib-samples", "8",
            "--calib-seq-len", "64", "--out", str(out), "--json"]  # fmt: skip
    return subprocess.run([sys.executable, "-m", "llmopt", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("method", ["rtn", "awq", "gptq"])
def test_llmopt_quantize_cli_writes_a_moe_model_that_loads(moe_dir, tmp_path, method):
    _, directory = moe_dir
    run = _quantize_cli(directory, tmp_path / "q", method)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["method"] == method
    model = load_model(directory, dtype=torch.float32)
    quantized = load_model(tmp_path / "q", dtype=torch.float32)
    assert _expert_linears(model) <= set(quant_linears(quantized))
    ids = _ids(model.config.vocab_size, 2, 32, seed=4)
    with torch.no_grad():
        err = _rel_err(quantized(ids), model(ids))
    assert err < 0.15, err
