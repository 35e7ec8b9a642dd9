"""Every registered architecture through the one forward's serving backends.

The paged engine (continuous batching: prefill chunks, decodes, a preemption-free mixed
batch) must give each request exactly what it gets alone, and its logits must equal
transformers' own model; the ONNX graph (past/present backend, padding masks) must equal our
forward. Tiny random configs from tests/models/test_architectures.py (windows shorter than the
sequences, soft-capping, q/k norms, biases).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmopt.infer.batch import EngineConfig, SamplingParams, ServingEngine
from llmopt.infer.generate import generate
from llmopt.models.attention.paged import PagedAttention, PagedKVCache, SeqChunk, StepBatch
from llmopt.models.attention.static import KVCache
from llmopt.models.loading import save_pretrained
from tests.models.test_architectures import ARCHS, tiny

PROMPTS = [list(range(3, 14)), [5, 6, 7], list(range(40, 65)), [9] * 18]


def _static_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The reference: the model over a static cache, one prompt alone."""
    cache = KVCache.for_model(model, 1, len(prompt) + n)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache)[0, -1]
        out = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([[out[-1]]]), cache)[0, -1]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_equals_single_request_generate(arch):
    model = tiny(arch)
    alone = [generate(model, p, max_new_tokens=6, fast=False) for p in PROMPTS]
    assert alone == [_static_greedy(model, p, 6) for p in PROMPTS]
    # 20-token budget: the 25-token prompt is prefilled in two chunks beside running decodes
    config = EngineConfig(num_blocks=24, block_size=4, max_batched_tokens=20, runner="eager")
    engine = ServingEngine(model, config)
    batched = engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    assert batched == alone
    engine.blocks.check_all_free()


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_logits_equal_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    model = tiny(arch)
    save_pretrained(model, tmp_path / arch)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / arch, dtype=torch.float32).eval()
    cache = PagedKVCache.for_model(model, num_blocks=16, block_size=4)
    a, b = PROMPTS[0], PROMPTS[2]
    tables = ([3, 7, 1, 12, 5], [0, 2, 4, 6, 8, 10, 11, 13])  # non-contiguous blocks
    with torch.no_grad():
        expected = [ref(torch.tensor([p])).logits[0] for p in (a, b)]
        # step 1: a whole, b's first 20 tokens; step 2: b's last 5 tokens
        first = StepBatch.build(
            [SeqChunk(a, 0, tables[0], 0), SeqChunk(b[:20], 0, tables[1], 0)], 4
        )
        logits = model.hidden_states(first.tokens[None], PagedAttention(cache, first))
        logits = model.lm_head(logits)[0]
        second = StepBatch.build([SeqChunk(b[20:], 20, tables[1], 0)], 4)
        tail = model(second.tokens[None], PagedAttention(cache, second))[0]
    torch.testing.assert_close(logits[: len(a)], expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[len(a) :], expected[1][:20], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tail, expected[1][20:], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "qwen3"])
def test_onnx_export_of_every_block_kind_equals_our_forward(tmp_path, arch):
    import onnxruntime as ort

    from llmopt.export import export_onnx

    model = tiny(arch)
    out = export_onnx(model, tmp_path / "onnx")
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    kv_heads, k_dim, v_dim = model.kv_layout()
    a, b = PROMPTS[0], PROMPTS[1]
    pad = len(a) - len(b)  # left padding, as HF batches prompts of unequal length
    feeds = {
        "input_ids": np.array([a, [0] * pad + b]),
        "attention_mask": np.array([[1] * len(a), [0] * pad + [1] * len(b)]),
        "position_ids": np.array([list(range(len(a))), [0] * pad + list(range(len(b)))]),
    }
    for i in range(model.config.num_layers):
        feeds[f"past_key_values.{i}.key"] = np.zeros((2, kv_heads, 0, k_dim), np.float32)
        feeds[f"past_key_values.{i}.value"] = np.zeros((2, kv_heads, 0, v_dim), np.float32)
    logits = session.run(None, feeds)[0]
    assert np.isfinite(logits).all()
    with torch.no_grad():
        ours_a, ours_b = (model(torch.tensor([p]))[0].numpy() for p in (a, b))
    assert np.abs(logits[0] - ours_a).max() < 1e-4
    assert np.abs(logits[1, pad:] - ours_b).max() < 1e-4
