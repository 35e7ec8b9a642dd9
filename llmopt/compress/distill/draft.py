"""A reduced-vocabulary head for a distilled draft: the draft scores only the K tokens that
make up nearly all of the text, so its head costs K/V of the full one.

For SmolLM2-135M the 49152 x 576 head is 28M multiply-adds per token, more than a 3-layer
draft's blocks together; with K = 8192 it is 4.7M. The head is a `ScatterHead`: logits of
the K kept ids, written into a full-vocabulary row that is -inf elsewhere, so the draft still
speaks the target's vocabulary (ids unchanged, `check_vocabularies` passes) and verification
stays exact — a token the draft cannot propose is simply never guessed, and in sampling mode
its draft probability is 0, which rejection sampling handles exactly.

A draft directory is a normal model directory (it loads and evaluates as a full-head model)
plus `llmopt_draft_vocab.json` with the kept ids; `make_draft` applies the head when the file
is there.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from llmopt.artifacts import atomic_write_text
from llmopt.errors import LlmoptError
from llmopt.models.spec import spec_for

VOCAB_FILE = "llmopt_draft_vocab.json"


class DraftVocabError(LlmoptError, ValueError):
    """A draft vocabulary that cannot be used; the message names the value."""


def frequent_tokens(token_ids: torch.Tensor, k: int, vocab_size: int, always=()) -> torch.Tensor:
    """The k most frequent ids of `token_ids` (ties: lower id first) plus `always`, sorted."""
    if not 1 <= k <= vocab_size:
        raise DraftVocabError(f"draft vocabulary size {k} must be in [1, {vocab_size}]")
    counts = torch.bincount(token_ids.reshape(-1).long(), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) / (2 * vocab_size)  # stable ties
    for token in always:
        counts[int(token)] = float("inf")
    return torch.sort(torch.topk(counts, k).indices).values


class ScatterHead(nn.Module):
    """hidden -> full-vocabulary logits, computed for `ids` only (-inf elsewhere)."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight[ids].detach().clone(), requires_grad=False)
        self.register_buffer("ids", ids.to(weight.device, torch.long), persistent=False)
        self.vocab_size = vocab_size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        part = torch.nn.functional.linear(h, self.weight)
        out = part.new_full((*part.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, part)


def with_reduced_head(model: nn.Module, ids: torch.Tensor) -> nn.Module:
    """`model` (in place) with its head restricted to `ids`; the embedding is untouched."""
    spec = spec_for(model)
    vocab = model.config.vocab_size
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise DraftVocabError(f"draft vocabulary ids must lie in [0, {vocab}); got {ids.numel()}")
    if ids.unique().numel() != ids.numel():
        raise DraftVocabError("draft vocabulary ids repeat")
    head = spec.top_module(model, "head")
    setattr(model, spec.head, ScatterHead(head.weight, ids, vocab))
    return model


def save_draft_vocab(directory: str | Path, ids: torch.Tensor, **info) -> Path:
    path = Path(directory) / VOCAB_FILE
    atomic_write_text(path, json.dumps({"ids": [int(i) for i in ids], **info}))
    return path


def read_draft_vocab(directory: str | Path) -> torch.Tensor | None:
    """The kept ids of a draft directory, or None when it has no reduced vocabulary."""
    path = Path(directory) / VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["ids"]
        return torch.tensor(ids, dtype=torch.long)
    except (ValueError, KeyError, TypeError) as exc:
        raise DraftVocabError(f"{path}: not a draft vocabulary ({exc})") from exc


def write_draft_vocab(model_dir: str | Path, text: str, tokenizer: str, k: int, **kw) -> Path:
    """Count the tokens of the training text and keep its k most frequent (plus the stop
    tokens) as `model_dir`'s draft vocabulary; returns the vocabulary file."""
    from llmopt.data.tokens import TokenData
    from llmopt.models.loading import load_model

    model = load_model(model_dir)
    config = model.config
    data = TokenData.from_config(text, tokenizer, kw.get("max_chars"), 1, 0, config.vocab_size)
    always = [t for t in (*config.stop_token_ids, config.bos_token_id) if t is not None]
    ids = frequent_tokens(data.inputs, k, config.vocab_size, always)
    counts = torch.bincount(data.inputs.reshape(-1), minlength=config.vocab_size)
    coverage = float(counts[ids].sum()) / max(int(counts.sum()), 1)
    return save_draft_vocab(model_dir, ids, text=text, k=int(ids.numel()), coverage=coverage)
