"""`generate`: KV-cache decoding equals recomputing everything, sampling controls, stopping."""

from __future__ import annotations

import os
from pathlib import Path

# fast-path kernel builds stay inside the repo (ignored runs/), as in test_fast_decode.py
os.environ.setdefault(
    "LLMOPT_KERNEL_CACHE", str(Path(__file__).resolve().parent.parent / "runs" / "kernel_cache")
)

import pytest  # noqa: E402
import torch  # noqa: E402

from llmopt.infer.generate import generate  # noqa: E402
from llmopt.infer.sampling import SamplingConfig, logits_to_probs  # noqa: E402

GREEDY = SamplingConfig()


def _naive(model, prompt: list[int], n: int, sampling=GREEDY, generator=None) -> list[int]:
    """Reference decoder: full recompute of the whole sequence for every token, no cache."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[:, -1]
        if sampling.greedy:
            ids.append(int(logits.argmax(-1)))
        else:
            probs = logits_to_probs(logits, sampling)
            ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return ids[len(prompt) :]


def test_greedy_generate_equals_full_recompute(tiny_model):
    for prompt in ([5], [1, 2, 3, 4, 5, 6, 7], list(range(40, 60))):
        assert generate(tiny_model, prompt, max_new_tokens=20) == _naive(tiny_model, prompt, 20)


def test_seeded_sampling_equals_full_recompute_with_same_generator(tiny_model):
    sampling = SamplingConfig(temperature=1.5, top_k=40, top_p=0.9)
    got = generate(tiny_model, [3, 4, 5], max_new_tokens=16, sampling=sampling, seed=7)
    ref = _naive(tiny_model, [3, 4, 5], 16, sampling, torch.Generator().manual_seed(7))
    assert got == ref
    again = generate(tiny_model, [3, 4, 5], max_new_tokens=16, sampling=sampling, seed=7)
    other = generate(tiny_model, [3, 4, 5], max_new_tokens=16, sampling=sampling, seed=8)
    assert again == got and other != got


def test_top_k_one_is_greedy(tiny_model):
    sampled = generate(
        tiny_model, [9, 8, 7], max_new_tokens=12, sampling=SamplingConfig(1.0, top_k=1), seed=0
    )
    assert sampled == generate(tiny_model, [9, 8, 7], max_new_tokens=12)


def test_stops_after_eos_and_streams_every_token(tiny_model):
    full = generate(tiny_model, [1, 2, 3], max_new_tokens=12)
    eos = full[4]
    first = full.index(eos)
    seen: list[int] = []
    out = generate(tiny_model, [1, 2, 3], max_new_tokens=12, eos_token_id=eos, on_token=seen.append)
    assert out == full[: first + 1] and out[-1] == eos
    assert seen == out
    assert generate(tiny_model, [1, 2, 3], max_new_tokens=0) == []


def test_bf16_generation_runs_with_bf16_cache(tiny_model):
    model = tiny_model.to(torch.bfloat16)
    out = generate(model, [1, 2, 3], max_new_tokens=8)
    assert len(out) == 8 and all(0 <= t < 128 for t in out)


def test_bad_prompts_are_rejected_early(tiny_model):
    with pytest.raises(ValueError, match="prompt of 64 tokens is longer than the model context"):
        generate(tiny_model, [1] * 64, max_new_tokens=1)
    with pytest.raises(ValueError, match="prompt of 60 tokens \\+ max_new_tokens=10 exceeds"):
        generate(tiny_model, [1] * 60, max_new_tokens=10)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(tiny_model, [], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt token ids \[128\] are outside the vocabulary"):
        generate(tiny_model, [1, 128], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens=-1 must be >= 0"):
        generate(tiny_model, [1], max_new_tokens=-1)
