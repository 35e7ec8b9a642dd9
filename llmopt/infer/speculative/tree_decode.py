"""Batch-1 speculative decoding with a feature head and draft trees, on the fused kernels.

One round: the head expands a tree from the root (the last committed token) — depth 1 is the
root's top-k, then at each depth the k best nodes so far are expanded, each into its top-k
children (EAGLE-2's dynamic tree) — the best `budget` nodes are verified in one tree step of
the target (`FusedModel.forward_tensors(parents=...)`), the accepted path's keys/values are
moved to their positions' cache rows (the rest are left to be overwritten) and the head
catches up on the accepted tokens with the target's own features in one chain step, which
also gives the next root's children.

Caches: the target's is paged like `FastDecoder`'s (identity block table, row = position; a
tree's i-th token sits at row n + i); the head's has blocks of one row so every expanded node
is a "sequence" whose block table lists the context rows, its ancestors' rows and its own:
the one-layer head attends to exactly its path without tree metadata.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from llmopt.errors import UsageError
from llmopt.infer.fast import FusedModel
from llmopt.infer.sampling import SamplingParams, logits_to_probs
from llmopt.infer.speculative.tree import DraftTree, verify_tree_greedy, verify_tree_sampled
from llmopt.models.feature_head import FeatureHead

TARGET_BLOCK = 16


@dataclass(frozen=True)
class TreeConfig:
    """depth: expansion steps of the head; top_k: children per expanded node and nodes
    expanded per depth; budget: tree nodes verified per target pass (1 + budget tokens).
    depth=γ, top_k=1, budget=γ is a chain of γ guesses."""

    depth: int = 4
    top_k: int = 4
    budget: int = 8

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"tree {name}={value!r} must be an integer >= 1")
        if self.budget > self.depth * self.top_k * self.top_k:
            raise UsageError(
                f"tree budget={self.budget} exceeds the {self.depth * self.top_k**2} nodes a "
                f"depth-{self.depth}, top-{self.top_k} expansion can make"
            )


@dataclass
class TreeStats:
    rounds: int = 0
    accepted: int = 0  # guesses kept over all rounds
    verified_nodes: int = 0  # tree nodes sent to the target
    accept_lengths: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_calls: int = 0
    draft_prefill_s: float = 0.0  # the head over the prompt (prefill, not decode)
    decode_s: float = 0.0
    generated: int = 0

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens a target pass yields (accepted guesses + the one it adds): τ."""
        return (self.accepted + self.rounds) / max(self.rounds, 1)

    @property
    def first_accept_rate(self) -> float:
        """Share of rounds whose first guess was kept (a chain's α at depth 1)."""
        return sum(1 for n in self.accept_lengths if n > 0) / max(self.rounds, 1)

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "accepted": self.accepted,
            "verified_nodes": self.verified_nodes,
            "tokens_per_pass": self.tokens_per_pass,
            "first_accept_rate": self.first_accept_rate,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "draft_calls": self.draft_calls,
            "draft_prefill_s": self.draft_prefill_s,
            "decode_s": self.decode_s,
            "generated": self.generated,
        }


def draft_runtime(head: FeatureHead, threads: int | None) -> FusedModel:
    """The head's block, norm and head as a one-layer fused model: bf16 weights (the block is
    read once per expansion step; half the bytes of fp32), INT8 rows for the draft head."""
    layer = copy.deepcopy(head.layer).to(torch.bfloat16).eval()
    return FusedModel(layer, threads=threads, int8_head=True)


