"""Drafts (quantized self-drafts, separate models from disk, specs), vocabulary checks, the speed
model, statistics and the CLI glue."""

import argparse
import json

import pytest
import torch

from llmopt.infer.drafts import (
    EarlyExitModel,
    ModelDraft,
    NGramDraft,
    Proposal,
    check_vocabularies,
    make_draft,
)
from llmopt.infer.generate import generate
from llmopt.infer.sampling import SamplingParams
from llmopt.infer.speculative import (
    SpeculativeConfig,
    add_speculative_arguments,
    calibrate,
    expected_tokens_per_round,
    optimal_gamma,
    predicted_speedup,
    run_speculative_from_args,
    speculative_generate,
)
from llmopt.models import build_model
from llmopt.models.loading import save_pretrained
from tests.fixtures_speculative import one_thread_fixture, target_fixture  # noqa: E402, F401

PROMPT = [5, 17, 99, 3, 42, 8]


@pytest.mark.parametrize("spec, min_alpha", [("int8", 0.85), ("int4", 0.4)])
def test_quantized_self_drafts_are_exact_and_mostly_accepted(target, spec, min_alpha):
    draft = make_draft(spec, target)
    assert type(draft.model.layers[0].mlp.up_proj).__name__ == "QuantLinear"
    assert type(target.layers[0].mlp.up_proj) is torch.nn.Linear  # target left alone
    ref = generate(target, PROMPT, max_new_tokens=40)
    res = speculative_generate(target, draft, PROMPT, max_new_tokens=40)
    assert res.tokens == ref
    # a close copy of the target must agree with it far more often than chance (1/128)
    assert res.stats.alpha >= min_alpha, res.stats.alpha


def test_separate_model_draft_loaded_from_disk(target, tiny_config, tmp_path):
    small = build_model(tiny_config.replace(num_layers=1), seed=21).eval()
    save_pretrained(small, tmp_path / "small")
    draft = make_draft(str(tmp_path / "small"), target)
    assert draft.name == str(tmp_path / "small")
    ref = generate(target, PROMPT, max_new_tokens=30)
    assert speculative_generate(target, draft, PROMPT, max_new_tokens=30).tokens == ref


def test_mismatched_vocabulary_is_a_clear_error(target, tiny_config, tmp_path):
    other = build_model(tiny_config.replace(vocab_size=100), seed=1).eval()
    message = "vocabulary of 100 tokens but the target has 128"
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, ModelDraft(other, "other"), PROMPT, max_new_tokens=4)
    save_pretrained(other, tmp_path / "other")
    with pytest.raises(ValueError, match=message):
        make_draft(str(tmp_path / "other"), target)


class _Tok:
    def __init__(self, shift: int) -> None:
        self.shift, self.vocab_size = shift, 128

    def encode(self, text, add_bos=False):
        return [(ord(ch) + self.shift) % 128 for ch in text]


def test_same_size_but_different_tokenizer_is_a_clear_error(target):
    draft = ModelDraft(EarlyExitModel(target, 2), "ee")
    check_vocabularies(target, draft, _Tok(0), _Tok(0))  # same tokenizer: fine
    with pytest.raises(ValueError, match="uses a different tokenizer than the target"):
        check_vocabularies(target, draft, _Tok(0), _Tok(1))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("early-exit:x", "early-exit needs a layer count"),
        ("early-exit:9", "early-exit layer count 9 must be in \\[1, 3\\]"),
        ("ngram:q", "ngram takes an n-gram size"),
        ("ngram:0", "need 1 <= min_n=1 <= max_n=0"),
        ("", "empty draft spec; valid:"),
        ("no-such-model", "draft 'no-such-model': unknown model .* valid draft specs: "),
        ("bogus:3", "draft 'bogus:3': .* valid draft specs: .*early-exit:K"),
    ],
)
def test_bad_draft_specs_are_named(target, spec, message):
    with pytest.raises((ValueError, KeyError, FileNotFoundError), match=message):
        make_draft(spec, target)


def test_make_draft_specs(target):
    assert isinstance(make_draft("ngram", target), NGramDraft)
    assert make_draft("ngram:5", target).max_n == 5
    ee = make_draft("early-exit:2", target)
    assert len(ee.model.layers) == 2 and ee.model.layers[1] is target.layers[1]  # shared


# ---------------------------------------------------------------- the speed model


def test_expected_tokens_and_predicted_speedup():
    assert expected_tokens_per_round(0.0, 5) == 1.0
    assert expected_tokens_per_round(1.0, 5) == 6.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)  # 1 + .5 + .25
    # Leviathan et al. 2023, Fig. 3 regime: alpha=0.8, c=0.05, gamma=4 -> ~2.8x
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)
    # the seed's case: 20% acceptance with a draft costing 30% of a step is a slowdown
    assert predicted_speedup(0.2, 4, 0.3) < 1.0
    # a verify pass costing 2 steps halves the prediction
    assert predicted_speedup(0.8, 4, 0.05, 2.0) == pytest.approx(
        predicted_speedup(0.8, 4, 0.05) * 1.2 / 2.2
    )
    with pytest.raises(ValueError, match="alpha=1.5 must be in \\[0, 1\\]"):
        expected_tokens_per_round(1.5, 3)


