"""The speed model (one predictor), cost calibration and the plain-vs-speculative comparison."""

import json
import math
import random
import time

import pytest
import torch

from llmopt.infer.drafts import EarlyExitModel, ModelDraft, NGramDraft
from llmopt.infer.generate import generate
from llmopt.infer.sampling import SamplingParams
from llmopt.infer.speculative import (
    Comparison,
    PassCosts,
    SpeculativeConfig,
    SpeculativeStats,
    Timing,
    calibrate,
    compare_with_plain,
    costs_from_times,
    measure_plain,
    optimal_gamma,
    predicted_speedup,
    time_passes,
)
from tests.fixtures_speculative import one_thread_fixture, target_fixture  # noqa: F401

PROMPT = [5, 17, 99, 3, 42, 8, 5, 17, 99]


def _simulate(alpha, gamma, c, c2, v, f, rounds=200_000, seed=0):
    """Monte Carlo of the process the model describes: a round proposes with probability f,
    each guess is kept with probability alpha until the first rejection, a round costs
    γ draft steps + one (γ+1)-token pass, and the round after a fully accepted one pays c2
    instead of c for its first draft step."""
    rng = random.Random(seed)
    tokens = cost = 0.0
    caught_up = False
    for _ in range(rounds):
        if rng.random() >= f:  # no proposal: a plain step
            tokens, cost, caught_up = tokens + 1, cost + 1, False
            continue
        kept = 0
        while kept < gamma and rng.random() < alpha:
            kept += 1
        cost += gamma * c + (c2 - c if caught_up else 0.0) + v
        tokens += kept + 1
        caught_up = kept == gamma
    return tokens / cost


@pytest.mark.parametrize(
    "alpha, gamma, c, c2, v, f",
    [
        (0.85, 4, 0.0, 0.0, 1.84, 0.7),  # prompt lookup on repetitive text
        (0.97, 3, 0.6, 0.86, 1.61, 1.0),  # INT8 self-draft: catch-up after most rounds
        (0.24, 2, 0.72, 1.1, 2.13, 1.0),  # a poor early exit
        (0.6, 8, 0.05, 0.08, 2.12, 0.5),
        (0.95, 2, 0.1, 1.0, 1.7, 0.5),  # a costly catch-up after half the rounds
    ],
)
def test_predictor_matches_a_simulation_of_its_model(alpha, gamma, c, c2, v, f):
    # the catch-up of round k depends on round k-1 only through P(full accept) = α^γ
    predicted = predicted_speedup(alpha, gamma, c, v, proposal_rate=f, catchup_cost=c2)
    assert predicted == pytest.approx(_simulate(alpha, gamma, c, c2, v, f), rel=0.01)


def test_predictor_defaults_are_leviathans_formula_and_edges():
    # Leviathan et al. 2023, eq. 1 / (γc + 1)
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)
    assert predicted_speedup(0.9, 5, 0.1, 2.0, proposal_rate=0.0) == 1.0  # never proposes
    # a fully accepting free draft: γ+1 tokens per (γ+1)-token pass
    assert predicted_speedup(1.0, 3, 0.0, 1.6) == pytest.approx(4 / 1.6)
    # catch-up costs only after full acceptance: α=0 makes c2 irrelevant
    assert predicted_speedup(0.0, 3, 0.2, 1.5, catchup_cost=9.0) == predicted_speedup(
        0.0, 3, 0.2, 1.5
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"alpha": math.nan}, "alpha=nan must be in \\[0, 1\\]"),
        ({"alpha": 1.2}, "alpha=1.2 must be in \\[0, 1\\]"),
        ({"c": math.inf}, "draft costs must be finite and >= 0: c=inf"),
        ({"c": -0.1}, "draft costs must be finite and >= 0: c=-0.1"),
        ({"catchup_cost": math.nan}, "catchup_cost=nan"),
        ({"verify_cost": 0.0}, "verify_cost=0.0 must be finite and > 0"),
        ({"verify_cost": math.nan}, "verify_cost=nan must be finite and > 0"),
        ({"proposal_rate": 1.5}, "proposal_rate=1.5 must be in \\[0, 1\\]"),
    ],
)
def test_predictor_refuses_bad_numbers(kwargs, message):
    args = {"alpha": 0.5, "gamma": 3, "c": 0.1, "verify_cost": 1.5, **kwargs}
    with pytest.raises(ValueError, match=message):
        predicted_speedup(**args)


