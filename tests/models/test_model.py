import pytest
import torch

from llmopt.models import ConfigError, KVCache, ModelConfig, build_model, get_preset
from llmopt.models.presets import PRESETS


def test_kv_cache_decode_matches_full_recompute(tiny_model):
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    full = tiny_model(tokens)
    cache = KVCache.for_model(tiny_model, batch_size=2, max_len=32)
    pieces = [tiny_model(tokens[:, :5], cache)]
    for i in range(5, 9):
        pieces.append(tiny_model(tokens[:, i : i + 1], cache))
    pieces.append(tiny_model(tokens[:, 9:], cache))  # multi-token step on a cached prefix
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)


def test_cache_rollback_then_recompute(tiny_model):
    tokens = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    cache = KVCache.for_model(tiny_model, max_len=16)
    tiny_model(tokens[:, :8], cache)
    cache.rollback(6)
    again = tiny_model(tokens[:, 6:10], cache)
    torch.testing.assert_close(again, tiny_model(tokens)[:, 6:10], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(11)


def test_prompt_longer_than_context_is_rejected(tiny_model):
    with pytest.raises(ValueError, match="exceeds the model context max_seq_len=64"):
        tiny_model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_heads=9, num_kv_heads=4), "num_kv_heads=4 does not divide num_heads=9"),
        (dict(num_heads=7, num_kv_heads=7), "num_heads=7 does not divide hidden_size=64"),
        (dict(vocab_size=0), "vocab_size=0 must be a positive integer"),
        (dict(mlp="relu"), "mlp='relu' is not supported"),
    ],
)
def test_bad_configs_name_the_bad_value(tiny_config, changes, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config.replace(**changes)


def test_parameter_count_matches_module():
    for cfg in (get_preset("smollm2-135m"), get_preset("qwen2.5-0.5b").replace(num_layers=2)):
        model = build_model(cfg.replace(max_seq_len=16), seed=None, device="meta")
        n = sum(p.numel() for p in model.parameters())  # tied weights are counted once
        assert n == cfg.num_parameters()


def test_presets_are_config_only_and_sized_as_published():
    assert abs(get_preset("llama-3.1-405b").num_parameters() / 1e9 - 405.9) < 0.5
    assert abs(get_preset("llama-3-70b").num_parameters() / 1e9 - 70.6) < 0.1
    assert abs(get_preset("llama-2-7b").num_parameters() / 1e9 - 6.74) < 0.01
    assert abs(get_preset("smollm2-135m").num_parameters() / 1e6 - 134.5) < 0.5
    assert len(PRESETS) >= 15
    with pytest.raises(KeyError, match="unknown model preset 'gpt-5'"):
        get_preset("gpt-5")


def test_hf_config_round_trip():
    cfg = ModelConfig(
        name="q",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        attention_bias=True,
        tie_embeddings=False,
        architecture="qwen2",
    )
    back = ModelConfig.from_hf_config(cfg.to_hf_config(), name="q")
    assert back == cfg
    with pytest.raises(ConfigError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
        ModelConfig.from_hf_config(
            {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}
        )
