"""Phi-3 through the model spec: fused qkv_proj / gate_up_proj checkpoint tensors split at load
and fused at save, Phi-3-mini-4k's sliding window; longrope/su scaling refused."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.models import ConfigError, ModelConfig
from llmopt.models.hf import from_hf_layout
from llmopt.models.loading import load_model, save_pretrained
from tests.model_parity import check_parity, save_tiny_hf

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    original_max_position_embeddings=64,
    sliding_window=10,  # shorter than the 24-token test sequences: the window matters
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _hf_config(**changes):
    from transformers import Phi3Config

    return Phi3Config(**{**TINY, **changes}, architectures=["Phi3ForCausalLM"])


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("phi3")
    return save_tiny_hf(_hf_config(), directory), directory


def test_logits_and_greedy_match_transformers(phi3_dir):
    ref, directory = phi3_dir
    check_parity(ref, directory, TINY["vocab_size"])


def test_fused_tensors_are_split_into_the_spec_linears(phi3_dir):
    ref, directory = phi3_dir
    ours = load_model(directory)
    assert (ours.config.architecture, ours.config.sliding_window) == ("phi3", 10)
    hf_attn = ref.model.layers[1].self_attn
    q, k, v = torch.split(hf_attn.qkv_proj.weight, [64, 32, 32])
    block = ours.layers[1]
    assert torch.equal(block.self_attn.q_proj.weight, q)
    assert torch.equal(block.self_attn.v_proj.weight, v)
    gate, up = ref.model.layers[1].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(block.mlp.gate_proj.weight, gate) and torch.equal(
        block.mlp.up_proj.weight, up
    )
    assert ours.config.num_parameters() == sum(p.numel() for p in ref.parameters())


def test_save_pretrained_writes_the_fused_layout(phi3_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    _, directory = phi3_dir
    ours = load_model(directory)
    save_pretrained(ours, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.arange(24).view(1, 24) % TINY["vocab_size"]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), again(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_fused_tensor_of_the_wrong_size_is_refused(phi3_dir):
    cfg = load_model(phi3_dir[1]).config
    bad = [("layers.0.self_attn.qkv_proj.weight", torch.zeros(100, 64))]
    with pytest.raises(ValueError, match=r"has 100 rows; the config implies 64 \+ 32 \+ 32"):
        list(from_hf_layout(bad, cfg))


def test_longrope_and_partial_rotary_are_refused():
    hf = _hf_config().to_dict()
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "rope_theta": 10000.0,
    }
    with pytest.raises(ConfigError, match="rope_scaling type 'longrope' is not supported"):
        ModelConfig.from_hf_config({**hf, "rope_parameters": longrope})
    legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
    su = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with pytest.raises(ConfigError, match="rope_scaling type 'su' is not supported"):
        ModelConfig.from_hf_config({**legacy, "rope_scaling": su})
    partial = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5 is not supported"):
        ModelConfig.from_hf_config({**hf, "rope_parameters": partial})


def test_transformers_4_key_spelling_reads_the_same_config(phi3_dir):
    hf5 = json.loads((phi3_dir[1] / "config.json").read_text())
    hf4 = {k: v for k, v in hf5.items() if k != "rope_parameters"}
    hf4 |= {"rope_theta": 10000.0, "rope_scaling": None}
    assert ModelConfig.from_hf_config(hf4) == ModelConfig.from_hf_config(hf5)


def test_fast_decode_serves_phi3_with_its_window(phi3_dir):
    from llmopt.infer.fast import FastDecoder

    ours = load_model(phi3_dir[1])
    ids = list(range(3, 17))  # longer than the window of 10
    with torch.no_grad():
        want = ours(torch.tensor([ids]))[0, -1]
    torch.testing.assert_close(FastDecoder(ours, 20).prefill(ids), want, rtol=0, atol=1e-4)
