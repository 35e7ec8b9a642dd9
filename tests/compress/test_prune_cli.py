"""`llmopt prune` end to end on a tiny model, and bad input as one-line errors (exit 2)."""

import json
import math

import pytest
import torch

from llmopt.cli import main as cli_main
from llmopt.compress.prune import load_pruned
from llmopt.models.loading import load_tokenizer
from llmopt.models.packed.metadata import compression_metadata
from llmopt.models.packed.sparse.config import PruneConfig, PruneConfigError, Sparsity


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_dir):
    """A tiny model with SmolLM2's vocabulary and real tokenizer, saved HF-style (once)."""
    return tiny_hf_dir("tiny-smollm2-vocab", seed=0, num_heads=8, num_kv_heads=4)


@pytest.mark.parametrize(
    "text,fraction,n,m",
    [("0.5", 0.5, 0, 0), ("0.25", 0.25, 0, 0), ("2:4", 0.5, 2, 4), ("4:8", 0.5, 4, 8)],
)
def test_sparsity_parses(text, fraction, n, m):
    s = Sparsity.parse(text)
    assert (s.fraction, s.n, s.m) == (fraction, n, m) and str(s) == text
    assert Sparsity.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    "text,message",
    [
        ("0", "must be a fraction strictly between 0 and 1"),
        ("1", "must be a fraction strictly between 0 and 1"),
        ("1.5", "must be a fraction strictly between 0 and 1"),
        ("-0.2", "must be a fraction strictly between 0 and 1"),
        ("nan", "must be a fraction strictly between 0 and 1"),
        ("inf", "must be a fraction strictly between 0 and 1"),
        ("4:4", "needs integers with 1 <= N < M"),
        ("5:4", "needs integers with 1 <= N < M"),
        ("0:4", "needs integers with 1 <= N < M"),
        ("2:x", "malformed N:M sparsity '2:x'"),
        ("2:", "malformed N:M sparsity '2:'"),
        (":4", "malformed N:M sparsity ':4'"),
        ("2:4:8", "malformed N:M sparsity '2:4:8'"),
        ("half", "neither a fraction in \\(0, 1\\)"),
    ],
)
def test_bad_sparsity_is_refused(text, message):
    with pytest.raises(PruneConfigError, match=message):
        Sparsity.parse(text)


def test_bad_options_are_refused():
    with pytest.raises(PruneConfigError, match="damp=nan must be a finite fraction"):
        PruneConfig(damp=math.nan)
    with pytest.raises(PruneConfigError, match="calib_tokens=100 must be at least one window"):
        PruneConfig(calib_tokens=100, calib_seq_len=512)
    with pytest.raises(PruneConfigError, match="unknown pruning options \\['bits'\\]"):
        PruneConfig.from_dict({"bits": 4})
    assert PruneConfig(sparsity="2:4").sparsity == Sparsity.nm(2, 4)  # strings are parsed


def test_cli_prune_sparsegpt_then_load(tmp_path, hf_dir, capsys):
    out = tmp_path / "p"
    argv = ["prune", "--model", str(hf_dir), "--method", "sparsegpt", "--sparsity", "2:4"]
    argv += ["--calib-tokens", "256", "--calib-seq-len", "64", "--out", str(out), "--json"]
    assert cli_main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    # the default calibration is the broad mix: one 64-token window from each of its sources
    drawn = {s["source"]: s["tokens"] for s in summary["calibration"]["sources"]}
    assert drawn == {
        "corpus:web-bible": 64,
        "corpus:py-docs": 64,
        "corpus:stdlib-docs": 64,
        "corpus:stdlib-comments": 64,
    }
    assert summary["method"] == "sparsegpt" and summary["sparsity"] == "2:4"
    assert summary["pruned_fraction"] == 0.5
    assert summary["pruned_linear_bytes"] / summary["pruned_linear_fp16_bytes"] == 9 / 16
    model = load_pruned(out)
    assert compression_metadata(model).prune_config.calib_tokens == 256
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 49152)
    from llmopt.models.tokenizer import Tokenizer

    text = "In the beginning God created"
    assert Tokenizer.from_directory(out).encode(text) == load_tokenizer(str(hf_dir)).encode(text)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--sparsity", "1.2"], "sparsity 1.2 must be a fraction strictly between 0 and 1"),
        (["--sparsity", "4:2"], "N:M sparsity 4:2 needs integers with 1 <= N < M"),
        (["--sparsity", "2:x"], "malformed N:M sparsity '2:x'"),
        (["--sparsity", "2:48"], "needs the input width to be a multiple of 48"),
        (["--calib-tokens", "10"], "calib_tokens=10 must be at least one window"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path, hf_dir, capsys, extra, message):
    argv = ["prune", "--model", str(hf_dir), "--method", "magnitude", "--out", str(tmp_path / "x")]
    assert cli_main(argv + extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_cli_refuses_out_in_the_source(hf_dir, capsys):
    for out in (hf_dir, hf_dir / "pruned"):
        argv = ["prune", "--model", str(hf_dir), "--method", "magnitude", "--out", str(out)]
        assert cli_main(argv) == 2
        err = capsys.readouterr().err  # refused before the model loads (llmopt.cli_args)
        assert "the input" in err and str(hf_dir) in err
    assert not (hf_dir / "pruned").exists()
    assert not (hf_dir / "llmopt_prune.json").exists()


def test_cli_float16_rest_halves_the_embedding_and_dir_is_readable(tmp_path, hf_dir, capsys):
    import os

    from safetensors import safe_open

    base = ["prune", "--model", str(hf_dir), "--method", "magnitude", "--sparsity", "2:4"]
    assert cli_main([*base, "--out", str(tmp_path / "a"), "--json"]) == 0
    assert cli_main([*base, "--float-dtype", "float16", "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    from llmopt.models.spec import get_spec

    embedding = get_spec("llama").embedding
    with safe_open(str(tmp_path / "b" / "llmopt_prune.safetensors"), framework="pt") as handle:
        assert handle.get_tensor(f"{embedding}.weight").dtype == torch.float16
    size_a = (tmp_path / "a" / "llmopt_prune.safetensors").stat().st_size
    size_b = (tmp_path / "b" / "llmopt_prune.safetensors").stat().st_size
    assert 0.45 < size_b / size_a < 0.6  # the 49152 x 64 embedding dominates the tiny model
    loaded = load_pruned(tmp_path / "b")
    assert (
        loaded.get_submodule(embedding).weight.dtype == torch.float32
    )  # loaded in the requested dtype
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "b").stat().st_mode & 0o777 == 0o777 & ~umask
