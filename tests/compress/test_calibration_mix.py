"""Calibration mixes: parsing, allocation, a reproducible sampler that draws from every source."""

from __future__ import annotations

import random

import pytest
import torch

from llmopt.cli import main as cli_main
from llmopt.compress.quant.calibration import calibration_set, calibration_tokens
from llmopt.data.corpus import CORPORA, EVAL_ONLY, CorpusError, load_text
from llmopt.data.mix import DEFAULT_MIX, MixError, MixPart, allocate, parse_mix
from llmopt.models.packed.quant.config import QuantConfig

WORDS = {"a": "apple", "b": "banana", "c": "cherry"}


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture
def sources(tmp_path):
    """Three files, each of one word repeated after 3000 'zebra's (all in the first half)."""
    paths = {}
    for key, word in WORDS.items():
        path = tmp_path / f"{key}.txt"
        path.write_text(" ".join(["zebra"] * 3000 + [word] * 5000), encoding="utf-8")
        paths[key] = str(path)
    return paths


def test_parse_mix_normalises_weights_and_expands_the_default():
    parts = parse_mix("corpus:web-bible=3, notes.txt=1")
    assert parts == (MixPart("corpus:web-bible", 0.75), MixPart("notes.txt", 0.25))
    assert parse_mix("corpus:py-docs") == (MixPart("corpus:py-docs", 1.0),)
    default = parse_mix("mix:default")
    assert default == parse_mix(DEFAULT_MIX) and len(default) == 4
    assert [p.weight for p in default] == [0.5, 1 / 6, 1 / 6, 1 / 6]  # prose half
    assert allocate(default, 16) == [7, 3, 3, 3]  # the measured default (quant.md)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty --calib"),
        ("corpus:web-bible=abc", "weight 'abc' is not a number"),
        ("corpus:web-bible=0", "weight must be a positive finite number"),
        ("corpus:web-bible=-1", "weight must be a positive finite number"),
        ("corpus:web-bible=nan", "weight must be a positive finite number"),
        ("corpus:web-bible=inf", "weight must be a positive finite number"),
        ("=0.5", "names no source"),
        ("corpus:py-docs,corpus:py-docs=2", "names 'corpus:py-docs' twice"),
        ("corpus:torch-docs=1", "reserved for out-of-domain evaluation"),
    ],
)
def test_parse_mix_rejects_bad_parts(text, message):
    with pytest.raises(MixError, match=message):
        parse_mix(text)


def test_allocate_exact_counts():
    parts = parse_mix("x=2,y=1,z=1")
    assert allocate(parts, 16) == [8, 4, 4]
    assert allocate(parse_mix("x=9,y=1"), 3) == [2, 1]  # every source keeps one sample
    with pytest.raises(MixError, match="2 calibration samples cannot cover 3 sources"):
        allocate(parts, 2)


def test_allocate_covers_every_source_and_sums_to_n():
    rng = random.Random(0)
    for _ in range(500):
        weights = [rng.uniform(0.01, 100.0) for _ in range(rng.randint(1, 6))]
        parts = parse_mix(",".join(f"s{i}={w}" for i, w in enumerate(weights)))
        n = len(parts) + rng.randint(0, 40)
        counts = allocate(parts, n)
        assert sum(counts) == n and min(counts) >= 1
        spare = n - len(parts)
        for c, p in zip(counts, parts, strict=True):  # within one of the proportional share
            assert abs((c - 1) - p.weight * spare) < 1.0 + 1e-9