def test_optimal_gamma_is_the_argmax():
    for alpha in (0.1, 0.5, 0.8, 0.95):
        for c in (0.0, 0.05, 0.3):
            best = optimal_gamma(alpha, c, max_gamma=16)
            values = [predicted_speedup(alpha, g, c) for g in range(1, 17)]
            assert values[best - 1] == max(values)
    assert optimal_gamma(0.95, 0.0, max_gamma=16) == 16  # free draft: guess as far as allowed
    assert optimal_gamma(0.1, 0.3) == 1
    assert optimal_gamma(0.9, 0.0, 16, {2: 1.1, 3: 1.2, 8: 9.0}) == 3  # costly long verifies


# ---------------------------------------------------------------- statistics


class _WrongAt:
    """Greedy-continuation draft whose guess number `k` is wrong each round."""

    name, forward_calls, vocab_size = "wrong-at", 0, 128

    def __init__(self, full, k):
        self.full, self.k = full, k

    def start(self, prompt_ids, max_len):
        pass

    def propose(self, context, gamma, sampling, generator):
        guesses = list(self.full[len(context) : len(context) + gamma])
        if self.k < len(guesses):
            guesses[self.k] = (guesses[self.k] + 1) % 128
        return Proposal(guesses)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_alpha_is_the_per_guess_acceptance(target, k):
    ref = generate(target, PROMPT, max_new_tokens=41)
    res = speculative_generate(
        target,
        _WrongAt(PROMPT + ref, k),
        PROMPT,
        max_new_tokens=41,
        config=SpeculativeConfig(gamma=4),
    )
    # every full round keeps k then rejects: the i.i.d. MLE is k / (k + 1)
    assert res.stats.alpha == pytest.approx(k / (k + 1), abs=0.03)
    assert res.stats.tokens_per_pass == pytest.approx(41 / res.stats.rounds)


def test_adaptive_gamma_grows_when_all_accepted_and_shrinks_on_rejection(target):
    ref = generate(target, PROMPT, max_new_tokens=50)
    cfg = SpeculativeConfig(gamma=2, adaptive=True, gamma_max=6)
    res = speculative_generate(
        target, _WrongAt(PROMPT + ref, 99), PROMPT, max_new_tokens=50, config=cfg
    )
    assert max(int(g) for g in res.stats.gammas_used) == 6  # grew 2 -> 6 and stayed there
    res = speculative_generate(
        target, _WrongAt(PROMPT + ref, 0), PROMPT, max_new_tokens=50, config=cfg
    )
    assert set(res.stats.gammas_used) == {1, 2}  # shrank to gamma_min


def test_stats_dict_and_calibration(target):
    res = speculative_generate(
        target, make_draft("early-exit:2", target), PROMPT, max_new_tokens=20
    )
    length = res.context_len
    before = res.engine.cached_kv(res.request, 0)[0].clone()
    calibrate(res, target, repeats=2)
    assert res.context_len == length == len(PROMPT) + 19
    assert torch.equal(res.engine.cached_kv(res.request, 0)[0], before)  # the run's cache
    d = res.stats.to_dict()
    json.dumps(d)
    assert d["generated"] == 20
    assert d["draft_forwards"] >= d["proposed"]  # a model draft runs once per guess
    assert 0 < d["draft_cost_c"] < 5 and d["verify_cost_v"] > 0
    assert d["predicted_speedup"] > 0 and 1 <= d["optimal_gamma_leviathan"] <= 16


# ---------------------------------------------------------------- CLI glue


def test_cli_arguments_and_run(target):
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=None)
    add_speculative_arguments(parser)
    args = parser.parse_args(["--draft", "early-exit:2", "--gamma", "3", "--stats"])
    assert (args.draft, args.gamma, args.adaptive_gamma, args.stats) == (
        "early-exit:2",
        3,
        False,
        True,
    )
    ids, stats = run_speculative_from_args(args, target, None, PROMPT, SamplingParams())
    assert ids == generate(target, PROMPT, max_new_tokens=16)
    assert stats["identical_to_plain"] is True
    assert stats["measured_speedup"] > 0 and stats["gamma"] == 3
    args = parser.parse_args(["--draft", "ngram", "--gamma", "0"])
    with pytest.raises(ValueError, match="--gamma 0 must be >= 1"):
        run_speculative_from_args(args, target, None, PROMPT, SamplingParams())
    args = parser.parse_args(["--draft", "ngram", "--adaptive-gamma"])
    ids, stats = run_speculative_from_args(args, target, None, PROMPT, SamplingParams())
    assert ids == generate(target, PROMPT, max_new_tokens=16) and stats == {}
