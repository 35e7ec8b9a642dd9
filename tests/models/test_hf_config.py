"""Directories transformers itself wrote (v5 `rope_parameters`, legacy v4 keys, llama3 RoPE
scaling, generation_config EOS lists, saved inv_freq buffers) load into llmopt with transformers'
logits and perplexity; settings llmopt does not implement are refused, never ignored."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmopt.data.corpus import load_text
from llmopt.eval.perplexity import perplexity
from llmopt.models import ModelConfig
from llmopt.models.config import ConfigError
from llmopt.models.loading import load_model, load_tokenizer, save_pretrained

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _hf_llama(tmp_path, name: str, eos=2, **overrides):
    """A tiny LlamaForCausalLM saved by transformers' own save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)  # transformers edits a rope_scaling dict in place: pass copies
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    model.generation_config.eos_token_id = eos
    out = tmp_path / name
    model.save_pretrained(out)
    return model, out


def _tokens(n: int = 96, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(3))


def _assert_same_model(ref, ours, tokens) -> None:
    with torch.no_grad():
        out = ref(tokens, labels=tokens)
        logits = ours(tokens)
    torch.testing.assert_close(logits, out.logits, atol=1e-4, rtol=1e-4)
    ref_ppl = math.exp(out.loss.item())
    ppl = perplexity(ours, tokens[0], ctx=tokens.shape[1], stride=tokens.shape[1]).ppl
    assert ppl == pytest.approx(ref_ppl, rel=1e-3)


def test_smollm2_like_directory_written_by_transformers_5(tmp_path):
    ref, out = _hf_llama(tmp_path, "smol", rope_theta=100000.0, tie_word_embeddings=True)
    hf = json.loads((out / "config.json").read_text())
    assert "rope_theta" not in hf and hf["rope_parameters"]["rope_theta"] == 100000.0
    ours = load_model(out)
    assert ours.config.rope_theta == 100000.0 and ours.config.rope_scaling is None
    assert ours.config.tie_embeddings
    _assert_same_model(ref, ours, _tokens())


def test_llama3_rope_scaling_and_eos_list(tmp_path):
    ref, out = _hf_llama(
        tmp_path, "l3", eos=[2, 7, 9], rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING)
    )
    ours = load_model(out)
    assert ours.config.rope_scaling == LLAMA3_SCALING
    assert ours.config.stop_token_ids == (2, 7, 9) and ours.config.eos_token_id == 2
    tokens = _tokens(96)  # longer than original_max_position_embeddings: the scaling matters
    _assert_same_model(ref, ours, tokens)
    # the test can fail: without the scaling the logits differ by 10x the parity tolerance
    hf = json.loads((out / "config.json").read_text())
    hf["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    (out / "config.json").write_text(json.dumps(hf))
    with torch.no_grad():
        assert (load_model(out)(tokens) - ref(tokens).logits).abs().max() > 1e-3


def test_llmopt_saved_llama3_directory_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    ref, out = _hf_llama(tmp_path, "l3", rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING))
    ours = load_model(out)
    save_pretrained(ours, tmp_path / "again")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    tokens = _tokens(64)
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ref(tokens).logits, atol=1e-5, rtol=1e-5)


def test_transformers_4_layout_reads_the_same(tmp_path):
    _, out = _hf_llama(tmp_path, "l3", rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING))
    v5 = json.loads((out / "config.json").read_text())
    legacy = {k: v for k, v in v5.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"}
    legacy.update(rope_theta=500000.0, rope_scaling={"type": "llama3", **scaling})
    new, old = ModelConfig.from_hf_config(v5), ModelConfig.from_hf_config(legacy)
    assert old == new and old.rope_theta == 500000.0
    legacy.pop("rope_scaling")
    legacy.pop("rope_theta")
    assert ModelConfig.from_hf_config(legacy).rope_theta == 10000.0  # HF's own default


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn"}}, "'yarn' is not supported"),
        ({"rope_parameters": {"rope_theta": float("nan")}}, "rope_theta=nan must be a finite"),
        ({"rope_theta": 5e5}, "rope_theta=500000.0 contradicts rope_parameters"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope_scaling lacks"),
        ({"rope_parameters": {"rope_type": "default", "factor": 2.0}}, "takes no scaling keys"),
        ({"layer_types": ["sliding_attention"] * 2}, "layer_types=\\['sliding_attention'\\]"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "one attention kind"),
    ],
)
def test_settings_that_change_the_math_are_refused(tmp_path, change, message):
    _, out = _hf_llama(tmp_path, "m")
    hf = json.loads((out / "config.json").read_text())
    hf.update(change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(hf)


def test_saved_inv_freq_buffers_are_checked_and_skipped(tmp_path):
    from safetensors.torch import load_file, save_file

    ref, out = _hf_llama(tmp_path, "inv", rope_theta=100000.0)
    state = load_file(out / "model.safetensors")
    inv_freq = ref.model.rotary_emb.inv_freq.clone()
    state["model.rotary_emb.inv_freq"] = inv_freq
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()  # transformers 4.3x
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    _assert_same_model(ref, load_model(out), _tokens(32))
    state["model.rotary_emb.inv_freq"] = inv_freq * 2
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="rotary_emb.inv_freq does not match the RoPE"):
        load_model(out)


@pytest.mark.slow
def test_real_smollm2_resaved_by_transformers_keeps_its_perplexity(tmp_path):
    """GGUF -> llmopt -> HF dir -> transformers -> save_pretrained (v5 layout) -> llmopt."""
    from transformers import AutoModelForCausalLM

    gguf_model = load_model("smollm2-135m")
    tokenizer = load_tokenizer("smollm2-135m")
    save_pretrained(gguf_model, tmp_path / "ours", tokenizer)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    hf_model.save_pretrained(tmp_path / "resaved")
    hf = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert "rope_theta" not in hf and hf["rope_parameters"]["rope_theta"] == 100000.0
    resaved = load_model(tmp_path / "resaved")
    assert resaved.config.rope_theta == gguf_model.config.rope_theta == 100000.0
    text = load_text("corpus:web-bible")[20_000:22_000]
    tokens = tokenizer.encode(text)[:256]
    expected = perplexity(gguf_model, tokens, ctx=128, stride=64).ppl
    got = perplexity(resaved, tokens, ctx=128, stride=64).ppl
    assert got == pytest.approx(expected, rel=1e-4)
    assert 2 < got < 30


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families_written_by_transformers(tmp_path, family):
    import transformers

    cls, cfg_cls = {
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
    }[family]
    extra = {"sliding_window": 16} if family == "mistral" else {"use_sliding_window": False}
    config = cfg_cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=1e6,
        **extra,
    )
    torch.manual_seed(1)
    ref = cls(config).eval()
    if family == "qwen2":  # non-zero q/k/v biases, so a dropped bias shows
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    ref.save_pretrained(tmp_path / family)
    ours = load_model(tmp_path / family)
    assert ours.config.architecture == family and ours.config.rope_theta == 1e6
    assert ours.config.sliding_window == (16 if family == "mistral" else None)
    _assert_same_model(ref, ours, _tokens(48))  # 48 > the window: the window matters
