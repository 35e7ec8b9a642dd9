"""GGUF export: read back by the `gguf` reader and by llmopt's loader; logits vs the source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmopt.export import ExportError, export_gguf
from llmopt.models.loading import load_model, load_tokenizer
from tests.export_fixtures import PROMPT, greedy, smollm_tokenizer, tiny_llama

VOCAB = 49152  # the SmolLM2 tokenizer's, so its metadata is written and read back whole


@pytest.fixture(scope="module")
def model():
    return tiny_llama(hidden=256)  # rows of 256: every matrix takes Q4_K's super-blocks


@pytest.mark.parametrize(
    "qtype, ggml, logit_tol, weight_tol",
    [
        # Logits of this model are up to ~7. Tolerances are max |logit difference| and the
        # worst matrix's mean |weight error| / mean |weight|, ~3x what was observed: F16 rounds
        # by 2^-11 relative, Q8_0 keeps 8 bits per block of 32, the 4-bit types 16 levels per
        # block (a wrong Q/K permutation or nibble order would give a weight error of ~1.4).
        ("f16", "F16", 0.02, 1e-3),
        ("q8_0", "Q8_0", 0.5, 0.02),
        ("q4_0", "Q4_0", 7.0, 0.3),
        ("q4_1", "Q4_1", 7.0, 0.3),
        ("q4_k", "Q4_K", 7.0, 0.3),
    ],
)
def test_gguf_export_reads_back(tmp_path, model, qtype, ggml, logit_tol, weight_tol):
    from gguf import GGUFReader

    path = export_gguf(model, tmp_path / "m.gguf", qtype=qtype)
    reader = GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == ggml
    assert types["blk.1.ffn_up.weight"] == ggml
    assert types["output_norm.weight"] == "F32"
    # llama.cpp's recipes: the head Q6_K except in Q8_0 files; Q4_K_M's attn_v / ffn_down of
    # the first and last eighth of the layers (layer 1 of 2) Q6_K
    head = {"f16": "F16", "q8_0": "Q8_0"}.get(qtype, "Q6_K")
    assert types["output.weight"] == head
    assert types["blk.1.ffn_down.weight"] == ("Q6_K" if qtype == "q4_k" else ggml)
    assert reader.fields["general.architecture"].contents() == "llama"

    loaded = load_model(path)
    reference = dict(model.state_dict())
    for name, tensor in loaded.state_dict().items():
        if tensor.dim() == 2:
            err = (tensor - reference[name]).abs().mean() / reference[name].abs().mean()
            assert err < weight_tol, (name, err.item())
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        diff = (loaded(tokens) - model(tokens)).abs().max().item()
    assert diff < logit_tol, diff
    if qtype == "f16":  # Q8_0's greedy check is on SmolLM2 (random weights have near-ties)
        assert greedy(loaded, PROMPT) == greedy(model, PROMPT)


@pytest.mark.slow
def test_gguf_tokenizer_round_trips(tmp_path):
    from gguf import GGUFReader

    model = tiny_llama(vocab=VOCAB + 8)  # a padded embedding: 8 rows no token maps to
    path = export_gguf(model, tmp_path / "t.gguf", smollm_tokenizer(), qtype="f16")
    reader = GGUFReader(path)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == VOCAB + 8
    assert reader.fields["tokenizer.ggml.token_type"].contents()[-8:] == [5] * 8  # UNUSED
    with pytest.raises(ValueError, match="tokenizer has 49152 tokens but the model's vocab"):
        export_gguf(tiny_llama(vocab=256), tmp_path / "small.gguf", smollm_tokenizer())
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    ours, ref = load_tokenizer(path), smollm_tokenizer()
    text = "In the beginning God created 1234 heavens <|im_start|>user\nhi<|im_end|>"
    assert ours.encode(text) == ref.encode(text)
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.chat_template == ref.chat_template


def test_q4_k_falls_back_to_q5_0_where_super_blocks_do_not_tile(tmp_path):
    from gguf import GGUFReader

    model = tiny_llama(hidden=96)  # rows of 96 and 192 values: Q4_K needs 256
    path = export_gguf(model, tmp_path / "k.gguf", qtype="q4_k")
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_up.weight"] == "Q5_0"
    # Q6_K's fallback is Q8_0 (the head, and ffn_down of layer 1 of 2, the last eighth)
    assert types["blk.1.ffn_down.weight"] == types["output.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "Q5_0"
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        assert (load_model(path)(tokens) - model(tokens)).abs().max() < 2.0


@pytest.mark.parametrize(
    "kind, levels, bytes_per_block, rms_tol",
    # rms error of unit Gaussians, ~1.2x what ggml's reference quantizers give (0.071, 0.036,
    # 0.018 measured with libggml's `ggml_quantize_chunk` on the same data)
    [("Q4_K", 16, 144, 0.085), ("Q5_K", 32, 176, 0.044), ("Q6_K", 64, 210, 0.022)],
)
def test_k_quants_decode_with_ggml_layout(kind, levels, bytes_per_block, rms_tol):
    import gguf
    from gguf.quants import dequantize

    from llmopt.export.gguf.kquants import QUANTIZERS

    quantize, raw = QUANTIZERS[kind], getattr(gguf.GGMLQuantizationType, kind)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x[0, :256] = 0  # an all-zero super-block stays zero
    blocks = quantize(x)
    assert blocks.shape == (8, 2 * bytes_per_block) and blocks.dtype == np.uint8
    back = dequantize(blocks, raw)
    assert np.array_equal(back[0, :256], np.zeros(256))
    assert np.sqrt(((back - x) ** 2).mean()) < rms_tol
    # a row on the type's own grid comes back (a wrong nibble/bit order would scramble it):
    # codes 0..levels-1 with step 1; Q6_K: signed codes -8..7 times its 16 sub-block scales
    grid = np.tile(np.arange(levels, dtype=np.float32), 256 // levels)[None, :]
    if kind == "Q6_K":
        grid = np.arange(-8, 8, dtype=np.float32)[None, :] * np.arange(1, 17)[:, None] / 4
        grid = grid.reshape(1, 256)
    assert np.allclose(dequantize(quantize(grid), raw), grid, atol=1e-2)  # fp16 d: 2^-11
    with pytest.raises(ValueError, match=f"{kind} needs rows of a multiple of 256"):
        quantize(x[:, :96])


def test_q4_k_search_beats_the_min_max_fit():
    """The weighted grid search (ggml's make_qkx2_quants) lowers the error of a plain
    min/max fit of each sub-block, on the heavy-tailed weights real matrices have."""
    import gguf
    from gguf.quants import dequantize

    from llmopt.export.gguf.kquants import quantize_q4_k

    rng = np.random.default_rng(1)
    x = rng.standard_t(4, size=(64, 256)).astype(np.float32)
    sub = x.reshape(-1, 32)
    lo, hi = np.minimum(sub.min(1, keepdims=True), 0), sub.max(1, keepdims=True)
    step = (hi - lo) / 15
    plain = np.clip(np.rint((sub - lo) / step), 0, 15) * step + lo
    ours = dequantize(quantize_q4_k(x), gguf.GGMLQuantizationType.Q4_K).reshape(-1, 32)
    # the 6-bit sub-block scales cost the searched fit a little; it still wins clearly
    assert ((ours - sub) ** 2).mean() < 0.9 * ((plain - sub) ** 2).mean()


def test_gguf_export_bad_type_and_same_output(tmp_path, model):
    with pytest.raises(ExportError, match=r"gguf type='q3_x' is not supported; valid choices"):
        export_gguf(model, tmp_path / "x.gguf", qtype="q3_x")
    src = tmp_path / "src.gguf"
    src.write_bytes(b"GGUF")
    with pytest.raises(ExportError, match="would overwrite the input"):
        export_gguf(model, src, source=src)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_smollm2_gguf_export_greedy_identical(tmp_path, qtype):
    """The real model: our export of SmolLM2 generates exactly what the packaged file does."""
    ref = load_model("smollm2-135m")
    tok = smollm_tokenizer()
    path = export_gguf(ref, tmp_path / "smol.gguf", tok, qtype=qtype, source="smollm2-135m")
    ours = load_model(path)
    prompt = tok.encode("The capital of France is")
    assert greedy(ours, prompt) == greedy(ref, prompt)
