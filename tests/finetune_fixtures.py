"""Shared fixtures of the fine-tuning tests: a tiny HF-layout model with SmolLM2's tokenizer,
a small real chat data set (questions about web-bible verses) and a tokenizer of another size."""

from __future__ import annotations

import json
from pathlib import Path

from llmopt.models.loading import load_tokenizer
from llmopt.models.tokenizer import Tokenizer
from tests.tiny_models import save_model_dir, smol_config


def tiny_hf_model(directory: Path, vocab_size: int | None = None, tokenizer=None) -> Path:
    """tests/tiny_models.py's SmolLM2-vocabulary model, narrower and tied, saved HF-style."""
    tokenizer = tokenizer or load_tokenizer("smollm2-135m")
    config = smol_config(
        "tiny",
        vocab_size=vocab_size or tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        tie_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return save_model_dir(directory, config, 0, tokenizer)


def small_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE trained on a few sentences: a vocabulary unlike SmolLM2's."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(
        ["In the beginning God created the heavens and the earth."] * 4, trainer
    )
    return Tokenizer(backend, bos_token_id=0, eos_token_id=1)


def chat_jsonl(path: Path, n: int = 16) -> Path:
    """n chat records: 'Recite sentence i.' -> that sentence of the web-bible."""
    import re

    from llmopt.data.corpus import load_text

    text = load_text("corpus:web-bible", max_chars=20_000)
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)]
    verses = [s for s in sentences if len(s) > 30][:n]
    with path.open("w") as handle:
        for i, verse in enumerate(verses):
            messages = [
                {"role": "user", "content": f"Recite sentence {i + 1}."},
                {"role": "assistant", "content": verse[:120]},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path
