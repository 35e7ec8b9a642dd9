"""`llmopt generate` and `llmopt eval` through the real CLI entry point."""

from __future__ import annotations

import json
import re

import pytest
import torch

from llmopt.cli import main
from llmopt.infer.generate import generate
from llmopt.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def small_dir(tiny_hf_dir):
    """A random 1-layer model with SmolLM2's real tokenizer, saved as a HF directory."""
    return tiny_hf_dir(
        "small", seed=0, hidden_size=32, intermediate_size=64, num_layers=1, max_seq_len=64,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def test_generate_smollm_says_paris(capsys):
    rc = main(
        ["generate", "--model", "smollm2-135m", "--prompt", "The capital of France is",
         "--max-new-tokens", "8"]
    )  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0
    assert "Paris" in out.out
    assert "5 prompt + 8 new tokens" in out.err


def test_generate_json_matches_python_api(small_dir, capsys):
    rc = main(["generate", "--model", str(small_dir), "--prompt", "Hello there", "--json",
               "--max-new-tokens", "6", "--ignore-eos"])  # fmt: skip
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    from llmopt.models.loading import load_model

    tok = load_tokenizer(str(small_dir))
    ids = generate(load_model(str(small_dir)), tok.encode("Hello there"), max_new_tokens=6)
    assert result["token_ids"] == ids and result["new_tokens"] == 6
    assert result["prompt_tokens"] == 2 and result["stop_reason"] == "length"
    assert result["text"] == tok.decode(ids, skip_special_tokens=True)


def test_generate_chat_uses_template_and_seeded_sampling_repeats(small_dir, capsys):
    args = ["generate", "--model", str(small_dir), "--prompt", "hi", "--chat", "--json",
            "--system", "Be brief.", "--temperature", "1.0", "--top-p", "0.9", "--seed", "3",
            "--max-new-tokens", "5", "--ignore-eos"]  # fmt: skip
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["prompt"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]


def test_generate_streams_text(small_dir, capsys):
    rc = main(["generate", "--model", str(small_dir), "--prompt", "a b c", "--max-new-tokens",
               "4", "--ignore-eos"])  # fmt: skip
    out = capsys.readouterr()
    tok = load_tokenizer(str(small_dir))
    from llmopt.models.loading import load_model

    ids = generate(load_model(str(small_dir)), tok.encode("a b c"), max_new_tokens=4)
    assert rc == 0
    assert out.out == tok.decode(ids, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "gpt-7"], "unknown model 'gpt-7'; known names: smollm2-135m"),
        (["--max-new-tokens", "-2"], "--max-new-tokens -2 must be >= 0"),
        (["--prompt", "word " * 80], "prompt of 81 tokens is longer than the model context"),
        (["--max-new-tokens", "100"], "prompt of 2 tokens \\+ max_new_tokens=100 exceeds"),
        (["--top-p", "0"], "--top-p 0 must be > 0 and <= 1"),
        (["--system", "x"], "--system only applies with --chat"),
    ],
)
def test_generate_bad_input_is_one_line(small_dir, capsys, extra, message):
    args = ["generate", "--model", str(small_dir), "--prompt", "hi there", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llmopt generate: error: ")
    assert re.search(message, err), err


def test_generate_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    assert "--chat" in capsys.readouterr().out


def test_torch_threads_flag(small_dir, capsys):
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--model", str(small_dir), "--prompt", "x", "--threads", "1",
                     "--max-new-tokens", "1", "--json"]) == 0  # fmt: skip
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