def test_sampler_is_reproducible_and_draws_from_every_source(tok, sources):
    mix = f"{sources['a']}=2,{sources['b']}=1,{sources['c']}=1"
    first = calibration_set(tok, mix, n_samples=8, seq_len=32, seed=3)
    again = calibration_set(tok, mix, n_samples=8, seq_len=32, seed=3)
    assert torch.equal(first.tokens, again.tokens)
    assert first.tokens.shape == (8, 32) and first.tokens.dtype == torch.long
    assert not torch.equal(first.tokens, calibration_set(tok, mix, 8, 32, seed=4).tokens)
    drawn = {}
    for row in first.tokens:
        text = tok.decode(row.tolist())
        found = [w for w in WORDS.values() if w in text]
        assert len(found) == 1 and "zebra" not in text  # one source per row, second half only
        word = found[0]
        drawn[word] = drawn.get(word, 0) + 1
    assert drawn == {"apple": 4, "banana": 2, "cherry": 2}
    assert [s["samples"] for s in first.sources] == [4, 2, 2]
    assert first.coverage["tokens"] == 256 and [s["tokens"] for s in first.sources] == [128, 64, 64]
    assert first.warnings == [
        "calibration has 256 tokens (< 4096): Hessians and activation statistics this small "
        "are noisy"
    ]
    # rows are shuffled: the first few (AWQ's search samples) are not all from one source
    assert len({tok.decode(r[:2].tolist()) for r in first.tokens[:4]}) > 1


def test_source_order_does_not_change_what_each_source_contributes(tok, sources):
    ab = calibration_set(tok, f"{sources['a']},{sources['b']}", 4, 16, seed=0).tokens
    ba = calibration_set(tok, f"{sources['b']},{sources['a']}", 4, 16, seed=0).tokens
    assert sorted(map(tuple, ab.tolist())) == sorted(map(tuple, ba.tolist()))


def test_single_source_warns(tok, sources):
    one = calibration_set(tok, sources["a"], 2, 16)
    assert any("calibration draws from one source" in w for w in one.warnings)
    assert torch.equal(one.tokens, calibration_tokens(tok, sources["a"], 2, 16))


def test_too_short_source_names_itself(tok, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("only a few words here", encoding="utf-8")
    with pytest.raises(ValueError, match=f"calibration source {short}: .* too few for 2 x 64"):
        calibration_set(tok, f"{short}", 2, 64)


@pytest.mark.slow
def test_named_corpora_are_real_text_and_eval_corpora_stay_out_of_the_default():
    default_names = {p.source.removeprefix("corpus:") for p in parse_mix(DEFAULT_MIX)}
    assert EVAL_ONLY <= set(CORPORA) and not EVAL_ONLY & default_names
    for name in CORPORA:
        text = load_text(f"corpus:{name}")
        assert len(text) > 50_000, name
        assert text.count(" the ") > 200, name  # English prose, not code
    with pytest.raises(CorpusError, match="unknown corpus 'nope'; known corpora: web-bible"):
        load_text("corpus:nope")


def test_default_calibration_is_the_mix():
    assert QuantConfig().calib == "mix:default"


def test_cli_rejects_bad_calib_before_loading(tmp_path, capsys):
    argv = ["quantize", "--model", str(tmp_path / "missing"), "--method", "gptq"]
    assert cli_main([*argv, "--calib", "corpus:pkg-readmes", "--out", str(tmp_path / "x")]) == 2
    assert "reserved for out-of-domain evaluation" in capsys.readouterr().err
    assert cli_main([*argv, "--calib", "corpus:web-bible=x", "--out", str(tmp_path / "x")]) == 2
    assert "weight 'x' is not a number" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_default_gptq_searches_the_group_range():
    # the measured fix for GPTQ's in-domain loss under the broad mix (docs/benchmarks/quant.md)
    assert QuantConfig().gptq_range_grid > 0
    with pytest.raises(ValueError, match="gptq_groups='dynamic'; valid choices: lazy, static"):
        QuantConfig(gptq_groups="dynamic")
    with pytest.raises(ValueError, match=r"gptq_max_shrink=1.0 must be in \[0, 1\)"):
        QuantConfig(gptq_max_shrink=1.0)


def test_cli_names_a_bad_range_grid_by_its_flag(tmp_path, capsys):
    argv = ["quantize", "--model", str(tmp_path / "missing"), "--method", "gptq"]
    assert cli_main([*argv, "--range-grid", "-1", "--out", str(tmp_path / "x")]) == 2
    assert "--range-grid -1 must be >= 0" in capsys.readouterr().err


def test_cli_names_a_bad_clip_token_count_by_its_flag(tmp_path, capsys):
    argv = ["quantize", "--model", str(tmp_path / "missing"), "--method", "awq"]
    assert cli_main([*argv, "--clip-tokens", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--clip-tokens 0 must be >= 1" in capsys.readouterr().err
