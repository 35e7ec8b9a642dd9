"""The `llmopt` lm-eval backend equals lm-eval's own `hf` backend on the same weights, offline."""

from __future__ import annotations

import json
import math

import pytest
from lm_eval.tasks import TaskManager  # the `lm-eval` package (a test dependency)

import llmopt.eval.lm_eval_adapter  # noqa: F401  (registers the `llmopt` backend)
from llmopt.models import build_model
from llmopt.models.loading import load_tokenizer, save_pretrained
from tests.tiny_models import smol_config

QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " a small green frog"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit"], 0),
    ("", [" In the beginning God created the heaven", " The end"], 0),
    ("One, two, three,", [" four", " five", " six, seven, eight, nine"], 0),
]
TEXTS = [
    "In the beginning God created the heavens and the earth. The earth was formless and empty. "
    "Darkness was on the surface of the deep and God's Spirit was hovering over the waters.",
    'God said, "Let there be light," and there was light. God saw the light, and saw that it was good.',
]
PROMPTS = [
    ("Q: What is two plus two?\nA:", "4"),
    ("And God said", " let"),
    ("The quick brown fox", " jumps"),
]


def _write_tasks(root):
    data = root / "data"
    data.mkdir()
    (data / "mc.jsonl").write_text(
        "".join(json.dumps({"q": q, "choices": c, "label": a}) + "\n" for q, c, a in QUESTIONS)
    )
    (data / "roll.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (data / "gen.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in PROMPTS)
    )
    common = "dataset_path: json\ntest_split: test\n"
    (root / "mc.yaml").write_text(
        f"task: llmopt_tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {data / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (root / "roll.yaml").write_text(
        f"task: llmopt_tiny_rolling\n{common}dataset_kwargs:\n  data_files:\n    test: {data / 'roll.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    (root / "gen.yaml").write_text(
        f"task: llmopt_tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {data / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n', '.']\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer):
    root = tmp_path_factory.mktemp("lmeval")
    config = smol_config("tiny-smol", max_seq_len=256, tie_embeddings=True)
    model = build_model(config, seed=None)
    model.init_weights(seed=3, std=0.3)  # peaked enough that greedy choices are not near-ties
    save_pretrained(model, root / "model", tokenizer=smollm2_tokenizer)
    _write_tasks(root)
    return root


def _leaves(value):
    """The numbers and strings of a nested response (lists of lists of tuples)."""
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _evaluate(backend: str, root, monkeypatch, chat: bool = False):
    from lm_eval import simple_evaluate

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = ["llmopt_tiny_mc", "llmopt_tiny_gen"]
    return simple_evaluate(
        model=backend,
        model_args=f"pretrained={root / 'model'},dtype=float32,max_length={96 if chat else 32}",
        tasks=tasks if chat else [*tasks, "llmopt_tiny_rolling"],
        task_manager=TaskManager(include_path=str(root)),
        batch_size=1,
        log_samples=True,
        device="cpu",
        apply_chat_template=chat,
    )


@pytest.mark.slow
def test_llmopt_backend_equals_hf_backend(model_dir, monkeypatch):
    ours = _evaluate("llmopt", model_dir, monkeypatch)
    ref = _evaluate("hf", model_dir, monkeypatch)
    _same_results(ours, ref, count=6)
    # the rolling task really spans more than one window of max_length=32 tokens
    tokens = load_tokenizer(str(model_dir / "model")).encode(TEXTS[0])
    assert len(tokens) > 32
    gen = [s["resps"][0][0] for s in ours["samples"]["llmopt_tiny_gen"]]
    assert any(gen) and all("\n" not in g and "." not in g for g in gen)
    assert math.isfinite(ours["results"]["llmopt_tiny_rolling"]["word_perplexity,none"])


@pytest.mark.slow
def test_apply_chat_template_equals_hf_backend(model_dir, monkeypatch):
    """`--apply_chat_template`: SmolLM2's template, the same prompts and scores as `hf`."""
    ours = _evaluate("llmopt", model_dir, monkeypatch, chat=True)
    ref = _evaluate("hf", model_dir, monkeypatch, chat=True)
    _same_results(ours, ref, count=3)
    prompts = [s["arguments"] for s in ours["samples"]["llmopt_tiny_gen"]]
    assert prompts == [s["arguments"] for s in ref["samples"]["llmopt_tiny_gen"]]
    assert "<|im_start|>user" in json.dumps(prompts)


def _same_results(ours, ref, count: int) -> None:
    compared = 0
    for task, metrics in ref["results"].items():
        for key, value in metrics.items():
            if isinstance(value, float) and not key.endswith("_stderr,none"):
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-4, abs=1e-4), (
                    task,
                    key,
                )
                compared += 1
    assert compared == count  # acc, acc_norm, exact match (+ word/byte perplexity, bpb)
    for task in ref["samples"]:
        ours_resps = [s["resps"] for s in ours["samples"][task]]
        ref_resps = [s["resps"] for s in ref["samples"][task]]
        assert len(ours_resps) == len(ref_resps) > 0
        for a, b in zip(ours_resps, ref_resps):
            for x, y in zip(_leaves(a), _leaves(b), strict=True):
                if isinstance(y, float):
                    assert x == pytest.approx(y, rel=1e-4, abs=1e-4), task
                else:
                    assert x == y, task  # generated text, greedy flags


def test_bad_model_args(model_dir):
    from llmopt.eval.lm_eval_adapter import LlmoptLM

    with pytest.raises(ValueError, match=r"max_length=999 must be in \[2, 256\]"):
        LlmoptLM(pretrained=str(model_dir / "model"), max_length=999)
    with pytest.raises(
        ValueError, match="dtype='int8' is not supported; valid choices: float32, bfloat16, float16"
    ):
        LlmoptLM(pretrained=str(model_dir / "model"), dtype="int8")
    with pytest.raises(
        ValueError,
        match=r"unknown model_args for --model llmopt: max_lenght; valid: pretrained, dtype",
    ):
        LlmoptLM.create_from_arg_string(f"pretrained={model_dir / 'model'},max_lenght=32")


@pytest.mark.slow
def test_lm_eval_command_line_runs_the_llmopt_backend(model_dir, tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "llmopt.eval.lm_eval_adapter", "run", "--model", "llmopt"]
    cmd += ["--model_args", f"pretrained={model_dir / 'model'}", "max_length=32"]
    cmd += [
        "--tasks",
        "llmopt_tiny_mc",
        "--include_path",
        str(model_dir),
        "--output_path",
        str(out),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    [result] = out.rglob("results_*.json")
    acc = json.loads(result.read_text())["results"]["llmopt_tiny_mc"]["acc,none"]
    assert acc == pytest.approx(0.75)  # 3 of the 4 questions (the same as the hf backend's)
