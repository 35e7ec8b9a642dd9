"""Perplexity and KL divergence: window bookkeeping, brute-force references, transformers parity."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmopt.cli import main
from llmopt.data.corpus import load_text
from llmopt.eval.kl import kl_divergence
from llmopt.eval.perplexity import perplexity, windows
from llmopt.models import build_model

TOKENS = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize(
    "n, ctx, stride", [(150, 64, 64), (150, 64, 16), (150, 50, 7), (10, 64, 32)]
)
def test_windows_score_each_token_once(n, ctx, stride):
    scored = []
    for w in windows(n, ctx, stride):
        assert w.end - w.begin <= ctx and w.begin < w.score_from <= w.end
        assert w.begin == 0 or w.score_from - w.begin >= ctx - stride  # guaranteed context
        scored += range(w.score_from, w.end)
    # overlapping windows score every token but the first; disjoint ones (stride == ctx) cannot
    # score the first token of each window, which has no context inside it (as in HF's loop)
    assert scored == [p for p in range(1, n) if stride < ctx or p % ctx != 0]


def _brute_force_nll(model, tokens, ctx, stride):
    """Each scored token's log-prob from a forward pass over exactly its window's prefix."""
    total, count = 0.0, 0
    for w in windows(len(tokens), ctx, stride):
        for pos in range(w.score_from, w.end):
            count += 1
            with torch.no_grad():
                logits = model(torch.tensor([tokens[w.begin : pos]]))[0, -1]
            total -= torch.log_softmax(logits.double(), -1)[tokens[pos]].item()
    return total / count


@pytest.mark.parametrize("ctx, stride", [(64, 64), (64, 24)])
def test_perplexity_equals_brute_force(tiny_model, ctx, stride):
    result = perplexity(tiny_model, TOKENS[:100], ctx=ctx, stride=stride)
    assert result.tokens_scored == (99 if stride < ctx else 98)
    ref = _brute_force_nll(tiny_model, TOKENS[:100], ctx, stride)
    assert result.nll == pytest.approx(ref, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(ref), rel=1e-5)
    assert result.tokens_per_s > 0
    truncated = perplexity(tiny_model, TOKENS, ctx=ctx, stride=stride, max_tokens=100)
    assert (truncated.nll, truncated.tokens_scored) == (result.nll, result.tokens_scored)


def test_kl_of_a_model_with_itself_is_zero(tiny_model):
    r = kl_divergence(tiny_model, tiny_model, TOKENS, ctx=64)
    assert r.tokens == 149 and r.top1_agreement == 1.0
    assert abs(r.mean) < 1e-7 and r.p99 < 1e-6 and r.rms_delta_p < 1e-7
    assert r.ppl == pytest.approx(perplexity(tiny_model, TOKENS, ctx=64, stride=32).ppl, rel=1e-6)


def test_kl_statistics_equal_direct_computation(tiny_model, tiny_config):
    other = build_model(tiny_config, seed=1).eval()
    with torch.no_grad():  # sharper, differing distributions so the statistics are not tiny
        for m in (tiny_model, other):
            m.lm_head.weight.mul_(20)
    toks = TOKENS[:64]
    r = kl_divergence(other, tiny_model, toks, ctx=64)  # one window: positions 1..63
    with torch.no_grad():
        lp = torch.log_softmax(other(torch.tensor([toks]))[0, :-1].double(), -1)
        ref_lp = torch.log_softmax(tiny_model(torch.tensor([toks]))[0, :-1].double(), -1)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
    nxt = torch.tensor(toks[1:])[:, None]
    dp = lp.gather(1, nxt).exp() - ref_lp.gather(1, nxt).exp()
    assert r.tokens == 63
    assert r.mean == pytest.approx(kl.mean().item(), rel=1e-4)
    assert r.median == pytest.approx(kl.median().item(), rel=1e-4)
    assert r.p99 == pytest.approx(torch.quantile(kl, 0.99).item(), rel=1e-4)
    agree = (lp.argmax(-1) == ref_lp.argmax(-1)).double().mean().item()
    assert r.top1_agreement == pytest.approx(agree)
    assert r.rms_delta_p == pytest.approx(dp.pow(2).mean().sqrt().item(), rel=1e-4)
    assert r.mean > 0.1 and r.p99 >= r.median


def test_bad_eval_arguments(tiny_model, tiny_config):
    with pytest.raises(ValueError, match=r"ctx=65 must be in \[2, 64\]"):
        perplexity(tiny_model, TOKENS, ctx=65)
    with pytest.raises(ValueError, match="stride=40 must be in \\[1, ctx=32\\]"):
        perplexity(tiny_model, TOKENS, ctx=32, stride=40)
    with pytest.raises(ValueError, match="need at least 2 tokens to score, got 1"):
        perplexity(tiny_model, [5], ctx=32, stride=16)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 128\)"):
        perplexity(tiny_model, [5, 300], ctx=32, stride=16)
    bigger = build_model(tiny_config.replace(vocab_size=256), seed=0)
    with pytest.raises(
        ValueError, match="vocabularies differ: model has 256 tokens, reference 128"
    ):
        kl_divergence(bigger, tiny_model, TOKENS, ctx=32)


# ---------------------------------------------------------------- real model, real text
@pytest.mark.slow
def test_eval_cli_ppl_and_kl_json(tmp_path, capsys):
    text = tmp_path / "genesis.txt"
    text.write_text(load_text("corpus:web-bible")[20_000:20_600])
    args = ["eval", "ppl", "--model", "smollm2-135m", "--text", str(text), "--ctx", "64",
            "--max-tokens", "100", "--json"]  # fmt: skip
    assert main(args) == 0
    ppl = json.loads(capsys.readouterr().out)
    assert ppl["tokens_scored"] == 99 and ppl["stride"] == 32 and 1 < ppl["ppl"] < 100
    args = ["eval", "kl", "--model", "smollm2-135m", "--dtype", "bfloat16", "--ref", "smollm2-135m",
            "--text", str(text), "--ctx", "64", "--max-tokens", "100", "--json"]  # fmt: skip
    assert main(args) == 0
    kl = json.loads(capsys.readouterr().out)
    assert kl["tokens"] == 99
    # bf16 rounding of the same weights: small but non-zero divergence
    assert 0 < kl["mean"] < 0.05 and kl["top1_agreement"] > 0.9
    assert kl["ref_ppl"] == pytest.approx(ppl["ppl"], rel=1e-5)


def test_eval_cli_errors_are_one_line(capsys, tmp_path):
    assert main(["eval", "ppl", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "text file not found" in capsys.readouterr().err
    assert main(["eval", "ppl", "--max-tokens", "1"]) == 2
    assert "--max-tokens 1 must be >= 2" in capsys.readouterr().err
    assert main(["eval", "ppl", "--ctx", "9000", "--max-tokens", "20"]) == 2
    assert "ctx=9000 must be in [2, 8192]" in capsys.readouterr().err
