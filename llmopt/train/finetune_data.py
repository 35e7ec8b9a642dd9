"""The trainer's data: which tokenizer, checked against the model, and which dataset.

The tokenizer always belongs to the model being trained (`init_from`, else the preset when it
is a packaged model) unless `tokenizer` overrides it; an override whose vocabulary differs from
the model's own tokenizer, or any tokenizer with ids beyond the model's embedding, is refused
naming both sizes (a raw IndexError deep in the embedding, or silent training on the wrong
ids, otherwise).
"""

from __future__ import annotations

from typing import Any

from llmopt.train.config import TrainConfig, TrainConfigError

LEGACY_TOKENIZER = "smollm2-135m"  # random-init presets that ship no tokenizer


class VocabularyMismatchError(TrainConfigError):
    """The tokenizer's vocabulary does not fit the model being trained."""


def own_tokenizer(cfg: TrainConfig) -> str:
    """The spec of the trained model's own tokenizer."""
    if cfg.init_from:
        return cfg.init_from
    from llmopt.models.registry import is_model_name

    return cfg.model if is_model_name(cfg.model) else LEGACY_TOKENIZER


def resolve_tokenizer(cfg: TrainConfig, model_vocab: int) -> tuple[str, Any]:
    """(spec, Tokenizer) for this run, after the vocabulary checks (module doc)."""
    from llmopt.models.loading import load_tokenizer

    spec = cfg.tokenizer or own_tokenizer(cfg)
    tokenizer = load_tokenizer(spec)
    if cfg.tokenizer and cfg.init_from and cfg.tokenizer != cfg.init_from:
        own = load_tokenizer(cfg.init_from)
        if own.vocab_size != tokenizer.vocab_size:
            raise VocabularyMismatchError(
                f"--tokenizer {cfg.tokenizer} has a vocabulary of {tokenizer.vocab_size} tokens "
                f"but --init-from {cfg.init_from} was trained with {own.vocab_size}; drop "
                "--tokenizer to use the model's own"
            )
    if tokenizer.vocab_size > model_vocab:
        raise VocabularyMismatchError(
            f"tokenizer {spec} has a vocabulary of {tokenizer.vocab_size} tokens but the model "
            f"embeds only {model_vocab}; use the model's own tokenizer or a larger vocab_size"
        )
    return spec, tokenizer


def build_data(cfg: TrainConfig, model_vocab: int):
    """TokenData (corpus) or SFTData (--data) for this run."""
    from llmopt.data.tokens import TokenData

    if cfg.data is None and (cfg.corpus == "random" or cfg.corpus.startswith("random:")):
        return TokenData.from_config(
            cfg.corpus, "", cfg.max_chars, cfg.seq_len, cfg.seed, model_vocab
        )
    spec, tokenizer = resolve_tokenizer(cfg, model_vocab)
    if cfg.data is None:
        return TokenData.from_config(
            cfg.corpus, spec, cfg.max_chars, cfg.seq_len, cfg.seed, model_vocab
        )
    from llmopt.data.sft import SFTData

    return SFTData.build(
        cfg.data,
        tokenizer,
        cfg.seq_len,
        cfg.seed,
        fmt=cfg.format,
        packing=cfg.packing,
        eval_fraction=cfg.eval_fraction,
    )
