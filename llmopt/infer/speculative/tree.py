"""Draft trees (EAGLE-2, Li et al. 2024): candidates expanded by draft confidence under a node
budget, verified in one target pass, and the rules that keep the output exact.

A tree hangs from the root, the last committed token (not yet in the target's cache). Node i
holds a guessed token, its parent (-1: the root), its depth (1 = the root's children) and its
score, the draft's log-probability of the whole path; a child never scores above its parent,
so the best `budget` nodes by score are closed under ancestors (ties go to the shallower).

Verification walks from the root: greedy keeps the child whose token is the target's argmax
(so the output is exactly greedy decoding); sampling tries the children in score order, each
a deterministic guess whose draft law is one-hot, so guess c is kept with probability r(c)
under the residual r (the target's law with the rejected siblings removed and renormalised;
Chen et al.'s rule with q = δ_c, applied in turn as in SpecInfer's multi-candidate
verification). If no child is kept the next token is drawn from the residual; either way each
emitted token follows the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmopt.infer.sampling import sample


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: the root
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(float(score))
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1: the root) in score order, best first."""
        kids = [i for i, p in enumerate(self.parents) if p == node]
        return sorted(kids, key=lambda i: -self.scores[i])

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def best(self, budget: int) -> DraftTree:
        """The `budget` best nodes (an ancestor-closed subtree), parents renumbered, in an
        order where every parent comes before its children."""
        order = sorted(range(len(self)), key=lambda i: (-self.scores[i], self.depths[i], i))
        keep = set(order[:budget])
        for i in list(keep):  # closure against float ties
            keep.update(self.path(i))
        kept = sorted(keep, key=lambda i: (self.depths[i], -self.scores[i], i))
        new = {old: n for n, old in enumerate(kept)}
        out = DraftTree()
        for old in kept:
            parent = self.parents[old]
            out.add(self.tokens[old], new[parent] if parent >= 0 else -1, self.scores[old])
        return out

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)


def verify_tree_greedy(tree: DraftTree, argmax: list[int]) -> tuple[list[int], int]:
    """(accepted nodes from the root down, the token after them). argmax[0] is the target's
    argmax at the root, argmax[1 + i] at node i."""
    path: list[int] = []
    node = -1
    while True:
        want = argmax[node + 1]
        match = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if match is None:
            return path, want
        path.append(match)
        node = match


def verify_tree_sampled(
    tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """(accepted nodes, the next token) by sequential one-hot rejection at each node.

    probs [1 + len(tree), vocab]: the target's (temperature/top-k/top-p processed) law at the
    root (row 0) and after each node (row 1 + i)."""
    path: list[int] = []
    node = -1
    while True:
        residual = probs[node + 1].clone()
        kept = None
        for child in tree.children(node):
            token = tree.tokens[child]
            total = float(residual.sum())
            if total <= 0:
                break
            u = float(torch.rand((), generator=generator))
            if u * total < float(residual[token]):
                kept = child
                break
            residual[token] = 0.0
        if kept is None:
            total = residual.sum()
            law = residual / total if total > 0 else probs[node + 1]
            return path, int(sample(law, generator))
        path.append(kept)
        node = kept
