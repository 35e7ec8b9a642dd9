"""Shared tiny models for the export tests (random weights, real SmolLM2 tokenizer)."""

from __future__ import annotations

import functools

import torch

from llmopt.models import ModelConfig, build_model


@functools.lru_cache(maxsize=1)
def smollm_tokenizer():
    from llmopt.models.loading import load_tokenizer

    return load_tokenizer("smollm2-135m")


def tiny_llama(vocab: int = 256, hidden: int = 64, seed: int = 0, **kw) -> torch.nn.Module:
    """A 2-layer GQA Llama with weights large enough that greedy choices are not near-ties."""
    cfg = ModelConfig(
        name="tiny-export",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=64,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )
    model = build_model(cfg, seed=None)
    model.init_weights(seed=seed, std=0.08)
    return model.eval()


def greedy(model: torch.nn.Module, prompt: list[int], n: int = 16) -> list[int]:
    from llmopt.infer.generate import generate

    return generate(model, prompt, max_new_tokens=n)


PROMPT = [5, 17, 42, 99, 3, 64]