def test_pass_costs_predict_and_optimal_gamma():
    costs = PassCosts(0.04, {1: 1.0, 2: 1.7, 3: 2.13, 4: 1.61, 5: 1.84}, 0.6, 0.86)
    assert costs.verify(3) == 1.61
    assert costs.predict(0.9, 3, 1.0) == predicted_speedup(
        0.9, 3, 0.6, 1.61, proposal_rate=1.0, catchup_cost=0.86
    )
    v = {1: 1.7, 2: 2.13, 3: 1.61, 4: 1.84}
    assert costs.optimal_gamma(0.9) == optimal_gamma(0.9, 0.6, 4, v, catchup_cost=0.86) == 3
    with pytest.raises(ValueError, match="no calibrated cost for a 7-token pass; have"):
        costs.verify(6)
    with pytest.raises(ValueError, match="pass costs must be finite"):
        PassCosts(0.04, {1: 1.0, 2: math.nan})
    with pytest.raises(ValueError, match="need t=1 and some t>1"):
        PassCosts(0.04, {2: 1.5, 3: 2.0})
    assert json.dumps(costs.to_dict())


def test_costs_from_times_divides_by_the_target_step():
    target = {"wall": {1: 0.02, 2: 0.03, 5: 0.04}, "cpu": {1: 0.01, 2: 0.02, 5: 0.03}}
    draft = {"wall": {1: 0.005, 2: 0.006}, "cpu": {1: 0.002, 2: 0.004}}
    costs = costs_from_times(target, draft)
    assert costs["wall"].target == {1: 1.0, 2: 1.5, 5: 2.0}
    assert costs["cpu"].target == {1: 1.0, 2: 2.0, 5: 3.0}
    assert (costs["wall"].draft, costs["wall"].draft_2) == (0.25, 0.3)
    assert (costs["cpu"].draft, costs["cpu"].draft_2) == (0.2, 0.4)
    assert costs_from_times(target)["cpu"].draft == 0.0  # no model, no draft cost


def test_time_passes_times_each_size_on_both_clocks(target):
    calls = []

    def sleepy_forward(x, cache, last_only=False):  # a pass that costs 4 ms per token
        calls.append((x.shape[1], cache.length))
        time.sleep(0.004 * x.shape[1])
        cache.length += x.shape[1]
        return torch.zeros(1, x.shape[1], 128)

    target.forward = sleepy_forward
    times = time_passes(target, 40, [3, 1], repeats=2)
    assert sorted(times["wall"]) == sorted(times["cpu"]) == [1, 3]
    assert calls == [(1, 40), (3, 40)] * 3  # interleaved, each on the same 40 positions
    assert times["wall"][3] / times["wall"][1] == pytest.approx(3, rel=0.5)
    assert times["cpu"][3] < times["wall"][3] / 3  # sleeping costs no CPU time
    with pytest.raises(ValueError, match="exceeds the model context max_seq_len=64"):
        time_passes(target, 60, [5])
    with pytest.raises(ValueError, match="need pass sizes >= 1 and repeats >= 1"):
        time_passes(target, 10, [0, 2])


def test_measure_plain_and_compare_with_plain_greedy(target):
    plain = measure_plain(target, PROMPT, max_new_tokens=20)
    assert plain.tokens == generate(target, PROMPT, max_new_tokens=20)
    assert plain.decode.tokens == 19 and plain.total.tokens == 20  # token 1 is the prefill's
    assert 0 < plain.decode.wall_s < plain.total.wall_s
    result, comp = compare_with_plain(
        target, NGramDraft(), PROMPT, max_new_tokens=20, config=SpeculativeConfig(gamma=3)
    )
    assert comp.identical is True and result.tokens == plain.tokens
    st = result.stats
    # like plain decoding's, the decode phase starts after the step that prefilled the prompt
    assert st.first_tokens >= 1 and comp.speculative_total.tokens == 20
    assert comp.speculative_decode.tokens == 20 - st.first_tokens
    decoded = 20 - st.first_tokens
    expected = (decoded / (st.total_time_s - st.prefill_time_s)) / comp.plain_decode.rate("wall")
    assert comp.speedup("wall") == pytest.approx(expected)
    assert comp.speedup("wall", end_to_end=True) == pytest.approx(
        (20 / st.total_time_s) / (20 / comp.plain_total.wall_s)
    )
    with pytest.raises(ValueError, match="clock 'gpu' is not one of"):
        comp.speedup("gpu")
    with pytest.raises(ValueError, match="plain run given to compare_with_plain is of another"):
        compare_with_plain(target, NGramDraft(), PROMPT[:-1], max_new_tokens=20, plain=plain)


