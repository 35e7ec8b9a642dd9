"""Quantized directories (round trip, corruption, mismatch), AutoAWQ export, `llmopt quantize`."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy

from llmopt.cli import main as cli_main
from llmopt.compress.quant.apply import quantize_model
from llmopt.compress.quant.autoawq import export_autoawq
from llmopt.compress.quant.io import save_quantized
from llmopt.models import build_model
from llmopt.models.loading import load_model, load_tokenizer
from llmopt.models.packed.metadata import compression_metadata
from llmopt.models.packed.quant.directory import WEIGHTS, QuantFileError, load_quantized_model
from llmopt.models.packed.quant.linear import QuantLinear


@pytest.fixture
def quantized(tiny_model):
    return quantize_model(tiny_model, "rtn", bits=4, group_size=32)


@pytest.mark.parametrize("tied", [False, True])
def test_roundtrip_gives_identical_logits(tmp_path, tiny_config, tied):
    model = build_model(tiny_config.replace(tie_embeddings=tied), seed=0).eval()
    q = quantize_model(model, "rtn", bits=4, group_size=32)
    save_quantized(q, tmp_path / "q")
    # through the foundation's loader, which delegates on llmopt_quant.json
    loaded = load_model(str(tmp_path / "q"))
    tokens = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), q(tokens))
    assert isinstance(loaded.layers[1].mlp.down_proj, QuantLinear)
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied
    assert compression_metadata(loaded).quant_config == compression_metadata(q).quant_config


def test_corrupted_weights_are_detected(tmp_path, quantized):
    d = save_quantized(quantized, tmp_path / "q")
    path = d / WEIGHTS
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # one flipped byte inside a tensor: still a parseable file
    path.write_bytes(bytes(data))
    with pytest.raises(QuantFileError, match="corrupted or was replaced: its SHA-256"):
        load_quantized_model(d)


def test_truncated_marker_and_missing_weights(tmp_path, quantized):
    d = save_quantized(quantized, tmp_path / "q")
    marker = d / "llmopt_quant.json"
    text = marker.read_text()
    marker.write_text(text[: len(text) // 2])
    with pytest.raises(QuantFileError, match="is not valid JSON"):
        load_quantized_model(d)
    marker.write_text(text)
    (d / WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match=f"lacks {WEIGHTS}"):
        load_quantized_model(d)


def test_mismatched_config_names_the_tensor(tmp_path, quantized):
    d = save_quantized(quantized, tmp_path / "q")
    marker = d / "llmopt_quant.json"
    meta = json.loads(marker.read_text())
    meta["modules"]["layers.0.self_attn.q_proj"]["bits"] = 8  # file holds 4-bit codes
    marker.write_text(json.dumps(meta))
    with pytest.raises(
        QuantFileError, match=r"tensor 'layers.0.self_attn.q_proj.qweight' .* is \(64, 32\)"
    ):
        load_quantized_model(d)
    meta["modules"]["layers.0.self_attn.q_proj"]["bits"] = 5
    marker.write_text(json.dumps(meta))
    with pytest.raises(QuantFileError, match="bits=5 is not supported; valid choices: 2, 3, 4, 8"):
        load_quantized_model(d)


def _independent_awq_dequant(qweight, qzeros, scales, group_size):
    """AutoAWQ GEMM layout, from its published description, in numpy (no llmopt code):
    nibble k of each int32 holds output column 8c + [0, 2, 4, 6, 1, 3, 5, 7][k]."""
    qweight = qweight.view(np.uint32)
    qzeros = qzeros.view(np.uint32)
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]  # inverse permutation: column m sits in nibble reverse[m]

    def unpack(packed):
        nibbles = np.stack([(packed >> (4 * k)) & 0xF for k in range(8)], axis=-1)
        return nibbles[:, :, reverse].reshape(packed.shape[0], -1).astype(np.float32)

    q = unpack(qweight)  # [in, out]
    z = np.repeat(unpack(qzeros), group_size, axis=0)
    s = np.repeat(scales.astype(np.float32), group_size, axis=0)
    return ((q - z) * s).T  # [out, in]


def test_autoawq_export_matches_an_independent_dequantiser(tmp_path, tiny_model):
    q = quantize_model(tiny_model, "rtn", bits=4, group_size=32)
    export_autoawq(q, tmp_path / "awq")
    tensors = load_numpy(str(tmp_path / "awq" / "model.safetensors"))
    cfg = json.loads((tmp_path / "awq" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "awq"
    assert cfg["quantization_config"]["version"] == "gemm"
    checked = 0
    for name, module in q.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        prefix = f"model.{name}"
        qw, qz, sc = (tensors[f"{prefix}.{k}"] for k in ("qweight", "qzeros", "scales"))
        assert qw.dtype == np.int32 and qw.shape == (module.in_features, module.out_features // 8)
        assert qz.shape == (module.in_features // 32, module.out_features // 8)
        assert sc.dtype == np.float16
        w = _independent_awq_dequant(qw, qz, sc, 32)
        assert np.array_equal(w, module.dequantize().numpy())  # exact: same codes and fp16
        checked += 1
    assert checked == 14
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" in tensors


def test_autoawq_rejects_what_its_layout_cannot_hold(tmp_path, tiny_model):
    q3 = quantize_model(tiny_model, "rtn", bits=3, group_size=32)
    with pytest.raises(ValueError, match="4-bit weights only; this model is 3-bit"):
        export_autoawq(q3, tmp_path / "a")
    q128 = quantize_model(tiny_model, "rtn", bits=4, group_size=128)  # hidden 64 < 128
    with pytest.raises(ValueError, match="in_features=64 with group_size=128"):
        export_autoawq(q128, tmp_path / "b")


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_dir):
    """A tiny model with SmolLM2's vocabulary and real tokenizer, saved HF-style (once)."""
    return tiny_hf_dir("tiny-smollm2-vocab", seed=0, num_heads=8, num_kv_heads=4)


