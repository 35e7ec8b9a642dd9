"""lm-eval's `local-completions` against `llmopt serve` scores like `--model llmopt`.

lm-eval sends its loglikelihood requests as batches of token-id prompts with `echo`,
`logprobs=1` and `max_tokens=1`, and reads each continuation's log-likelihood and greediness
from the echoed prompt's logprobs; it finds the server's tokenizer through vLLM's /tokenize,
/detokenize and /tokenizer_info. The same offline tasks as tests/eval/test_lm_eval_adapter.py.
"""

from __future__ import annotations

import pytest
from lm_eval.tasks import TaskManager

import llmopt.eval.lm_eval_adapter  # noqa: F401  (registers the `llmopt` backend)
from tests.eval.test_lm_eval_adapter import QUESTIONS, _leaves, model_dir  # noqa: F401 (fixture)
from tests.serve_fixtures import Server


def _evaluate(model: str, model_args: str, root, monkeypatch, batch_size: int = 1):
    from lm_eval import simple_evaluate

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["llmopt_tiny_mc", "llmopt_tiny_gen"],
        task_manager=TaskManager(include_path=str(root)),
        batch_size=batch_size,
        log_samples=True,
        device="cpu",
    )


@pytest.mark.slow
def test_local_completions_against_the_server_equals_the_llmopt_backend(model_dir, monkeypatch):  # noqa: F811
    srv = Server(model_dir / "model", "--kv-blocks", "256", "--block-size", "16")
    try:
        args = f"base_url={srv.url}/v1/completions,model=tiny,max_length=32,max_retries=1"
        served = _evaluate("local-completions", args, model_dir, monkeypatch, batch_size=4)
    finally:
        srv.stop()
    ours = _evaluate(
        "llmopt", f"pretrained={model_dir / 'model'},max_length=32", model_dir, monkeypatch
    )
    for task in ("llmopt_tiny_mc", "llmopt_tiny_gen"):
        for key, value in ours["results"][task].items():
            if isinstance(value, float) and not key.endswith("_stderr,none"):
                assert served["results"][task][key] == pytest.approx(value, abs=1e-6), (task, key)
    assert ours["results"]["llmopt_tiny_mc"]["acc,none"] == pytest.approx(0.75)
    mc = zip(served["samples"]["llmopt_tiny_mc"], ours["samples"]["llmopt_tiny_mc"], strict=True)
    compared = 0
    for a, b in mc:  # every choice's log-likelihood and is-greedy flag
        for x, y in zip(_leaves(a["resps"]), _leaves(b["resps"]), strict=True):
            assert x == (pytest.approx(y, abs=1e-4) if isinstance(y, float) else y)
            compared += 1
    assert compared == 2 * sum(len(choices) for _, choices, _ in QUESTIONS)
    gen = zip(served["samples"]["llmopt_tiny_gen"], ours["samples"]["llmopt_tiny_gen"], strict=True)
    for a, b in gen:  # greedy text up to the same stop strings
        assert a["resps"] == b["resps"]
