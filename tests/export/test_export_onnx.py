"""ONNX export with KV cache: onnxruntime's prefill + decode steps match llmopt's logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llmopt.export import ExportError, export_onnx
from llmopt.models import KVCache
from tests.export_fixtures import PROMPT, greedy, tiny_llama


def _ort_greedy(session, cfg, prompt: list[int], n: int, dtype) -> tuple[list[int], list]:
    """Greedy tokens from the ONNX graph, feeding its present k/v back as the next past."""
    past = {
        f"past_key_values.{i}.{kind}": np.zeros((1, cfg.num_kv_heads, 0, cfg.head_dim), dtype)
        for i in range(cfg.num_layers)
        for kind in ("key", "value")
    }
    ids, tokens, all_logits = np.array([prompt]), [], []
    for _ in range(n):
        done = next(iter(past.values())).shape[2]
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((1, done + ids.shape[1]), np.int64),
            "position_ids": np.arange(done, done + ids.shape[1])[None],
        }
        logits, *presents = session.run(None, feeds | past)
        all_logits.append(logits[0])
        tokens.append(int(logits[0, -1].argmax()))
        past = dict(zip(past, presents, strict=True))
        ids = np.array([[tokens[-1]]])
    return tokens, all_logits


@pytest.mark.slow
@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-4), ("fp16", 3e-2)])
def test_onnx_prefill_decode_and_greedy_match(tmp_path, dtype, atol):
    import onnxruntime as ort

    model = tiny_llama()
    out = export_onnx(model, tmp_path / "onnx", dtype=dtype)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == (
        "float32" if dtype == "fp32" else "float16"
    )
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    np_dtype = np.float32 if dtype == "fp32" else np.float16
    tokens, onnx_logits = _ort_greedy(session, model.config, PROMPT, 16, np_dtype)
    # ours, step by step with llmopt's own KV cache: prefill then single-token decodes
    cache = KVCache.for_model(model, max_len=len(PROMPT) + 16)
    with torch.no_grad():
        ours = [model(torch.tensor([PROMPT]), cache)[0]]
        for token in tokens[:3]:
            ours.append(model(torch.tensor([[token]]), cache)[0])
    assert onnx_logits[0].shape == (len(PROMPT), model.config.vocab_size)
    for theirs, mine in zip(onnx_logits[:4], ours, strict=True):
        diff = np.abs(theirs.astype(np.float32) - mine.numpy()).max()
        assert diff < atol, diff
    if dtype == "fp32":
        assert tokens == greedy(model, PROMPT)


def test_onnx_refuses_bad_dtype(tmp_path):
    with pytest.raises(ExportError, match=r"dtype='int4' is not supported"):
        export_onnx(tiny_llama(), tmp_path / "x", dtype="int4")
    assert not (tmp_path / "x").exists()


def test_mixture_of_experts_is_refused_by_name_before_writing(tmp_path):
    from llmopt.models import ModelConfig, build_model
    from llmopt.models.moe import MoEConfig

    config = ModelConfig(
        name="t-mixtral", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2, max_seq_len=32, architecture="mixtral",
        moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden=16),
    )  # fmt: skip
    model = build_model(config, seed=0).eval()
    with pytest.raises(
        ExportError, match="ONNX export of mixture-of-experts models \\('mixtral'\\)"
    ):
        export_onnx(model, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()