class FeatureTreeDecoder:
    """Greedy or sampled generation of one prompt by `target` with `head` proposing trees."""

    def __init__(
        self,
        target: torch.nn.Module,
        head: FeatureHead,
        max_len: int,
        tree: TreeConfig | None = None,
        threads: int | None = None,
    ) -> None:
        self.tree_config = tree or TreeConfig()
        cfg = target.config
        if not 0 < max_len <= cfg.max_seq_len:
            raise UsageError(f"max_len={max_len} must be in [1, max_seq_len={cfg.max_seq_len}]")
        if head.config.target_vocab != cfg.vocab_size:
            raise UsageError("the feature head was trained for another vocabulary")
        self.head = head.eval()
        self.target = FusedModel(target, threads=threads)
        self.draft = draft_runtime(head, threads)
        self.max_len = max_len
        t = self.tree_config
        rows = -(-(max_len + t.budget + 1) // TARGET_BLOCK) * TARGET_BLOCK
        self.k = torch.zeros(self.target.kv_shape(rows))
        self.v = torch.zeros_like(self.k)
        self.table = torch.arange(rows // TARGET_BLOCK, dtype=torch.int32).view(1, -1)
        draft_rows = max_len + 2 + t.depth * t.top_k
        self.dk = torch.zeros(self.draft.kv_shape(draft_rows))
        self.dv = torch.zeros_like(self.dk)
        self.hidden = cfg.hidden_size

    # ---- the two models' calls ----
    def _target(self, tokens, positions, rows, seq_len, parents=None):
        n = len(tokens)
        hidden = torch.empty(n, self.hidden)
        logits = self.target.forward_tensors(
            torch.tensor(tokens), torch.tensor(positions), torch.tensor(rows),
            torch.tensor([0, n]), torch.tensor([seq_len]), self.table, torch.arange(n),
            self.k, self.v, TARGET_BLOCK, parents=parents, hidden=hidden,
        )  # fmt: skip
        return logits, hidden

    def _draft_chain(self, tokens, features, start):
        """Head over the committed tokens at positions start.. (rows = positions); the last
        row's (feature g, draft log-probs)."""
        n = len(tokens)
        inputs = self.head.inputs(torch.tensor(tokens), features).contiguous()
        rows = torch.arange(start, start + n)
        hidden = torch.empty(1, self.hidden)
        table = torch.arange(start + n, dtype=torch.int32).view(1, -1)
        logits = self.draft.forward_tensors(
            torch.zeros(n, dtype=torch.long), rows, rows, torch.tensor([0, n]),
            torch.tensor([start + n]), table, torch.tensor([n - 1]), self.dk, self.dv, 1,
            hidden=hidden, inputs=inputs,
        )  # fmt: skip
        self.stats.draft_calls += 1
        return hidden[0], torch.log_softmax(logits[0], -1)

    def _draft_nodes(self, tree, nodes, node_g, node_row, context):
        """Head over tree nodes (one 'sequence' each, its path as its block table)."""
        count = len(nodes)
        tokens = torch.tensor([tree.tokens[i] for i in nodes])
        parent_g = torch.stack([node_g[tree.parents[i]] for i in nodes])
        inputs = self.head.inputs(tokens, parent_g).contiguous()
        depth = [tree.depths[i] for i in nodes]
        width = context + max(depth)
        table = torch.zeros(count, width, dtype=torch.int32)
        base = torch.arange(context, dtype=torch.int32)
        for j, node in enumerate(nodes):
            path = tree.path(node)
            table[j, :context] = base
            table[j, context : context + len(path)] = torch.tensor([node_row[p] for p in path])
        positions = torch.tensor([context - 1 + d for d in depth])
        slots = torch.tensor([node_row[i] for i in nodes])
        hidden = torch.empty(count, self.hidden)
        logits = self.draft.forward_tensors(
            torch.zeros(count, dtype=torch.long), positions, slots, torch.arange(count + 1),
            positions + 1, table, torch.arange(count), self.dk, self.dv, 1,
            hidden=hidden, inputs=inputs,
        )  # fmt: skip
        self.stats.draft_calls += 1
        return hidden, torch.log_softmax(logits, -1)

    # ---- one round ----
    def _expand(self, root_g, root_logp, context) -> DraftTree:
        """EAGLE-2 expansion from the root; returns the best `budget` nodes."""
        cfg = self.tree_config
        ids = self.head.ids
        tree = DraftTree()
        node_g: dict[int, torch.Tensor] = {-1: root_g}
        top = torch.topk(root_logp, cfg.top_k)
        frontier = [
            tree.add(int(ids[j]), -1, float(s))
            for s, j in zip(top.values.tolist(), top.indices.tolist(), strict=True)
        ]
        node_row: dict[int, int] = {}
        next_row = context
        # a node at depth d needs d nodes of the budget: deeper expansions could never be kept
        for _ in range(1, min(cfg.depth, cfg.budget)):
            chosen = sorted(frontier, key=lambda i: -tree.scores[i])[: cfg.top_k]
            for i in chosen:
                node_row[i] = next_row
                next_row += 1
            g, logp = self._draft_nodes(tree, chosen, node_g, node_row, context)
            top = torch.topk(logp, cfg.top_k, dim=-1)
            frontier = []
            for j, node in enumerate(chosen):
                node_g[node] = g[j]
                base = tree.scores[node]
                for s, k in zip(top.values[j].tolist(), top.indices[j].tolist(), strict=True):
                    frontier.append(tree.add(int(ids[k]), node, base + float(s)))
        return tree.best(cfg.budget)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> list[int]:
        sampling = sampling or SamplingParams()
        stops = (
            set()
            if eos_token_id is None
            else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
        )
        n = len(prompt_ids)
        if n == 0:
            raise UsageError("the prompt is empty; generation needs at least one token")
        if n + max_new_tokens + self.tree_config.depth + 1 > self.max_len:
            raise UsageError(
                f"prompt ({n}) + max_new_tokens ({max_new_tokens}) + tree depth "
                f"({self.tree_config.depth}) + 1 exceeds max_len={self.max_len}"
            )
        self.stats = TreeStats()
        tokens = list(prompt_ids)
        features = torch.empty(self.max_len + 1, self.hidden)
        for start in range(0, n, 256):  # prefill in chunks, every row's feature kept
            end = min(n, start + 256)
            logits, hid = self._target(tokens[start:end], range(start, end), range(start, end), end)
            features[start:end] = hid
        probs = logits_to_probs(logits[-1:], sampling)[0]
        first = (
            int(probs.argmax())
            if sampling.greedy
            else int(torch.multinomial(probs, 1, generator=generator))
        )
        tokens.append(first)
        out = [first]
        tp = time.perf_counter()
        # head over the prompt and the first token: token p with feature p-1 (zeros at 0);
        # part of the prefill, like the target's (not in decode_s)
        feats = torch.cat([torch.zeros(1, self.hidden), features[:n]])
        root_g, root_logp = self._draft_chain(tokens, feats, 0)
        t0 = time.perf_counter()
        self.stats.draft_prefill_s = t0 - tp
        while len(out) < max_new_tokens and out[-1] not in stops:
            ctx = len(tokens) - 1  # committed tokens in the target cache; tokens[ctx] = root
            td = time.perf_counter()
            tree = self._expand(root_g, root_logp, len(tokens))
            tv = time.perf_counter()
            self.stats.draft_s += tv - td
            step_tokens = [tokens[-1], *tree.tokens]
            parents = [-1] + [p + 1 if p >= 0 else 0 for p in tree.parents]
            positions = [ctx] + [ctx + d for d in tree.depths]
            rows = list(range(ctx, ctx + len(step_tokens)))
            logits, hid = self._target(
                step_tokens, positions, rows, ctx + len(step_tokens), torch.tensor(parents)
            )
            if sampling.greedy:
                path, bonus = verify_tree_greedy(tree, logits.argmax(-1).tolist())
            else:
                probs = logits_to_probs(logits, sampling)
                path, bonus = verify_tree_sampled(tree, probs, generator)
            # the accepted nodes' keys/values to their positions' rows
            src = [ctx + 1 + node for node in path]
            dst = [ctx + 1 + d for d in range(len(path))]
            if src != dst:
                self.k[:, dst] = self.k[:, src]
                self.v[:, dst] = self.v[:, src]
            features[ctx] = hid[0]
            for d, node in enumerate(path):
                features[ctx + 1 + d] = hid[1 + node]
            new = [tree.tokens[i] for i in path] + [bonus]
            self.stats.verify_s += time.perf_counter() - tv
            self.stats.rounds += 1
            self.stats.accepted += len(path)
            self.stats.accept_lengths.append(len(path))
            self.stats.verified_nodes += len(tree)
            hit = next((i for i, tok in enumerate(new) if tok in stops), None)
            if hit is not None:
                new = new[: hit + 1]
            new = new[: max_new_tokens - len(out)]
            start = len(tokens)
            tokens.extend(new)
            out.extend(new)
            if len(out) >= max_new_tokens or out[-1] in stops:
                break
            td = time.perf_counter()
            root_g, root_logp = self._draft_chain(
                new, features[start - 1 : start - 1 + len(new)], start
            )
            self.stats.draft_s += time.perf_counter() - td
        self.stats.decode_s = time.perf_counter() - t0
        self.stats.generated = len(out)
        return out


@torch.inference_mode()
def calibrate_tree(decoder: FeatureTreeDecoder, prompt_ids: list[int], repeats: int = 7):
    """`TreeCosts` of `decoder` after `prompt_ids`, each pass timed apart (median of
    `repeats`, interleaved): a 1-token target step (the unit), the tree verify pass, the
    head's 2-token catch-up and one expansion call. Caches are overwritten."""
    from llmopt.infer.speculative.predict import TreeCosts

    cfg = decoder.tree_config
    n = len(prompt_ids)
    decoder.stats = TreeStats()
    decoder._target(prompt_ids, range(n), range(n), n)
    feats = torch.zeros(n + 1, decoder.hidden)
    tokens = [*prompt_ids, prompt_ids[-1]]
    root_g, root_logp = decoder._draft_chain(tokens, feats, 0)
    tree = decoder._expand(root_g, root_logp, len(tokens))
    parents = torch.tensor([-1] + [p + 1 if p >= 0 else 0 for p in tree.parents])
    positions = [n] + [n + d for d in tree.depths]
    chosen = list(range(min(cfg.top_k, len(tree))))
    node_row = {i: len(tokens) + i for i in range(len(tree))}
    node_g = {-1: root_g, **{i: root_g for i in range(len(tree))}}
    depth1 = DraftTree()
    for i in chosen:
        depth1.add(tree.tokens[i], -1, 0.0)
    passes = {
        "step": lambda: decoder._target([tokens[-1]], [n], [n], n + 1),
        "verify": lambda: decoder._target(
            [tokens[-1], *tree.tokens],
            positions,
            range(n, n + 1 + len(tree)),
            n + 1 + len(tree),
            parents,
        ),  # fmt: skip
        "chain": lambda: decoder._draft_chain(tokens[-2:], feats[-2:], len(tokens) - 2),
        "expand": lambda: decoder._draft_nodes(depth1, chosen, node_g, node_row, len(tokens)),
    }
    times: dict[str, list[float]] = {k: [] for k in passes}
    for _ in range(repeats):
        for name, fn in passes.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    step = med["step"]
    return TreeCosts(step, med["verify"] / step, med["chain"] / step, med["expand"] / step)