def test_compare_with_plain_in_sampling_mode_does_not_claim_identity(target):
    sampling = SamplingParams(temperature=1.0)
    _, comp = compare_with_plain(
        target, NGramDraft(), PROMPT, max_new_tokens=10, sampling=sampling, seed=3
    )
    assert comp.identical is None
    assert "identical_to_plain" not in comp.to_dict()


def test_pooled_comparison_pools_rates_not_ratios():
    def comp(tokens, spec_s, plain_tokens, plain_s, accepted, rejections):
        st = SpeculativeStats(draft="d", gamma=2, rounds=tokens - accepted, generated=tokens)
        st.total_time_s, st.prefill_time_s = spec_s + 1.0, 1.0
        st.total_cpu_s, st.prefill_cpu_s = spec_s + 1.0, 1.0
        st.accepted, st.rejections, st.proposing_rounds = accepted, rejections, st.rounds
        st.accept_lengths.update({0: rejections})
        decode = Timing(plain_tokens, plain_s, plain_s)
        return Comparison(st, decode, Timing(plain_tokens + 1, plain_s + 1, plain_s + 1), True)

    a, b = comp(10, 1.0, 9, 1.0, 4, 6), comp(30, 9.0, 29, 3.0, 20, 10)
    pooled = Comparison.pooled([a, b])
    assert pooled.stats.accepted == 24 and pooled.stats.rejections == 16
    assert pooled.stats.alpha == 24 / 40
    assert pooled.stats.accept_lengths == {0: 16}
    assert pooled.speedup("cpu") == pytest.approx((40 / 10) / (38 / 4))
    assert pooled.identical is True
    assert (
        Comparison.pooled([a, Comparison(b.stats, b.plain_decode, b.plain_total)]).identical is None
    )
    with pytest.raises(ValueError, match="needs at least one"):
        Comparison.pooled([])


def test_calibrate_with_the_draft_times_its_passes(target):
    draft = ModelDraft(EarlyExitModel(target, 2), "early-exit:2")
    result, comp = compare_with_plain(target, draft, PROMPT, max_new_tokens=16)
    length = result.context_len
    before = result.engine.cached_kv(result.request, 0)[0].clone()
    costs = calibrate(result, target, repeats=2, draft=draft)
    assert result.context_len == length == len(PROMPT) + 15
    assert torch.equal(result.engine.cached_kv(result.request, 0)[0], before)  # not touched
    assert sorted(costs) == ["cpu", "wall"]
    assert sorted(costs["wall"].target) == list(range(1, 10))  # up to γ = 8 for the optimum
    assert costs["wall"].target[1] == 1.0
    assert 0 < costs["cpu"].draft < 2  # half the layers of the target
    d = comp.to_dict()
    json.dumps(d)
    assert d["predicted_speedup"] == result.stats.predict(costs["wall"])["predicted_speedup"]
    assert d["predicted_speedup_cpu"] == result.stats.predict(costs["cpu"])["predicted_speedup"]
    assert d["calibration"]["cpu"]["draft_c"] == costs["cpu"].draft
    assert d["measured_speedup"] > 0 and d["identical_to_plain"] is True
    ngram = compare_with_plain(target, NGramDraft(), PROMPT, max_new_tokens=16)[0]
    assert calibrate(ngram, target, repeats=1, draft=NGramDraft())["wall"].draft == 0.0


def test_no_proposal_no_prediction():
    st = SpeculativeStats(rounds=5, generated=5)
    st.costs = {k: PassCosts(0.01, {1: 1.0, 2: 1.5}) for k in ("wall", "cpu")}
    assert set(st.predictions().values()) == {None}
    assert SpeculativeStats().to_dict()["predicted_speedup"] is None  # not calibrated
