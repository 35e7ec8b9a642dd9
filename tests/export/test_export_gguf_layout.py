"""GGUF export per architecture (names, fused tensors, hyperparameters as llama.cpp's converter
writes them), llama.cpp's Q4_K_M recipe, and the tokenizer metadata (pre-tokenizer by hash,
SentencePiece vocabularies). Loading in llama.cpp itself: benchmarks/gguf_llamacpp.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmopt.export import ExportError, export_gguf
from llmopt.export.gguf.mix import more_bits, tensor_types
from llmopt.models import ModelConfig, build_model
from llmopt.models.gguf import unpermute_rope_rows
from llmopt.models.gguf_names import LLAMA_CPP_ARCH, NOT_EXPORTED
from llmopt.models.spec import registered_architectures
from tests.export_fixtures import smollm_tokenizer

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=64,
)
CONFIGS = {
    "llama": ModelConfig(name="t-llama", **BASE),
    "mistral": ModelConfig(name="t-mistral", **BASE, sliding_window=16, architecture="mistral"),
    "qwen2": ModelConfig(name="t-qwen2", **BASE, attention_bias=True, architecture="qwen2"),
    "qwen3": ModelConfig(name="t-qwen3", **BASE, head_dim=32, architecture="qwen3"),
    "phi3": ModelConfig(name="t-phi3", **BASE, sliding_window=16, architecture="phi3"),
    "gemma2": ModelConfig(
        name="t-gemma2",
        **BASE,
        head_dim=32,
        tie_embeddings=True,
        sliding_window=16,
        full_attention_every=2,
        attn_softcap=50.0,
        final_softcap=30.0,
        query_pre_attn_scalar=32,
        architecture="gemma2",
    ),
}


def tiny(arch: str, **changes) -> torch.nn.Module:
    model = build_model(CONFIGS[arch].replace(**changes), seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases and norms away from their init, so a lost offset shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def read(path):
    from gguf import GGUFReader

    reader = GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    tensors = {
        t.name: np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors
    }
    return fields, tensors


def test_every_registered_architecture_has_a_llama_cpp_name_or_a_stated_refusal():
    assert set(registered_architectures()) == set(LLAMA_CPP_ARCH) | set(NOT_EXPORTED)
    assert not set(LLAMA_CPP_ARCH) & set(NOT_EXPORTED)


@pytest.mark.parametrize("arch", sorted(NOT_EXPORTED))
def test_unexported_architectures_are_refused_by_name_before_writing(tmp_path, arch):
    from llmopt.models.moe import MLAConfig, MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden=24)
    mla = MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    latent = {"mla": mla} if arch == "deepseek_v3" else {}
    config = ModelConfig(name=f"t-{arch}", **BASE, architecture=arch, moe=moe, **latent)
    model = build_model(config, seed=0).eval()
    with pytest.raises(ExportError, match=f"GGUF export of '{arch}' is not supported"):
        export_gguf(model, tmp_path / "m.gguf", qtype="f32")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_layout_matches_llama_cpp_converter(tmp_path, arch):
    """F32 export, read back raw: every tensor is our weight under llama.cpp's name and
    layout (permuted Q/K rows for llama/mistral, Phi-3's fused q|k|v and gate|up)."""
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

    model = tiny(arch)
    fields, tensors = read(export_gguf(model, tmp_path / "m.gguf", qtype="f32"))
    name = LLAMA_CPP_ARCH[arch]
    assert fields["general.architecture"] == name
    allowed = {
        TENSOR_NAMES[t].format(bid=i)
        for key, n in MODEL_ARCH_NAMES.items()
        if n == name
        for t in MODEL_TENSORS[key]
        for i in range(2)
    }
    assert {n.rsplit(".", 1)[0] for n in tensors} <= allowed
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    q, k = tensors["blk.1.attn_q.weight"] if arch != "phi3" else None, None
    if arch == "phi3":
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = tensors["blk.1.attn_qkv.weight"]
        q, k = qkv[:q_rows], qkv[q_rows : q_rows + kv_rows]
        assert np.array_equal(qkv[q_rows + kv_rows :], state["layers.1.self_attn.v_proj.weight"])
        gate_up = tensors["blk.1.ffn_up.weight"]
        assert np.array_equal(
            gate_up[: cfg.intermediate_size], state["layers.1.mlp.gate_proj.weight"]
        )
        assert np.array_equal(
            gate_up[cfg.intermediate_size :], state["layers.1.mlp.up_proj.weight"]
        )
        assert "blk.1.ffn_gate.weight" not in tensors
    else:
        k = tensors["blk.1.attn_k.weight"]
        assert np.array_equal(
            tensors["blk.1.ffn_gate.weight"], state["layers.1.mlp.gate_proj.weight"]
        )
    if arch in ("llama", "mistral"):  # llama.cpp's RoPE wants the rows interleaved
        q, k = unpermute_rope_rows(q, cfg.num_heads), unpermute_rope_rows(k, cfg.num_kv_heads)
    assert np.array_equal(q, state["layers.1.self_attn.q_proj.weight"])
    assert np.array_equal(k, state["layers.1.self_attn.k_proj.weight"])
    assert np.array_equal(tensors["token_embd.weight"], state["embed_tokens.weight"])
    assert np.array_equal(tensors["output_norm.weight"], state["norm.weight"])
    if arch == "gemma2":  # our norms already hold w + 1, which is what llama.cpp multiplies by
        for ours, theirs in [
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"),
            ("post_feedforward_layernorm", "post_ffw_norm"),
        ]:
            assert np.array_equal(
                tensors[f"blk.0.{theirs}.weight"], state[f"layers.0.{ours}.weight"]
            )
        assert "output.weight" not in tensors
        assert fields["gemma2.attn_logit_softcapping"] == 50.0
        assert fields["gemma2.final_logit_softcapping"] == 30.0
        assert fields["gemma2.attention.sliding_window"] == 16
        assert fields["gemma2.attention.key_length"] == 32
    else:
        assert np.array_equal(
            tensors["blk.0.ffn_norm.weight"], state["layers.0.post_attention_layernorm.weight"]
        )
    if arch == "qwen2":
        assert np.array_equal(tensors["blk.0.attn_q.bias"], state["layers.0.self_attn.q_proj.bias"])
    if arch == "qwen3":
        assert np.array_equal(
            tensors["blk.0.attn_k_norm.weight"], state["layers.0.self_attn.k_norm.weight"]
        )
        assert fields["qwen3.attention.key_length"] == 32
    if arch == "phi3":
        assert fields["phi3.attention.sliding_window"] == 16
    assert fields[f"{name}.block_count"] == 2
    assert fields[f"{name}.attention.head_count_kv"] == 2


def test_llama3_rope_rescaling_is_written_as_rope_freqs(tmp_path):
    from llmopt.models.layers import rope_frequencies

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    model = tiny("llama", rope_scaling=scaling, rope_theta=500000.0)
    _, tensors = read(export_gguf(model, tmp_path / "r.gguf", qtype="f32"))
    base = rope_frequencies(model.config.replace(rope_scaling=None))
    divisors = tensors["rope_freqs.weight"]
    # llama.cpp divides each base frequency by its factor: the result is our scaled frequency
    assert np.allclose(base.numpy() / divisors, rope_frequencies(model.config).numpy(), rtol=1e-6)
    assert divisors.max() == 8.0 and 1.0 <= divisors.min() < 8.0  # low frequencies / factor


def test_what_llama_cpp_cannot_compute_is_refused(tmp_path):
    with pytest.raises(
        ExportError,
        match=r"scales queries by 1/sqrt\(32\); this model's query_pre_attn_scalar is 24",
    ):
        export_gguf(tiny("gemma2", query_pre_attn_scalar=24), tmp_path / "g.gguf")
    with pytest.raises(ExportError, match="alternates sliding and full attention every 2 layers"):
        export_gguf(tiny("gemma2", full_attention_every=3), tmp_path / "g.gguf")
    with pytest.raises(ExportError, match="ties the output head"):
        export_gguf(tiny("gemma2", tie_embeddings=False), tmp_path / "g.gguf")
    assert not (tmp_path / "g.gguf").exists()


def _shapes(layers: int, hidden: int, tied: bool, fused: bool = False) -> dict:
    shapes = {"token_embd.weight": (1000, hidden)}
    for i in range(layers):
        shapes[f"blk.{i}.attn_norm.weight"] = (hidden,)
        if fused:
            shapes[f"blk.{i}.attn_qkv.weight"] = (3 * hidden, hidden)
        else:
            for part in ("q", "k", "v"):
                shapes[f"blk.{i}.attn_{part}.weight"] = (hidden, hidden)
        shapes[f"blk.{i}.attn_output.weight"] = (hidden, hidden)
        shapes[f"blk.{i}.ffn_up.weight"] = (4 * hidden, hidden)
        shapes[f"blk.{i}.ffn_down.weight"] = (hidden, 4 * hidden)
    shapes["output_norm.weight"] = (hidden,)
    if not tied:
        shapes["output.weight"] = (1000, hidden)
    return shapes


def test_q4_k_m_recipe_is_llama_cpps():
    """llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_Q4_K_M on a dense 16-layer model."""
    assert [i for i in range(16) if more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    types = tensor_types(_shapes(16, 512, tied=False), "q4_k", 16)
    six = {i for i in range(16) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"}
    assert six == {0, 1, 4, 7, 10, 13, 14, 15}
    assert {i for i in range(16) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"} == six
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert {types[f"blk.3.{n}.weight"] for n in ("attn_q", "attn_k", "attn_output", "ffn_up")} == {
        "Q4_K"
    }
    assert types["blk.3.attn_norm.weight"] == "F32"
    # tied head: the embedding is the output (Q6_K); rows of 576 fall back (SmolLM2's shapes)
    tied = tensor_types(_shapes(30, 576, tied=True), "q4_k", 30)
    assert tied["token_embd.weight"] == "Q8_0"
    assert tied["blk.0.attn_v.weight"] == "Q8_0" and tied["blk.3.attn_v.weight"] == "Q5_0"
    assert tied["blk.0.ffn_down.weight"] == "Q6_K"  # rows of 4 * 576 = 2304 = 9 * 256
    # Phi-3's fused attn_qkv counts as attn_v; Q6_K files are Q6_K but for the fallbacks
    fused = tensor_types(_shapes(8, 256, tied=True, fused=True), "q4_k", 8)
    assert fused["blk.0.attn_qkv.weight"] == "Q6_K" and fused["blk.1.attn_qkv.weight"] == "Q4_K"
    q6 = tensor_types(_shapes(2, 576, tied=False), "q6_k", 2)
    assert q6["blk.0.ffn_down.weight"] == "Q6_K" and q6["blk.0.attn_q.weight"] == "Q8_0"
    q8 = tensor_types(_shapes(2, 512, tied=False), "q8_0", 2)
    assert set(q8.values()) == {"Q8_0", "F32"}


def test_q4_k_header_and_types_in_file(tmp_path):
    import gguf
    from gguf import GGUFReader

    model = tiny("llama", hidden_size=256, intermediate_size=512, num_layers=8)
    reader = GGUFReader(export_gguf(model, tmp_path / "k.gguf", qtype="q4_k"))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == [
        "Q6_K" if more_bits(i, 8) else "Q4_K" for i in range(8)
    ]
    assert types["output.weight"] == "Q6_K" and types["blk.5.ffn_up.weight"] == "Q4_K"


# ---- tokenizer metadata ----
def test_pre_tokenizer_is_detected_by_llama_cpps_hash(tmp_path):
    from llmopt.export.gguf.vocab import check_hash, detect_pre

    tok = smollm_tokenizer()
    assert check_hash(tok) == "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"
    assert detect_pre(tok) == "smollm"  # the row llama.cpp took from HuggingFaceTB/SmolLM-135M


def _bible(chars: int = 60_000) -> str:
    from llmopt.data.corpus import load_text

    return load_text("corpus:web-bible", max_chars=chars)


def _byte_level_bpe():
    """A GPT-2-style byte-level BPE trained here: a pre-tokenizer hash llama.cpp never saw."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from llmopt.models.tokenizer import Tokenizer

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator([_bible()], trainer)
    return Tokenizer(backend, bos_token_id=None, eos_token_id=0)


def _sentencepiece_bpe():
    """A Llama-2-style tokenizer (BPE with byte fallback, '▁' for spaces, a prepended '▁',
    <unk>/<s>/</s> then the 256 <0xXX> byte pieces), trained here on Bible text."""
    from tokenizers import AddedToken, decoders, models, normalizers, trainers
    from tokenizers import Tokenizer as Backend

    from llmopt.models.tokenizer import Tokenizer

    def normalizer():
        return normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )

    trained = Backend(models.BPE())
    trained.normalizer = normalizer()
    trained.train_from_iterator([_bible()], trainers.BpeTrainer(vocab_size=500))
    learned = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [p for p, _ in learned]
    merges = [
        tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
        for m in json.loads(trained.to_str())["model"]["merges"]
    ]
    backend = Backend(
        models.BPE(
            vocab={p: i for i, p in enumerate(pieces)},
            merges=merges,
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    backend.normalizer = normalizer()
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in pieces[:3]])
    return Tokenizer(backend, bos_token_id=1, eos_token_id=2, add_bos=True)


def test_unknown_pre_tokenizer_is_refused_unless_named(tmp_path):
    from gguf import GGUFReader

    tok = _byte_level_bpe()
    model = tiny("llama", vocab_size=tok.vocab_size)
    with pytest.raises(
        ExportError,
        match=r"llama.cpp knows no pre-tokenizer .* \(check-text hash [0-9a-f]{64}\); pass tokenizer_pre",
    ):
        export_gguf(model, tmp_path / "u.gguf", tok)
    assert not (tmp_path / "u.gguf").exists()
    path = export_gguf(model, tmp_path / "u.gguf", tok, tokenizer_pre="gpt-2")
    assert GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "gpt-2"


def test_sentencepiece_vocabulary_replays_its_merges(tmp_path):
    """Written as llama.cpp's "llama" tokenizer (scores, BYTE/CONTROL types, space prefix),
    read back by the rebuild of llama.cpp's best-score-first merging: same ids as the
    original on text, including characters only the byte pieces cover."""
    from llmopt.models.loading import load_tokenizer

    tok = _sentencepiece_bpe()
    model = tiny("llama", vocab_size=tok.vocab_size + 3)
    path = export_gguf(model, tmp_path / "s.gguf", tok)
    fields, _ = read(path)
    assert fields["tokenizer.ggml.model"] == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"] is True
    types = fields["tokenizer.ggml.token_type"]
    assert types[:4] == [2, 3, 3, 6] and types[-3:] == [5, 5, 5]  # UNKNOWN CONTROL BYTE UNUSED
    back = load_tokenizer(path)
    text = _bible(3_000)[1000:] + " Œuvre — naïve 日本語 ŋ 🦙"
    assert back.encode(text) == tok.encode(text)
    assert back.decode(back.encode(text)) == tok.decode(tok.encode(text))
    assert (back.bos_token_id, back.eos_token_id, back.add_bos) == (1, 2, True)
