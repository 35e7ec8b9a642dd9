"""Continuous batching: batched greedy output == single-request `generate`, token for token,
under chunked prefill, preemption, prefix hits, EOS, stop strings and n-gram speculation; and
every KV block is free after any mix of requests, aborts and preemptions."""

import random

import pytest
import torch

from llmopt.infer.batch import EngineConfig, InvalidRequestError, SamplingParams, ServingEngine
from llmopt.infer.generate import generate


def _prompts(lengths, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _text(ids):  # a stand-in detokenizer for the tokenizer-less tiny model: one char per id
    return "".join(chr(97 + t % 26) for t in ids)


def _truncate_at(out, eos):
    return out[: out.index(eos) + 1] if eos in out else out


LENGTHS = [3, 17, 30, 5, 40, 9, 1]


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_batched_tokens=16),
        EngineConfig(num_blocks=64, block_size=4, max_num_seqs=3, max_batched_tokens=64),
        EngineConfig(num_blocks=16, block_size=4, max_num_seqs=8, max_batched_tokens=64),
    ],
    ids=["chunked-prefill", "few-seqs", "preempting"],
)
@pytest.mark.parametrize("ngram", [0, 2])
def test_batched_greedy_equals_generate(tiny_model, config, ngram):
    prompts = _prompts(LENGTHS)
    prompts.append(prompts[1][:12] + [5, 6])  # shares three full blocks with prompt 1
    ref = [generate(tiny_model, p, max_new_tokens=20) for p in prompts]
    engine = ServingEngine(tiny_model, config)
    out = engine.generate(prompts, SamplingParams(max_tokens=20, ngram=ngram))
    assert out == ref
    engine.blocks.check_all_free()
    if config.num_blocks == 16:
        assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.prefix_hits > 0


def test_eos_and_stop_strings_match_truncated_generate(tiny_model):
    prompts = _prompts(LENGTHS)
    ref = [generate(tiny_model, p, max_new_tokens=20) for p in prompts]
    eos = ref[2][4]
    engine = ServingEngine(
        tiny_model, EngineConfig(num_blocks=64, block_size=4), eos_token_id=eos, detokenize=_text
    )
    assert engine.generate(prompts, SamplingParams(max_tokens=20, ngram=2)) == [
        _truncate_at(r, eos) for r in ref
    ]
    stop = _text(ref[0][6:8])
    reqs = [
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=20, stop=(stop,), ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    while engine.has_unfinished():
        engine.step()
    for req, r in zip(reqs, ref, strict=True):
        n = next((k for k in range(1, len(r) + 1) if stop in _text(r[:k])), len(r))
        assert req.output == r[:n]
        full = _text(r[:n])
        assert req.text == (full[: full.index(stop)] if stop in full else full)
        assert req.finish_reason == ("stop" if stop in full else "length")
    assert reqs[0].finish_reason == "stop" and len(reqs[0].output) <= 8


def test_ngram_speculation_accepts_guesses_on_repetitive_prompt(tiny_model):
    prompt = [7, 8, 9, 10] * 8
    ref = generate(tiny_model, prompt, max_new_tokens=24)
    engine = ServingEngine(tiny_model, EngineConfig(num_blocks=32, block_size=4))
    req = engine.add_request("r", prompt, SamplingParams(max_tokens=24, ngram=3))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert req.output == ref
    assert req.spec_proposed > 0
    # one step per emitted token, less one for every accepted guess
    assert steps == len(ref) - req.spec_accepted


def test_speculation_turns_itself_off_past_the_batch_threshold(tiny_model):
    """With speculative_max_batch=1, a speculating request proposes while it runs alone and
    stops proposing while a second request runs beside it; outputs stay the greedy ones."""
    prompt = [7, 8, 9, 10] * 8
    ref = generate(tiny_model, prompt, max_new_tokens=24)
    other = _prompts([5])[0]
    other_ref = generate(tiny_model, other, max_new_tokens=6)
    config = EngineConfig(num_blocks=32, block_size=4, speculative_max_batch=1)
    engine = ServingEngine(tiny_model, config)
    req = engine.add_request("r", prompt, SamplingParams(max_tokens=24, ngram=3))
    mate = engine.add_request("m", other, SamplingParams(max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    assert req.output == ref and mate.output == other_ref
    assert req.spec.off_rounds > 0  # while the mate ran
    assert req.spec_proposed > 0  # after it finished
    with pytest.raises(ValueError, match="speculative_max_batch=-1"):
        EngineConfig(speculative_max_batch=-1)


def test_seeded_sampling_alone_matches_generate_and_ignores_batch_mates(tiny_model):
    prompts = _prompts([6, 11, 4])
    cfg = SamplingParams(temperature=0.9, top_k=20, top_p=0.9)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=123)
    ref = generate(tiny_model, prompts[0], max_new_tokens=12, sampling=cfg, seed=123)
    alone = ServingEngine(tiny_model, EngineConfig(num_blocks=32, block_size=4))
    assert alone.generate([prompts[0]], params) == [ref]
    mixed = ServingEngine(tiny_model, EngineConfig(num_blocks=32, block_size=4))
    other = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    out = mixed.generate(prompts, [params, other, SamplingParams(max_tokens=12)])
    assert out[0] == ref


def test_abort_frees_blocks_and_unknown_abort_is_false(tiny_model):
    engine = ServingEngine(tiny_model, EngineConfig(num_blocks=32, block_size=4))
    engine.add_request("a", _prompts([20])[0], SamplingParams(max_tokens=30))
    engine.step()
    assert engine.blocks.num_used > 0
    assert engine.abort("a") is True and engine.abort("a") is False
    engine.blocks.check_all_free()
    assert not engine.has_unfinished() and engine.step() == []


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "the prompt is empty"),
        (
            [1, 500],
            SamplingParams(),
            r"prompt token ids \[500\] are outside the vocabulary \[0, 128\)",
        ),
        (
            [1] * 60,
            SamplingParams(max_tokens=5),
            "prompt of 60 tokens \\+ max_tokens=5 exceeds the model context of 64",
        ),
        ([1] * 10, SamplingParams(stop=("x",)), "stop strings need an engine with a tokenizer"),
    ],
)
def test_bad_requests_are_refused_early(tiny_model, prompt, params, match):
    engine = ServingEngine(tiny_model, EngineConfig(num_blocks=32, block_size=4))
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("r", prompt, params)
    assert not engine.has_unfinished()


