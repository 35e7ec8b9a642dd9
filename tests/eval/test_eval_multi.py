"""`llmopt eval ppl|kl|gate` with several --text: per-text results equal single-text runs,
JSON shapes, a gate failing on one text only, and bad text lists refused before any load.

The models are tiny (random weights, a small BPE tokenizer) and saved as HF directories, so
the CLI loads them as it would any model. The candidate differs from the reference only in
the embedding rows of tokens that occur in the digits text, so on the plain text it computes
exactly what the reference computes (KL 0) and on the digits text it does not.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from llmopt.cli import main
from llmopt.eval.gate import GateThresholds, apply_gates
from llmopt.eval.kl import KLResult, kl_divergence
from llmopt.eval.multi_text import (
    TextsGateReport,
    TextSpecError,
    check_text_specs,
    gate_texts,
    kl_texts,
    load_texts,
    perplexity_texts,
)
from llmopt.eval.perplexity import perplexity
from llmopt.models import ModelConfig, build_model
from llmopt.models.loading import load_model, load_tokenizer, save_pretrained
from llmopt.models.spec import spec_for
from tests.finetune_fixtures import small_tokenizer

PLAIN = "In the beginning God created the heavens and the earth. The earth was formless. " * 12
DIGITS = "Chapter 1, verse 2: 3 days, 40 nights, 7 seals and 12 gates; 365 and 1024. " * 12
SIZE = ["--ctx", "32", "--max-tokens", "96"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("multi")
    tokenizer = small_tokenizer()
    config = ModelConfig(
        name="tiny",
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=64,
        tie_embeddings=False,  # the candidate's edit must not reach the output head
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    ref = build_model(config, seed=0)
    with torch.no_grad():  # sharper distributions, so differences show in the statistics
        spec_for(ref).top_module(ref, "head").weight.mul_(20)
    save_pretrained(ref, root / "ref", tokenizer)
    only_digits = sorted(set(tokenizer.encode(DIGITS)) - set(tokenizer.encode(PLAIN)))
    assert len(only_digits) >= 5  # digits and punctuation the plain text never uses
    with torch.no_grad():
        embedding = spec_for(ref).top_module(ref, "embedding").weight
        embedding[only_digits] = torch.randn(
            len(only_digits), config.hidden_size, generator=torch.Generator().manual_seed(1)
        )
    save_pretrained(ref, root / "candidate", tokenizer)
    (root / "plain.txt").write_text(PLAIN)
    (root / "digits, with a comma.txt").write_text(DIGITS)  # a comma must not split the spec
    (root / "short.txt").write_text("In")
    return {
        "ref": str(root / "ref"),
        "candidate": str(root / "candidate"),
        "plain": str(root / "plain.txt"),
        "digits": str(root / "digits, with a comma.txt"),
        "short": str(root / "short.txt"),
    }


def _json(capsys, argv: list[str], code: int = 0) -> dict:
    assert main(argv) == code
    return json.loads(capsys.readouterr().out)


def _timeless(obj: dict) -> dict:
    """A result without its speed, the one field two runs of the same work do not share."""
    out = {k: _timeless(v) if isinstance(v, dict) else v for k, v in obj.items()}
    out.pop("tokens_per_s", None)
    return out


def test_ppl_per_text_equals_single_text_runs(setup, capsys):
    texts = [setup["plain"], setup["digits"]]
    base = ["eval", "ppl", "--model", setup["ref"], *SIZE, "--json"]
    both = _json(capsys, [*base, "--text", texts[0], "--text", texts[1]])
    assert set(both) == {"model", "results"} and both["model"] == setup["ref"]
    assert [r["text"] for r in both["results"]] == texts
    singles = [_json(capsys, [*base, "--text", t]) for t in texts]
    assert [_timeless(r) for r in both["results"]] == [_timeless(s) for s in singles]
    # a single text keeps the shape it always had
    keys = ["model", "text", "dtype", "ctx", "stride", "ppl", "nll", "tokens_scored"]
    assert list(singles[0]) == [*keys, "tokens_per_s"]
    swapped = _json(capsys, [*base, "--text", texts[1], "--text", texts[0]])  # order-free
    assert [_timeless(r) for r in swapped["results"]] == [_timeless(s) for s in singles[::-1]]
    assert singles[0]["tokens_scored"] == 95 and singles[0]["stride"] == 16
    assert singles[0]["ppl"] != singles[1]["ppl"]
    assert main([*base[:-1], "--text", texts[0], "--text", texts[1]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": perplexity ")[0] for line in lines] == texts
    assert f"{singles[1]['ppl']:.4f}" in lines[1]


def test_default_text_and_a_corpus_among_files(setup, capsys):
    base = ["eval", "ppl", "--model", setup["ref"], *SIZE, "--json"]
    default = _json(capsys, base)
    assert default["text"] == "corpus:web-bible"
    mixed = _json(capsys, [*base, "--text", setup["plain"], "--text", "corpus:web-bible"])
    assert _timeless(mixed["results"][1]) == _timeless(default)


def test_kl_per_text_equals_single_text_runs_and_table(setup, capsys, monkeypatch):
    texts = [setup["plain"], setup["digits"]]
    base = ["eval", "kl", "--model", setup["candidate"], "--ref", setup["ref"], *SIZE]
    both = _json(capsys, [*base, "--json", "--text", texts[0], "--text", texts[1]])
    assert set(both) == {"model", "ref", "results"}
    singles = [_json(capsys, [*base, "--json", "--text", t]) for t in texts]
    assert [_timeless(r) for r in both["results"]] == [_timeless(s) for s in singles]
    assert list(singles[0])[:5] == ["model", "ref", "text", "ctx", "stride"]
    plain, digits = singles
    assert plain["mean"] == 0.0 and plain["top1_agreement"] == 1.0  # identical computation
    assert plain["ppl"] == plain["ref_ppl"]
    assert digits["mean"] > 0.1 and digits["tokens"] == 95
    monkeypatch.chdir(Path(texts[0]).parent)  # short labels: the header fits on one line
    names = [Path(t).name for t in texts]
    assert main([*base, "--text", names[0], "--text", names[1]]) == 0
    table = capsys.readouterr().out.splitlines()
    header = next(line for line in table if "statistic" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == ["statistic", *names]
    row = next(line for line in table if "mean KL (nats)" in line)
    assert row.split()[-4::2] == ["0.000000", f"{digits['mean']:.6f}"]


def test_gate_passes_one_text_fails_another_naming_it(setup, capsys):
    plain, digits = setup["plain"], setup["digits"]
    base = ["eval", "gate", "--model", setup["candidate"], "--ref", setup["ref"], *SIZE]
    gates = ["--max-kl", "1e-6", "--min-top1", "0.5"]
    assert main([*base, *gates, "--text", plain]) == 0
    assert capsys.readouterr().out.startswith("llmopt eval gate: all gates passed: mean KL 0 ")
    code = main([*base, *gates, "--text", plain, "--text", digits, "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert code == 1 and out["passed"] is False
    assert set(out) == {"model", "ref", "passed", "reason", "results"}
    assert [r["passed"] for r in out["results"]] == [True, False]
    kl, top1 = (out["results"][1]["kl"][k] for k in ("mean", "top1_agreement"))
    assert top1 < 0.5
    failed = f"mean KL {kl:.6g} nats > max 1e-06 nats; top-1 agreement {top1:.6g} < min 0.5"
    line = captured.err.strip()
    assert line == f"llmopt eval gate: gate failed on 1 of 2 texts: {digits}: {failed}"
    assert out["reason"] == line.removeprefix("llmopt eval gate: ")
    single = _json(capsys, [*base, *gates, "--text", digits, "--json"], code=1)
    assert list(single) == [
        *("model", "ref", "text", "ctx", "stride"),
        *("passed", "reason", "gates", "kl"),
    ]
    assert _timeless(out["results"][1]) == _timeless(single)
    assert single["reason"] == f"gate failed: {failed}"
    capsys.readouterr()
    assert main([*base, "--max-kl", "100", "--text", plain, "--text", digits]) == 0
    assert capsys.readouterr().out.startswith(
        f"llmopt eval gate: all gates passed on 2 texts: {plain}: mean KL 0 nats <= max 100 "
        f"nats | {digits}: mean KL "
    )


def test_reason_names_every_failing_text_on_one_line():
    def result(mean: float, top1: float) -> KLResult:
        return KLResult(mean, mean, mean, top1, 0.0, 10, ppl=10.0, ref_ppl=10.0)

    limits = GateThresholds(max_kl=0.5, min_top1=0.9)
    judged = {
        "a.txt": apply_gates(result(0.7, 0.95), limits),
        "corpus:web-bible": apply_gates(result(0.1, 0.95), limits),
        "b, c.txt": apply_gates(result(0.6, 0.8), limits),
    }
    report = TextsGateReport(judged)
    assert not report.passed and report.failed == ("a.txt", "b, c.txt")
    assert report.reason() == (
        "gate failed on 2 of 3 texts: a.txt: mean KL 0.7 nats > max 0.5 nats | b, c.txt: "
        "mean KL 0.6 nats > max 0.5 nats; top-1 agreement 0.8 < min 0.9"
    )
    one = TextsGateReport({"a.txt": judged["a.txt"]})
    assert (
        one.reason() == judged["a.txt"].reason() == "gate failed: mean KL 0.7 nats > max 0.5 nats"
    )
    passing = TextsGateReport({"x": judged["corpus:web-bible"], "y": judged["corpus:web-bible"]})
    assert passing.passed and passing.reason() == (
        "all gates passed on 2 texts: x: mean KL 0.1 nats <= max 0.5 nats; top-1 agreement 0.95 "
        ">= min 0.9 | y: mean KL 0.1 nats <= max 0.5 nats; top-1 agreement 0.95 >= min 0.9"
    )


def test_api_matches_the_single_text_functions(setup):
    tokenizer = load_tokenizer(setup["ref"])
    texts = load_texts(tokenizer, [setup["plain"], setup["digits"]], max_tokens=80)
    assert list(texts) == [setup["plain"], setup["digits"]]
    assert [len(ids) for ids in texts.values()] == [80, 80]
    ref, cand = load_model(setup["ref"]), load_model(setup["candidate"])
    seen = []
    ppl = perplexity_texts(ref, texts, ctx=32, progress=lambda *a: seen.append(a))
    kl = kl_texts(cand, ref, texts, ctx=32, stride=8)
    thresholds = GateThresholds(max_kl=1e-6)
    report = gate_texts(cand, ref, texts, thresholds, ctx=32, stride=8)
    for label, ids in texts.items():
        direct = perplexity(ref, ids, ctx=32, stride=16)
        assert (ppl[label].nll, ppl[label].tokens_scored) == (direct.nll, direct.tokens_scored)
        direct_kl = kl_divergence(cand, ref, ids, ctx=32, stride=8)
        assert (kl[label].mean, kl[label].p99) == (direct_kl.mean, direct_kl.p99)
        gated = apply_gates(direct_kl, thresholds)
        assert report.reports[label].gates == gated.gates
    assert seen[-1] == (setup["digits"], 79, 79) and seen[0][0] == setup["plain"]
    assert report.failed == (setup["digits"],) and not report.passed
    assert math.isfinite(kl[setup["digits"]].mean) and kl[setup["digits"]].mean > 0


def test_bad_text_lists_are_refused_before_loading(setup, capsys, monkeypatch, tmp_path):
    import llmopt.models.loading as loading

    def no_load(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded")

    plain = setup["plain"]
    monkeypatch.setattr(loading, "load_tokenizer", no_load)
    monkeypatch.setattr(loading, "load_model", no_load)
    base = ["eval", "kl", "--model", setup["candidate"], "--ref", setup["ref"]]
    missing = str(tmp_path / "missing.txt")
    same = f"{Path(plain).parent}/../{Path(plain).parent.name}/{Path(plain).name}"
    cases = [
        (["--text", plain, "--text", plain], f"--text {plain} given twice; name each text once"),
        (["--text", plain, "--text", same], f"--text {same} is the same file as {plain}; "),
        (["--text", "corpus:web-bible", "--text", "corpus:web-bible"], "web-bible given twice"),
        (["--text", plain, "--text", missing], f"--text: text file not found: {missing}"),
        (["--text", plain, "--text", ""], "--text is empty; give a value or leave the flag out"),
        (["--text", "corpus:nope"], "--text corpus:nope: unknown corpus; known corpora: web-bible"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (extra, err)
    with pytest.raises(TextSpecError, match="^no text given"):
        check_text_specs([])


def test_a_text_too_short_is_refused_before_the_model_loads(setup, capsys, monkeypatch):
    import llmopt.models.loading as loading

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", no_model)
    argv = ["eval", "ppl", "--model", setup["ref"], "--text", setup["plain"]]
    assert main([*argv, "--text", setup["short"]]) == 2
    err = capsys.readouterr().err.strip()
    short = setup["short"]
    assert err == f"llmopt eval: error: --text {short} has 1 token(s); scoring needs at least 2"
