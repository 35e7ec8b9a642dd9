"""`llmopt export` and `llmopt quantize --format gptq|compressed-tensors|gguf` end to end."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.cli import main
from llmopt.export import export_hf
from llmopt.models.loading import load_model
from tests.export_fixtures import PROMPT, smollm_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = tiny_llama(vocab=49152)  # the tokenizer's vocabulary: GGUF metadata must match
    return model, export_hf(model, tmp_path_factory.mktemp("src") / "m", smollm_tokenizer())


@pytest.mark.slow
def test_export_gguf_cli_round_trips(tmp_path, model_dir, capsys):
    model, src = model_dir
    out = tmp_path / "m.gguf"
    assert (
        main(["export", "--model", str(src), "--format", "gguf", "--out", str(out), "--json"]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "gguf" and summary["bytes"] == out.stat().st_size
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        assert (load_model(out)(tokens) - model(tokens)).abs().max() < 2e-2


def test_export_cli_refuses_output_equal_to_input(model_dir, capsys):
    _, src = model_dir
    assert main(["export", "--model", str(src), "--format", "hf", "--out", str(src)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"llmopt export: error: --out {src} is the input {src}; choose a directory outside the input"
    )
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
@pytest.mark.parametrize("flag", [None, "--no-sym"])
def test_quantize_cli_writes_new_formats(tmp_path, model_dir, fmt, flag, capsys):
    """Symmetric by default for the formats vLLM's Marlin kernels run (--no-sym opts out);
    files at the umask (safetensors alone writes 0600)."""
    import os

    _, src = model_dir
    out = tmp_path / fmt
    argv = ["quantize", "--model", str(src), "--method", "rtn", "--group-size", "32"]
    argv += [flag] if flag else []
    old = os.umask(0o022)
    try:
        assert main([*argv, "--format", fmt, "--out", str(out), "--json"]) == 0
    finally:
        os.umask(old)
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == fmt
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == fmt
    sym = qcfg["sym"] if fmt == "gptq" else qcfg["config_groups"]["group_0"]["weights"]["symmetric"]
    assert sym is (flag is None)
    assert (out / "tokenizer.json").is_file()
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o644)}


def test_quantize_cli_rejects_bad_gguf_type_before_work(tmp_path, model_dir, capsys):
    _, src = model_dir
    argv = ["quantize", "--model", str(src), "--method", "rtn", "--format", "gguf"]
    assert main([*argv, "--gguf-type", "q9", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "gguf type='q9' is not supported" in capsys.readouterr().err
