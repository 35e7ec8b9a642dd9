"""Greedy speculative decoding: exact output, KV-cache rollback at every acceptance length."""

import pytest
import torch

from llmopt.infer.drafts import EarlyExitModel, ModelDraft, NGramDraft, Proposal
from llmopt.infer.generate import generate
from llmopt.infer.sampling import SamplingParams
from llmopt.infer.speculative import SpeculativeConfig, speculative_generate
from llmopt.models import KVCache, build_model
from tests.fixtures_speculative import one_thread_fixture, target_fixture  # noqa: F401


def _prompt(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class ScriptedDraft:
    """Knows the target's greedy continuation and spoils guess number `wrong_at` (0-based), so
    every round keeps exactly min(wrong_at, γ) guesses."""

    name = "scripted"
    forward_calls = 0

    def __init__(self, full_sequence: list[int], wrong_at: int, vocab: int = 128) -> None:
        self.full, self.wrong_at, self.vocab_size = full_sequence, wrong_at, vocab

    def start(self, prompt_ids, max_len):
        pass

    def propose(self, context, gamma, sampling, generator):
        assert context == self.full[: len(context)]  # the loop only commits verified tokens
        guesses = list(self.full[len(context) : len(context) + gamma])
        if self.wrong_at < len(guesses):
            guesses[self.wrong_at] = (guesses[self.wrong_at] + 1) % self.vocab_size
        return Proposal(guesses)


def _expected_rounds(max_new: int, gamma: int, wrong_at: int) -> dict[int, int]:
    """Accepted-length histogram of the rounds the loop must run (γ is clipped at the end)."""
    hist: dict[int, int] = {}
    done = 0
    while done < max_new:
        g = min(gamma, max_new - done - 1)
        kept = min(wrong_at, g)
        if g:
            hist[kept] = hist.get(kept, 0) + 1
        done += kept + 1
    return hist


def _assert_cache_matches_fresh_prefill(model, res, tokens: list[int]) -> None:
    """The engine's cache must hold exactly the keys/values of the committed tokens (rejected
    guesses' slots overwritten). Tolerance 1e-5: batched and incremental passes round matmuls
    differently in fp32."""
    n = res.context_len
    assert n == len(tokens) - 1  # every committed token but the last
    fresh = KVCache.for_model(model, 1, n)
    model(torch.tensor([tokens[:n]]), fresh)
    for layer in range(model.config.num_layers):
        k, v = res.engine.cached_kv(res.request, layer)  # [n, kv_heads, dim]
        assert k.shape[0] == n
        torch.testing.assert_close(k.permute(1, 0, 2), fresh.k[layer, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v.permute(1, 0, 2), fresh.v[layer, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma", [1, 2, 3, 5, 8])
def test_rollback_at_every_acceptance_length(target, gamma):
    prompt = _prompt(7, seed=gamma)
    max_new = 23
    ref = generate(target, prompt, max_new_tokens=max_new)
    for wrong_at in range(gamma + 1):  # 0 = every guess rejected ... gamma = all accepted
        draft = ScriptedDraft(prompt + ref, wrong_at)
        res = speculative_generate(
            target,
            draft,
            prompt,
            max_new_tokens=max_new,
            config=SpeculativeConfig(gamma=gamma, gamma_max=max(gamma, 12)),
        )
        assert res.tokens == ref, f"gamma={gamma} wrong_at={wrong_at}"
        assert dict(res.stats.accept_lengths) == _expected_rounds(max_new, gamma, wrong_at)
        assert res.stats.generated == max_new
        _assert_cache_matches_fresh_prefill(target, res, prompt + ref)


@pytest.mark.parametrize("wrong_at", [0, 2, 5])
def test_rollback_at_the_context_limit(target, wrong_at):
    ctx = target.config.max_seq_len
    prompt = _prompt(ctx - 20, seed=11)
    ref = generate(target, prompt, max_new_tokens=20)
    res = speculative_generate(
        target,
        ScriptedDraft(prompt + ref, wrong_at),
        prompt,
        max_new_tokens=20,
        config=SpeculativeConfig(gamma=5),
    )
    assert res.tokens == ref
    engine = res.engine
    assert engine.blocks.num_blocks * engine.blocks.block_size >= ctx
    assert res.context_len == ctx - 1
    _assert_cache_matches_fresh_prefill(target, res, prompt + ref)
    with pytest.raises(ValueError, match="= 65 tokens exceeds the model context max_seq_len=64"):
        speculative_generate(target, NGramDraft(), prompt, max_new_tokens=21)


def _drafts(target, tiny_config):
    other = build_model(tiny_config.replace(num_layers=1), seed=9).eval()
    return [
        ModelDraft(EarlyExitModel(target, 1), "early-exit:1"),
        ModelDraft(EarlyExitModel(target, 3), "early-exit:3"),
        ModelDraft(other, "separate"),
        NGramDraft(3),
    ]


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_identical_to_plain(target, tiny_config, gamma, adaptive):
    config = SpeculativeConfig(gamma=gamma, adaptive=adaptive, gamma_max=max(gamma, 8))
    prompts = [_prompt(5, seed=1), _prompt(1, seed=2), _prompt(12, seed=3) * 2]
    for prompt in prompts:
        ref = generate(target, prompt, max_new_tokens=30)
        for draft in _drafts(target, tiny_config):
            res = speculative_generate(target, draft, prompt, max_new_tokens=30, config=config)
            assert res.tokens == ref, (draft.name, prompt)
            st = res.stats
            assert st.generated == 30
            assert st.accepted + st.rounds == 30  # each round: its kept guesses + one token
            assert sum(st.accept_lengths.values()) == st.proposing_rounds


def test_self_draft_with_all_layers_accepts_everything(target):
    # The target drafting for itself: every guess must be accepted (alpha = 1).
    res = speculative_generate(target, ModelDraft(target, "self"), _prompt(6, 4), max_new_tokens=25)
    assert res.stats.rejections == 0
    assert res.stats.alpha == 1.0
    assert res.tokens == generate(target, _prompt(6, 4), max_new_tokens=25)


def test_eos_stops_generation(target):
    prompt = _prompt(6, seed=5)
    ref = generate(target, prompt, max_new_tokens=30)
    eos = ref[9]
    expected = ref[: ref.index(eos) + 1]
    draft = ScriptedDraft(prompt + ref, wrong_at=4)
    res = speculative_generate(
        target,
        draft,
        prompt,
        max_new_tokens=30,
        eos_token_id=eos,
        config=SpeculativeConfig(gamma=4),
    )
    assert res.tokens == expected
    assert res.tokens == generate(target, prompt, max_new_tokens=30, eos_token_id=eos)


def test_ngram_draft_proposes_the_continuation_of_the_last_match():
    draft = NGramDraft(max_n=3)
    draft.start([], 0)
    greedy = SamplingParams()
    ctx = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert draft.propose(ctx, 3, greedy, None).tokens == [8, 9, 1]
    ctx = ctx + [3, 4, 6, 7]  # "6 7" last followed by 3 (at index 8-9): latest match wins
    assert draft.propose(ctx, 2, greedy, None).tokens == [3, 4]
    assert draft.propose([1, 2, 3], 4, greedy, None).tokens == []  # no earlier occurrence
    assert draft.propose([4, 4, 4, 4], 5, greedy, None).tokens == [4] * 5  # periodic copy
    assert draft.propose([1, 2, 3, 1, 2], 5, greedy, None).tokens == [3, 1, 2, 3, 1]


def test_bad_arguments_are_named(target):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        speculative_generate(target, NGramDraft(), [], max_new_tokens=4)
    with pytest.raises(ValueError, match="token id 500 is outside the vocabulary"):
        speculative_generate(target, NGramDraft(), [1, 500], max_new_tokens=4)
    with pytest.raises(ValueError, match="gamma_min=1 <= gamma=0"):
        SpeculativeConfig(gamma=0)
    with pytest.raises(ValueError, match="early-exit layer count 4 must be in"):
        EarlyExitModel(target, 4)


@pytest.mark.slow
def test_real_smollm2_greedy_identical_with_ngram_and_int8_drafts():
    """The real 135M model on real text: speculative output equals plain greedy output."""
    from llmopt.data.corpus import load_text
    from llmopt.infer.drafts import make_draft
    from llmopt.models.loading import load_model, load_tokenizer

    model, tok = load_model("smollm2-135m"), load_tokenizer("smollm2-135m")
    text = load_text("corpus:web-bible")
    start = text.find("He who offered his offering the first day")
    prompt = tok.encode(text[start : start + 500])
    ref = generate(model, prompt, max_new_tokens=12)
    for spec, gamma in (("ngram:3", 4), ("int8", 3)):
        res = speculative_generate(
            model,
            make_draft(spec, model, tok),
            prompt,
            max_new_tokens=12,
            config=SpeculativeConfig(gamma=gamma),
        )
        assert res.tokens == ref, spec
        assert res.stats.accepted > 0, spec  # the repeated offering text is easy to guess
