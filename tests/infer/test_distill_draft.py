"""The reduced-vocabulary draft head: exact logits on its ids, exact speculative decoding."""

from __future__ import annotations

import pytest
import torch

from llmopt.compress.distill.draft import (
    DraftVocabError,
    ScatterHead,
    frequent_tokens,
    read_draft_vocab,
    save_draft_vocab,
    with_reduced_head,
)
from llmopt.infer.drafts import ModelDraft, make_draft
from llmopt.infer.generate import generate
from llmopt.infer.speculative.loop import SpeculativeConfig, speculative_generate
from llmopt.models import build_model
from llmopt.models.loading import save_pretrained


def test_frequent_tokens_counts_and_keeps_the_stop_tokens():
    ids = torch.tensor([5, 5, 5, 2, 2, 9, 9, 9, 9, 1])
    assert frequent_tokens(ids, 2, 10).tolist() == [5, 9]
    assert frequent_tokens(ids, 3, 10, always=[0]).tolist() == [0, 5, 9]
    assert frequent_tokens(ids, 3, 10).tolist() == [2, 5, 9]  # 2 and 1 by count, not id
    with pytest.raises(DraftVocabError, match=r"size 11 must be in \[1, 10\]"):
        frequent_tokens(ids, 11, 10)


def test_scatter_head_equals_the_full_head_on_its_ids(tiny_model):
    ids = torch.tensor([0, 3, 17, 100, 127])
    x = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        full = tiny_model(x)
        reduced = with_reduced_head(build_model(tiny_model.config, seed=0).eval(), ids)(x)
    assert isinstance(reduced.new_empty(0), torch.Tensor) and reduced.shape == full.shape
    torch.testing.assert_close(reduced[..., ids], full[..., ids])
    rest = torch.ones(128, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(reduced[..., rest]).all()
    for bad, match in [
        (torch.tensor([0, 128]), r"in \[0, 128\)"),
        (torch.tensor([1, 1]), "repeat"),
    ]:
        with pytest.raises(DraftVocabError, match=match):
            with_reduced_head(build_model(tiny_model.config, seed=0), bad)
    head = ScatterHead(torch.randn(10, 4), torch.tensor([2, 7]), 10)
    assert head.weight.shape == (2, 4)


def test_reduced_vocab_draft_decodes_exactly_and_loads_from_its_directory(tiny_model, tmp_path):
    draft_model = build_model(tiny_model.config.replace(num_layers=1), seed=4).eval()
    path = tmp_path / "draft"
    save_pretrained(draft_model, path)
    prompt = torch.randint(0, 128, (12,)).tolist()
    plain = generate(tiny_model, prompt, max_new_tokens=24, fast=False)
    # ids the target actually emits, and some it does not: the draft cannot guess all of them
    ids = torch.tensor(sorted(set(plain[:12]) | {0, 1, 2}))
    save_draft_vocab(path, ids, k=len(ids))
    assert read_draft_vocab(path).tolist() == ids.tolist()
    draft = make_draft(str(path), tiny_model)
    assert isinstance(draft, ModelDraft) and isinstance(draft.model.lm_head, ScatterHead)
    out = speculative_generate(
        tiny_model, draft, prompt, max_new_tokens=24, config=SpeculativeConfig(gamma=3)
    )
    assert out.tokens == plain  # greedy verification stays exact
    assert all(t in set(ids.tolist()) for t in draft.model.lm_head.ids.tolist())
    (path / "llmopt_draft_vocab.json").write_text("{}")
    with pytest.raises(DraftVocabError, match="not a draft vocabulary"):
        read_draft_vocab(path)
