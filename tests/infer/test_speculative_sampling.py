"""Sampling-mode speculative decoding emits the target's distribution, and a wrong rule does not.

On an 8-token vocabulary the exact joint law of the first two new tokens (64 outcomes) is
computed from the target by enumeration; speculative samples are compared to it with
- total variation against a bound set by the sample size N: E[TV] <= 1/2 sum_k sqrt(P_k/N)
  (Jensen on each |P_hat_k - P_k|) plus a McDiarmid tail sqrt(ln(1/delta) / 2N), delta=1e-4
  (one sample moves TV by at most 1/N);
- a chi-square goodness-of-fit test (bins with expected count < 5 pooled), p-value > 1e-4.
Two tokens with gamma=1 exercise all three paths: accepted guess + bonus token, and rejection
with a draw from the residual norm(max(0, p - q)).
"""

import math

import pytest
import torch
from scipy import stats as scistats

import llmopt.infer.batch.engine as loop  # the one decode loop verifies the guesses
from llmopt.infer.drafts import ModelDraft, NGramDraft
from llmopt.infer.sampling import SamplingParams, logits_to_probs, sample
from llmopt.infer.speculative import SpeculativeConfig, speculative_generate, verify_sampled
from llmopt.models import ModelConfig, build_model
from tests.fixtures_speculative import one_thread_fixture  # noqa: F401

VOCAB = 8
N_SAMPLES = 2000
PROMPT = [1, 2, 3, 1, 2]  # "1 2" recurs, so the n-gram draft proposes 3


def _model(seed: int, layers: int, std: float):
    cfg = ModelConfig(
        name="vocab8",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=16,
    )
    # std 0.5: peaked, seed-dependent distributions, so target and draft disagree clearly
    return build_model(cfg, seed=None).init_weights(seed, std=0.5).eval()


@pytest.fixture(scope="module")
def target():
    return _model(1, 2, std=0.3)  # spread out: max p ~ 0.7


@pytest.fixture(scope="module")
def draft_model():
    # Chosen so that the wrong rules below are far off (TV ~0.16 on the first token for the
    # resample-from-p mistake); an almost disjoint q would make that mistake nearly harmless.
    return _model(3, 1, std=0.5)


@torch.no_grad()
def _exact_joint(model, sampling: SamplingParams) -> torch.Tensor:
    """P(t1, t2 | PROMPT) as a [VOCAB * VOCAB] vector, by enumeration."""
    p1 = logits_to_probs(model(torch.tensor([PROMPT]))[0, -1], sampling)
    seqs = torch.tensor([[*PROMPT, t] for t in range(VOCAB)])
    p2 = logits_to_probs(model(seqs)[:, -1], sampling)  # [t1, t2]
    return (p1[:, None] * p2).reshape(-1)


def _speculative_counts(target, draft, sampling: SamplingParams) -> torch.Tensor:
    counts = torch.zeros(VOCAB * VOCAB)
    for i in range(N_SAMPLES):
        res = speculative_generate(
            target,
            draft,
            PROMPT,
            max_new_tokens=2,
            sampling=sampling,
            config=SpeculativeConfig(gamma=1),
            seed=i,
        )
        counts[res.tokens[0] * VOCAB + res.tokens[1]] += 1
    return counts


def _tv_bound(probs: torch.Tensor, n: int, delta: float = 1e-4) -> float:
    return 0.5 * float(probs.sqrt().sum()) / math.sqrt(n) + math.sqrt(math.log(1 / delta) / (2 * n))


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    probs = probs.double() / probs.double().sum()  # scipy wants sums equal to ~1e-8
    counts = counts.double()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = [*counts[big].tolist(), float(counts[~big].sum())]
    exp = [*expected[big].tolist(), float(expected[~big].sum())]
    if exp[-1] == 0:  # nothing pooled
        obs, exp = obs[:-1], exp[:-1]
    return float(scistats.chisquare(obs, exp).pvalue)


def _fit(target, draft, sampling):
    probs = _exact_joint(target, sampling)
    counts = _speculative_counts(target, draft, sampling)
    tv = 0.5 * float((counts / counts.sum() - probs).abs().sum())
    return tv, _tv_bound(probs, N_SAMPLES), _chi2_pvalue(counts, probs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
    ids=["t1", "t0.7-topk5-topp0.9"],
)
def test_model_draft_samples_the_target_distribution(target, draft_model, sampling):
    # the draft must really differ from the target, or the test proves nothing
    gap = 0.5 * (_exact_joint(target, sampling) - _exact_joint(draft_model, sampling)).abs().sum()
    assert gap > 0.3
    tv, bound, pvalue = _fit(target, ModelDraft(draft_model, "d"), sampling)
    assert tv < bound, (tv, bound)
    assert pvalue > 1e-4, pvalue


def test_deterministic_ngram_draft_samples_the_target_distribution(target):
    sampling = SamplingParams(temperature=1.0)
    assert NGramDraft().propose(PROMPT, 1, sampling, None).tokens == [3]
    tv, bound, pvalue = _fit(target, NGramDraft(), sampling)
    assert tv < bound, (tv, bound)
    assert pvalue > 1e-4, pvalue


def _resample_from_target(p, q, guesses, generator):
    """A classic mistake: after a rejection draw from p instead of norm(max(0, p - q))."""
    k = len(guesses)
    for i, x in enumerate(guesses):
        u = torch.rand((), generator=generator)
        qx = 1.0 if q is None else float(q[i, x])
        if u * qx >= float(p[i, x]):
            return i, int(sample(p[i], generator))
    return k, int(sample(p[k], generator))


def _accept_always(p, q, guesses, generator):
    """Another: trust the draft (as if p = q)."""
    return len(guesses), int(sample(p[len(guesses)], generator))


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", [_resample_from_target, _accept_always])
def test_wrong_acceptance_rule_fails_the_same_test(target, draft_model, wrong_rule, monkeypatch):
    monkeypatch.setattr(loop, "verify_sampled", wrong_rule)
    tv, bound, pvalue = _fit(target, ModelDraft(draft_model, "d"), SamplingParams(temperature=1.0))
    # The same verdict the correct rule passes must fail; chi-square is the sharper of the two
    # (the resample-from-p mistake shifts the joint law by TV ~0.06, below the N=2000 bound).
    assert not (tv < bound and pvalue > 1e-4), (tv, bound, pvalue)
    assert pvalue < 1e-8, pvalue


def test_verify_sampled_first_token_follows_p():
    """Unit check of the rule itself: the first emitted token is distributed as p[0]."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.2, 0.4]])
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        guess = int(sample(q[0], gen))
        kept, nxt = verify_sampled(p, q, [guess], gen)
        counts[guess if kept else nxt] += 1
    assert counts[4] == 0  # p gives it no mass, even though q proposes it 40% of the time
    assert 0.5 * float((counts / n - p[0]).abs().sum()) < _tv_bound(p[0], n)
