"""Tree steps of the fused forward (speculative draft trees): every node's logits equal a
plain chain step over its root-to-node path, for every registered architecture (sliding
windows and soft caps included), batched with other sequences; hidden states and caller
inputs; malformed trees are refused before the cache is touched."""

from __future__ import annotations

import os

from tests.paths import KERNEL_CACHE

os.environ.setdefault("LLMOPT_KERNEL_CACHE", str(KERNEL_CACHE))

import pytest  # noqa: E402
import torch  # noqa: E402

from llmopt.infer.fast import FusedModel  # noqa: E402
from tests.infer.test_fused_forward import CONFIGS, tiny_model  # noqa: E402

BLOCK = 4
# parents of a 7-node tree: a root, two children, grandchildren on both branches, one deeper
TREE = [-1, 0, 0, 1, 1, 2, 3]
TREE_TOKENS = [5, 17, 33, 8, 61, 2, 44]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (conftest's `one_thread`)."""


def _cache(fused: FusedModel, blocks: int = 24):
    k = torch.zeros(fused.kv_shape(blocks * BLOCK))
    return k, torch.zeros_like(k)


def _slots(table: list[int], rows: range) -> list[int]:
    return [table[r // BLOCK] * BLOCK + r % BLOCK for r in rows]


def _prefill(fused, k, v, table, prompt):
    n = len(prompt)
    fused.forward_tensors(
        torch.tensor(prompt), torch.arange(n), torch.tensor(_slots(table, range(n))),
        torch.tensor([0, n]), torch.tensor([n]), torch.tensor([table], dtype=torch.int32),
        torch.tensor([n - 1]), k, v, BLOCK,
    )  # fmt: skip


def _path(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = TREE[node]
    return out[::-1]


def _depth(node: int) -> int:
    return len(_path(node)) - 1


def _chain_logits(model, prompt, table, node):
    """Logits after prompt + the tokens on the root-to-node path, by chain steps."""
    fused = FusedModel(model)
    k, v = _cache(fused)
    _prefill(fused, k, v, table, prompt)
    toks = [TREE_TOKENS[i] for i in _path(node)]
    n0, n = len(prompt), len(prompt) + len(toks)
    return fused.forward_tensors(
        torch.tensor(toks), torch.arange(n0, n), torch.tensor(_slots(table, range(n0, n))),
        torch.tensor([0, len(toks)]), torch.tensor([n]), torch.tensor([table], dtype=torch.int32),
        torch.tensor([len(toks) - 1]), k, v, BLOCK,
    )[0]  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tree_nodes_equal_chain_steps_over_their_paths(name):
    model = tiny_model(name)
    fused = FusedModel(model)
    k, v = _cache(fused)
    prompt = [(7 * i + 3) % 90 for i in range(9)]
    table = [11, 3, 19, 0, 7, 14]  # scrambled blocks
    other_prompt, other_table = [4, 9, 1], [2, 5, 8]
    _prefill(fused, k, v, table, prompt)
    _prefill(fused, k, v, other_table, other_prompt)
    n0, nodes = len(prompt), len(TREE)
    # one step: the tree of sequence 0 beside a plain decode token of sequence 1
    tokens = TREE_TOKENS + [12]
    positions = [n0 + _depth(i) for i in range(nodes)] + [len(other_prompt)]
    slots = _slots(table, range(n0, n0 + nodes)) + _slots(other_table, [len(other_prompt)])
    parents = TREE + [-1]
    hidden = torch.empty(nodes + 1, model.config.hidden_size)
    logits = fused.forward_tensors(
        torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots),
        torch.tensor([0, nodes, nodes + 1]), torch.tensor([n0 + nodes, len(other_prompt) + 1]),
        torch.tensor([table, other_table + [0] * 3], dtype=torch.int32),
        torch.arange(nodes + 1), k, v, BLOCK, parents=torch.tensor(parents), hidden=hidden,
    )  # fmt: skip
    for node in range(nodes):
        want = _chain_logits(model, prompt, table, node)
        torch.testing.assert_close(logits[node], want, rtol=1e-5, atol=1e-5)
    # the plain decode beside the tree is the same as alone
    alone = FusedModel(model)
    k2, v2 = _cache(alone)
    _prefill(alone, k2, v2, other_table, other_prompt)
    solo = alone.forward_tensors(
        torch.tensor([12]), torch.tensor([3]), torch.tensor(_slots(other_table, [3])),
        torch.tensor([0, 1]), torch.tensor([4]), torch.tensor([other_table], dtype=torch.int32),
        torch.tensor([0]), k2, v2, BLOCK,
    )[0]  # fmt: skip
    torch.testing.assert_close(logits[nodes], solo, rtol=1e-5, atol=1e-5)
    # hidden rows are the final-norm states the head reads: head(hidden) = logits
    if not model.config.final_softcap:
        head = model.lm_head.weight if hasattr(model, "lm_head") else None
        if head is not None:
            torch.testing.assert_close(hidden @ head.T, logits, rtol=1e-4, atol=1e-4)


def test_inputs_replace_the_embedding_lookup():
    model = tiny_model("llama")
    fused = FusedModel(model)
    k, v = _cache(fused)
    k2, v2 = _cache(fused)
    table = [0, 1, 2]
    toks = torch.tensor([3, 9, 27, 5])
    embeds = model.embed_tokens.weight[toks].detach().contiguous()
    args = (torch.arange(4), torch.tensor(_slots(table, range(4))), torch.tensor([0, 4]),
            torch.tensor([4]), torch.tensor([table], dtype=torch.int32), torch.arange(4))  # fmt: skip
    want = fused.forward_tensors(toks, *args, k, v, BLOCK)
    got = fused.forward_tensors(torch.zeros(4, dtype=torch.long), *args, k2, v2, BLOCK,
                                inputs=embeds)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "parents, positions, match",
    [
        ([-1, 0, 2], [5, 6, 7], "must be -1 or an earlier token"),
        ([-1, 0, 0], [5, 6, 7], r"must be 6 \(its parent's \+ 1\)"),
        ([-1, -1, 1], [4, 5, 6], r"must be 5 \(the cached length"),
        ([-1, 0], [5, 6, 7], "one entry per token"),
    ],
)
def test_malformed_trees_are_refused_before_the_cache_is_written(parents, positions, match):
    model = tiny_model("llama")
    fused = FusedModel(model)
    k, v = _cache(fused)
    table = [0, 1, 2]
    _prefill(fused, k, v, table, [1, 2, 3, 4, 5])
    before = k.clone()
    with pytest.raises(ValueError, match=match):
        fused.forward_tensors(
            torch.tensor([7, 8, 9]), torch.tensor(positions), torch.tensor(_slots(table, range(5, 8))),
            torch.tensor([0, 3]), torch.tensor([8]), torch.tensor([table], dtype=torch.int32),
            torch.arange(3), k, v, BLOCK, parents=torch.tensor(parents),
        )  # fmt: skip
    assert torch.equal(k, before)
