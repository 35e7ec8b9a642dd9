"""Qwen3 through the model spec: per-head q/k RMSNorm before RoPE, head_dim decoupled from
hidden / heads, no q/k/v bias; HF parity, config refusals, GGUF round trip."""

from __future__ import annotations

import pytest
import torch

from llmopt.models import ConfigError, ModelConfig, get_spec
from llmopt.models.loading import load_model
from tests.model_parity import check_parity, check_save_round_trip, save_tiny_hf

TINY = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # 4 x 16 = 64 != hidden 48
    max_position_embeddings=64,
    rope_theta=1_000_000.0,
    tie_word_embeddings=False,
)


def _hf_config(**changes):
    from transformers import Qwen3Config

    return Qwen3Config(**{**TINY, **changes}, architectures=["Qwen3ForCausalLM"])


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    return save_tiny_hf(_hf_config(), directory), directory


def test_logits_and_greedy_match_transformers(qwen3_dir):
    ref, directory = qwen3_dir
    check_parity(ref, directory, TINY["vocab_size"])


def test_config_reads_the_decoupled_head_dim_and_counts_the_qk_norms(qwen3_dir):
    ref, directory = qwen3_dir
    cfg = load_model(directory).config
    assert (cfg.architecture, cfg.head_dim, cfg.q_size, cfg.attention_bias) == (
        "qwen3",
        16,
        64,
        False,
    )
    assert cfg.num_parameters() == sum(p.numel() for p in ref.parameters())


def test_save_pretrained_round_trips_through_transformers(qwen3_dir, tmp_path):
    _, directory = qwen3_dir
    check_save_round_trip(directory, tmp_path / "out", TINY["vocab_size"])


def test_math_changing_keys_are_refused():
    hf = _hf_config().to_dict()
    with pytest.raises(ConfigError, match="attention_bias=True is not supported for Qwen3"):
        ModelConfig.from_hf_config({**hf, "attention_bias": True})
    with pytest.raises(ConfigError, match="use_sliding_window=True"):
        ModelConfig.from_hf_config({**hf, "use_sliding_window": True, "sliding_window": 8})
    with pytest.raises(ConfigError, match="hidden_act='gelu' is not supported for Qwen3"):
        ModelConfig.from_hf_config({**hf, "hidden_act": "gelu"})


def test_transformers_4_key_spelling_reads_the_same_config():
    hf5 = _hf_config().to_dict()
    hf4 = {k: v for k, v in hf5.items() if k not in ("rope_parameters", "layer_types")}
    hf4 |= {"rope_theta": 1_000_000.0, "rope_scaling": None, "torch_dtype": "float32"}
    assert ModelConfig.from_hf_config(hf4) == ModelConfig.from_hf_config(hf5)


def test_gguf_round_trip_keeps_the_qk_norms(qwen3_dir, tmp_path):
    from llmopt.export import export_gguf

    _, directory = qwen3_dir
    ours = load_model(directory)
    assert get_spec("qwen3").gguf_architectures == ("qwen3",)
    path = export_gguf(ours, tmp_path / "tiny.gguf", qtype="f32")
    back = load_model(path)
    ids = torch.arange(20).view(1, 20) % TINY["vocab_size"]
    with torch.no_grad():
        torch.testing.assert_close(back(ids), ours(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.dist
def test_tensor_parallel_gradients_of_the_qk_norms_equal_the_unsharded_model():
    from tests.dist_helpers import run_distributed
    from tests.model_parity import tp_gradient_errors

    for errors in run_distributed(tp_gradient_errors, 2, "qwen3", timeout_s=180):
        assert set(errors) == {"sp=False", "sp=True"}
        assert max(errors.values()) < 1e-6, errors
