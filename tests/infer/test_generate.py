"""`generate`: KV-cache decoding equals recomputing everything, sampling controls, stopping."""

from __future__ import annotations

import os

from tests.paths import KERNEL_CACHE

# fast-path kernel builds stay inside the repo (ignored runs/), as in test_fast_decode.py
os.environ.setdefault("LLMOPT_KERNEL_CACHE", str(KERNEL_CACHE))

import pytest  # noqa: E402
import torch  # noqa: E402

from llmopt.infer.generate import generate  # noqa: E402
from llmopt.infer.sampling import SamplingParams, logits_to_probs  # noqa: E402

GREEDY = SamplingParams()


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
    sampling = SamplingParams(temperature=1.5, top_k=40, top_p=0.9)
    got = generate(tiny_model, [3, 4, 5], max_new_tokens=16, sampling=sampling, seed=7)
    ref = _naive(tiny_model, [3, 4, 5], 16, sampling, torch.Generator().manual_seed(7))
    assert got == ref
    again = generate(tiny_model, [3, 4, 5], max_new_tokens=16, sampling=sampling, seed=7)
    other = generate(tiny_model, [3, 4, 5], max_new_tokens=16, sampling=sampling, seed=8)
    assert again == got and other != got


def test_top_k_one_is_greedy(tiny_model):
    sampled = generate(
        tiny_model,
        [9, 8, 7],
        max_new_tokens=12,
        sampling=SamplingParams(temperature=1.0, top_k=1),
        seed=0,
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


# ---------------------------------------------------------------- `llmopt generate --json`
@pytest.fixture(scope="module")
def small_dir(tiny_hf_dir):
    """A random 2-layer model with SmolLM2's real tokenizer, saved as a HF directory."""
    return tiny_hf_dir("small", seed=0, max_seq_len=64, bos_token_id=1, eos_token_id=2)


def _cli_json(capsys, *args: str) -> dict:
    import json

    from llmopt.cli import main

    assert main(["generate", *args, "--json", "--ignore-eos"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_reports_decode_and_prefill_rates_fast_by_default(small_dir, capsys):
    base = ("--model", str(small_dir), "--prompt", "Hello there friend", "--max-new-tokens", "9")
    fast = _cli_json(capsys, *base)
    eager = _cli_json(capsys, *base, "--eager")
    assert fast["decode_path"] == "fused" and fast["fallback_reason"] is None
    assert eager["decode_path"] == "eager" and eager["fallback_reason"] == "eager requested"
    assert fast["token_ids"] == eager["token_ids"] and len(fast["token_ids"]) == 9
    for result in (fast, eager):
        assert result["decode_tokens_per_s"] > 0 and result["prefill_tokens_per_s"] > 0
        # decode rate excludes the prefill: 8 decode steps (the 1st token comes from prefill)
        assert result["decode_tokens_per_s"] == pytest.approx(8 / result["decode_s"], rel=0.01)
        assert result["prefill_tokens_per_s"] == pytest.approx(
            result["prompt_tokens"] / result["prefill_s"], rel=0.01
        )
    head8 = _cli_json(capsys, *base, "--int8-head")
    assert head8["decode_path"] == "fused" and len(head8["token_ids"]) == 9


def test_cli_int8_head_with_eager_is_one_line_error(small_dir, capsys):
    from llmopt.cli import main

    args = ["generate", "--model", str(small_dir), "--prompt", "hi", "--eager", "--int8-head"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--int8-head applies to the fast decode path" in err