def test_request_larger_than_the_pool_is_refused(tiny_model):
    engine = ServingEngine(tiny_model, EngineConfig(num_blocks=4, block_size=4))
    with pytest.raises(InvalidRequestError, match="needs 5 KV blocks; the cache has 4"):
        engine.add_request("r", [1] * 10, SamplingParams(max_tokens=10))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens=0 must be >= 1"),
        ({"temperature": -1.0}, r"temperature=-1.0 must be in \[0, 100\]"),
        ({"temperature": float("nan")}, "temperature=nan must be a finite number"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k=-2 must be >= 0"),
        ({"top_k": 1.5}, "top_k=1.5 must be an integer"),
        ({"seed": "x"}, "seed='x' must be an integer"),
        ({"stop": ("",)}, "must be a list of non-empty strings"),
    ],
)
def test_bad_sampling_values_are_refused(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def _held_counts(engine):
    counts = [0] * engine.blocks.num_blocks
    for req in engine.requests.values():
        for b in req.blocks:
            counts[b] += 1
    return counts


@pytest.mark.parametrize("seed", range(20))
def test_every_block_is_free_after_any_requests_aborts_and_preemptions(tiny_model, seed):
    rng = random.Random(seed)
    prefix = seed % 2 == 0
    ops = [
        (
            rng.choice(["add", "add", "abort", "step", "step", "step"]),
            rng.randint(1, 30),
            rng.randint(1, 12),
        )
        for _ in range(rng.randint(5, 40))
    ]
    engine = ServingEngine(
        tiny_model,
        EngineConfig(
            num_blocks=12,
            block_size=4,
            max_num_seqs=4,
            max_batched_tokens=12,
            prefix_caching=prefix,
        ),
    )
    base = list(range(40))
    n = 0
    for op, a, b in ops:
        if op == "add":
            engine.add_request(
                f"r{n}", base[: a % 30 + 1] + [a, b], SamplingParams(max_tokens=b, ngram=b % 3)
            )
            n += 1
        elif op == "abort" and engine.requests:
            engine.abort(sorted(engine.requests)[a % len(engine.requests)])
        else:
            engine.step()
        assert _held_counts(engine) == engine.blocks.ref_count
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
        assert _held_counts(engine) == engine.blocks.ref_count
    assert not engine.has_unfinished()
    engine.blocks.check_all_free()


@pytest.mark.slow
def test_real_smollm2_batched_greedy_equals_generate():
    from llmopt.models.loading import load_model, load_tokenizer

    model, tok = load_model("smollm2-135m"), load_tokenizer("smollm2-135m")
    system = "You are a helpful assistant. Answer briefly and precisely, in plain English. "
    texts = ["The capital of France is", "1, 2, 3, 4, 5,", "def add(a, b):\n   "]
    prompts = [tok.encode(system + t) for t in texts] + [tok.encode("Once upon a time")]
    ref = [generate(model, p, max_new_tokens=8, eos_token_id=tok.eos_token_id) for p in prompts]
    engine = ServingEngine(
        model,
        EngineConfig(num_blocks=7, block_size=8, max_num_seqs=4, max_batched_tokens=24),
        eos_token_id=tok.eos_token_id,
        detokenize=tok.decode,
    )
    assert engine.generate(prompts, SamplingParams(max_tokens=8, ngram=3)) == ref
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.prefix_hits > 0
    engine.blocks.check_all_free()


def test_prefix_of_a_finished_request_is_reused_exactly(tiny_model):
    system = _prompts([33], seed=7)[0]
    a, b = system + [1, 2], system + [3]
    ref = generate(tiny_model, b, max_new_tokens=6)
    engine = ServingEngine(
        tiny_model, EngineConfig(num_blocks=32, block_size=4, max_batched_tokens=64)
    )
    engine.generate([a], SamplingParams(max_tokens=1))  # finishes on its prefill step
    engine.blocks.check_all_free()
    req = engine.add_request("b", b, SamplingParams(max_tokens=6))
    while engine.has_unfinished():
        engine.step()
    assert req.num_prefix_hit_tokens == 32  # 8 full blocks of the 33 shared tokens
    assert req.output == ref
    assert engine.num_fed == 35 + 2 + 5  # a: 35, b: 2 uncached prompt tokens + 5 decodes
