"""Tiny model configs and directories shared across test packages, written once here so a
change of convention (a field, the tokenizer) lands in every test that builds one.

`tests/conftest.py` wraps these as fixtures (`tiny_config`, `smollm2_tokenizer`, `tiny_hf_dir`);
modules that need a config at import time (spawned workers pickle it) import them directly.
"""

from __future__ import annotations

from pathlib import Path

from llmopt.models import ModelConfig, build_model
from llmopt.models.loading import save_pretrained
from llmopt.models.tokenizer import Tokenizer

SMOLLM2_VOCAB = 49152  # SmolLM2's tokenizer: a tiny model over it can be run by the CLIs

# A 2-layer GQA model over SmolLM2's vocabulary; each test overrides what it needs.
_SMOL_BASE = dict(
    vocab_size=SMOLLM2_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=128,
)


def tiny_gqa_config() -> ModelConfig:
    """A small GQA Llama config whose dims every TP degree up to 4 divides."""
    return ModelConfig(
        name="tiny",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        max_seq_len=64,
        rope_theta=10000.0,
    )


def smol_config(name: str, **overrides) -> ModelConfig:
    """A tiny config with SmolLM2's vocabulary; `overrides` replace the base fields."""
    return ModelConfig(name=name, **{**_SMOL_BASE, **overrides})


def save_model_dir(path: Path, config: ModelConfig, seed: int, tokenizer: Tokenizer) -> Path:
    """Build `config` with `seed` and save it HF-style with `tokenizer` at `path`."""
    return save_pretrained(build_model(config, seed=seed), path, tokenizer=tokenizer)


def add_gguf_llama_header(writer, cfg: ModelConfig) -> None:
    """The hyper-parameter keys a llama-architecture GGUF carries for `cfg`."""
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
