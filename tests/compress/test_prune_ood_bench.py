"""benchmarks/prune_quality.py and compress_order.py on a tiny model: every variant scored on
every --eval corpus, the in-domain figures equal to a direct computation on the same slice
and calibration draw (so the recorded tables stay comparable), bad input one line (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmopt.compress.prune import PruneConfig, Sparsity, prune_model
from llmopt.compress.quant.calibration import calibration_tokens
from llmopt.data.corpus import EVAL_ONLY, load_text
from llmopt.eval.kl import kl_divergence
from llmopt.models.loading import load_model, load_tokenizer
from tests.paths import REPO

ROOT = REPO
CORPORA = ["web-bible", "torch-docs", "pkg-readmes"]


def _run(name: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`python benchmarks/<name>.py ARGV` as a user runs it (tests never import benchmarks/)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = ROOT / "benchmarks" / f"{name}.py"
    return subprocess.run(
        [sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=600
    )


MIX_SOURCES = ("web-bible", "py-docs", "stdlib-docs", "stdlib-comments")


@pytest.fixture(scope="module")
def model_dir(tiny_hf_dir):
    """A tiny model with SmolLM2's vocabulary and tokenizer (compress_order's ctx is 256)."""
    return tiny_hf_dir("tiny-ood", seed=3, max_seq_len=512)


@pytest.mark.slow
def test_prune_quality_scores_each_corpus_like_a_direct_run(model_dir, tmp_path):
    out = tmp_path / "p.json"
    argv = ["--model", str(model_dir), "--methods", "magnitude,wanda", "--sparsities", "2:4"]
    argv += ["--calib-tokens", "256", "--calib-seq-len", "64", "--eval-tokens", "128"]
    assert _run("prune_quality", [*argv, "--ctx", "64", "--out", str(out)]).returncode == 0
    data = json.loads(out.read_text())
    assert data["eval"] == CORPORA and [r["method"] for r in data["rows"]] == ["magnitude", "wanda"]
    sources = [s["source"] for s in data["calibration"]["sources"]]
    # PruneConfig's default, the broad mix; never an EVAL_ONLY corpus
    assert sorted(sources) == [f"corpus:{n}" for n in sorted(MIX_SOURCES)]
    assert not {s.removeprefix("corpus:") for s in sources} & EVAL_ONLY
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    calib = calibration_tokens(tok, "mix:default", 4, 64, 0)
    for row in data["rows"]:
        assert set(row["eval"]) == set(CORPORA) and row["stored_vs_fp16"] == 0.5625
        config = PruneConfig(method=row["method"], sparsity=Sparsity.parse("2:4"))
        pruned = prune_model(model, config=config, calib_tokens=calib)
        for name in CORPORA:
            ids = tok.encode(load_text(f"corpus:{name}", max_chars=128 * 8))[:128]
            kl = kl_divergence(pruned, model, ids, ctx=64, stride=64)
            got = row["eval"][name]
            assert got["ppl"] == pytest.approx(kl.ppl, rel=1e-6)
            assert got["kl_mean"] == pytest.approx(kl.mean, rel=1e-5)
            assert got["top1"] == kl.top1_agreement and got["ref_ppl"] == kl.ref_ppl
            assert got["kl_mean"] > 0


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--eval", "corpus:web-bible,corpus:nope"], "--eval: unknown corpus 'nope'"),
        (["--sparsities", "4:4"], "4:4"),
        (["--methods", "magnitude,foo"], "unknown pruning method 'foo'"),
        (["--calib", "corpus:torch-docs"], "'torch-docs' is reserved for out-of-domain"),
        (["--calib", "corpus:nope"], "--calib: unknown corpus 'nope'"),
    ],
)
def test_prune_quality_bad_input_is_one_line(model_dir, tmp_path, extra, message):
    proc = _run("prune_quality", ["--model", str(model_dir), *extra])
    assert proc.returncode == 2
    assert message in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_compress_order_scores_every_stage_on_every_corpus(model_dir, tmp_path):
    out = tmp_path / "c.json"
    argv = ["--model", str(model_dir), "--orders", "quantize", "--eval-tokens", "512"]
    argv += ["--decode-tokens", "2", "--decode", "eager", "--work", str(tmp_path / "w")]
    assert _run("compress_order", [*argv, "--out", str(out)]).returncode == 0
    data = json.loads(out.read_text())
    original, quantized = data["orders"]["quantize"]
    assert data["eval"] == CORPORA
    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    stage = load_model(quantized["model"])
    for name in CORPORA:
        assert original["eval"][name]["kl_mean"] == pytest.approx(0, abs=1e-6)
        ids = tok.encode(load_text(f"corpus:{name}", max_chars=512 * 8))[:512]
        kl = kl_divergence(stage, model, ids, ctx=256, stride=256)
        assert quantized["eval"][name]["kl_mean"] == pytest.approx(kl.mean, rel=1e-5)
        assert quantized["eval"][name]["ppl"] == pytest.approx(kl.ppl, rel=1e-6)
    # the recipe's own in-domain measure (overlapping windows) is kept beside them
    assert quantized["kl_vs_original"] > 0 and quantized["decode_path"] == "eager"


def test_compress_order_unknown_order_is_one_line():
    proc = _run("compress_order", ["--orders", "quantize,shrink"])
    assert proc.returncode == 2
    assert "--orders: unknown order 'shrink'" in proc.stderr