def test_cli_quantize_awq_then_load(tmp_path, hf_dir, capsys):
    out = tmp_path / "q"
    argv = ["quantize", "--model", str(hf_dir), "--method", "awq", "--group-size", "32"]
    argv += ["--calib-samples", "4", "--calib-seq-len", "64", "--out", str(out), "--json"]
    argv += ["--clip-tokens", "100", "--duo-scaling", "--calib-seed", "3"]
    assert cli_main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["method"] == "awq" and summary["bits"] == 4
    coverage = summary["calibration"]  # the default mix: one 64-token window per source
    assert coverage["tokens"] == 256 and [s["samples"] for s in coverage["sources"]] == [1] * 4
    assert "warning: calibration has 256 tokens (< 4096)" in captured.err
    assert summary["quant_linear_fp16_bytes"] / summary["quant_linear_bytes"] > 3.0
    model = load_model(str(out))
    assert compression_metadata(model).quant_config.method == "awq"
    # the AWQ flags reach the recipe that is stored
    config = compression_metadata(model).quant_config
    assert (config.awq_clip_tokens, config.awq_duo_scaling, config.calib_seed) == (100, True, 3)
    text = "In the beginning God created"
    assert load_tokenizer(str(out)).encode(text) == load_tokenizer(str(hf_dir)).encode(text)


def test_cli_float16_rest_halves_the_unquantized_bytes(tmp_path, hf_dir, capsys):
    base = ["quantize", "--model", str(hf_dir), "--method", "rtn", "--group-size", "32", "--json"]
    assert cli_main([*base, "--out", str(tmp_path / "a")]) == 0
    assert cli_main([*base, "--float-dtype", "float16", "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    size_a = (tmp_path / "a" / WEIGHTS).stat().st_size
    size_b = (tmp_path / "b" / WEIGHTS).stat().st_size
    # the 49152 x 64 fp32 embedding dominates; fp16 halves it, the packed linears stay
    assert 0.45 < size_b / size_a < 0.6
    loaded = load_model(str(tmp_path / "b"))
    assert loaded.embed_tokens.weight.dtype == torch.float32  # loaded in the requested dtype


def test_cli_rejects_bad_bits(tmp_path, hf_dir, capsys):
    argv = ["quantize", "--model", str(hf_dir), "--bits", "5", "--out", str(tmp_path / "x")]
    assert cli_main(argv) == 2
    assert "bits=5 is not supported; valid choices: 2, 3, 4, 8" in capsys.readouterr().err


def test_cli_autoawq_rejects_group_not_dividing_widths_before_quantizing(tmp_path, hf_dir, capsys):
    argv = ["quantize", "--model", str(hf_dir), "--format", "autoawq", "--group-size", "128"]
    assert cli_main([*argv, "--out", str(tmp_path / "x")]) == 2
    assert "this model has widths [64]" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_calibration_windows_are_seeded_and_distinct(hf_dir):
    from llmopt.compress.quant.calibration import calibration_tokens, windows

    tok = load_tokenizer(str(hf_dir))
    a = calibration_tokens(tok, "corpus:web-bible", n_samples=3, seq_len=32, seed=0)
    assert a.shape == (3, 32) and a.dtype == torch.long
    assert torch.equal(a, calibration_tokens(tok, "corpus:web-bible", n_samples=3, seq_len=32))
    ids = torch.arange(100)
    w = windows(ids, 3, 10, seed=1)
    assert sorted(set(w[:, 0].tolist())) == sorted(w[:, 0].tolist())  # distinct windows
    assert all(int(r[0]) % 10 == 0 and torch.equal(r, torch.arange(r[0], r[0] + 10)) for r in w)
    with pytest.raises(ValueError, match="too few for 20 x 10"):
        windows(ids, 20, 10)
