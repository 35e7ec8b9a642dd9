"""Feature draft heads and draft trees: greedy output identical to plain decoding for chains
and trees (trained or not), the tree sampling rule exact (chi-square against the target law,
and a wrong rule caught), trees ancestor-closed, heads saved/loaded with a version and refused
for another target, training lowering its loss and resuming where it stopped."""

from __future__ import annotations

import os

from tests.paths import KERNEL_CACHE

os.environ.setdefault("LLMOPT_KERNEL_CACHE", str(KERNEL_CACHE))

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from llmopt.compress.distill.feature import (  # noqa: E402
    FeatureTrainConfig,
    FeatureTrainError,
    make_head,
    target_windows,
    train_feature_head,
)
from llmopt.infer.fast import FastDecoder  # noqa: E402
from llmopt.infer.sampling import SamplingParams  # noqa: E402
from llmopt.infer.speculative.tree import DraftTree, verify_tree_greedy, verify_tree_sampled  # noqa: E402
from llmopt.infer.speculative.tree_decode import FeatureTreeDecoder, TreeConfig  # noqa: E402
from llmopt.models.feature_head import FeatureHeadError, load_feature_head  # noqa: E402
from tests.infer.test_fused_forward import tiny_model  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (conftest's `one_thread`)."""


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def head(target):
    return make_head(target, torch.arange(0, 96, 2))  # 48 of the 96 ids


def _plain(target, prompt, n):
    return FastDecoder(target, len(prompt) + n + 1).greedy(prompt, n)[0]


@pytest.mark.parametrize("tree", [TreeConfig(3, 1, 3), TreeConfig(4, 3, 8), TreeConfig(2, 4, 6)])
def test_greedy_output_equals_plain_decoding(target, head, tree):
    for prompt in ([5, 9, 1, 33, 7], [11] * 12, list(range(3, 40, 3))):
        want = _plain(target, prompt, 20)
        dec = FeatureTreeDecoder(target, head, 60, tree)
        assert dec.generate(prompt, 20) == want
        assert dec.stats.rounds >= 1 and dec.stats.generated == 20


def test_a_head_that_predicts_the_target_is_accepted_in_full(target):
    """With the draft's head replaced by the target's exact continuation... (a sanity check
    of acceptance): a chain whose guesses are the plain output keeps every guess."""
    prompt = [5, 9, 1, 33, 7]
    want = _plain(target, prompt, 12)
    tree = DraftTree()
    parent = -1
    for token in want[1:4]:
        parent = tree.add(token, parent, 0.0)
    # target argmax at the root and after each node equals the plain continuation
    argmax = want[1:5]
    path, bonus = verify_tree_greedy(tree, argmax)
    assert path == [0, 1, 2] and bonus == want[4]


def test_eos_stops_generation(target, head):
    prompt = [5, 9, 1, 33, 7]
    want = _plain(target, prompt, 20)
    eos = want[6]
    dec = FeatureTreeDecoder(target, head, 60, TreeConfig(4, 3, 8))
    got = dec.generate(prompt, 20, eos_token_id=eos)
    assert got == want[: want.index(eos) + 1]


def test_best_nodes_are_ancestor_closed_and_parents_come_first():
    tree = DraftTree()
    a = tree.add(1, -1, -0.1)
    b = tree.add(2, -1, -2.0)
    c = tree.add(3, a, -0.3)
    tree.add(4, c, -0.35)
    tree.add(5, b, -2.1)
    tree.add(6, a, -1.0)
    best = tree.best(3)
    assert best.tokens == [1, 3, 4] and best.parents == [-1, 0, 1]
    assert best.depths == [1, 2, 3]
    for i, p in enumerate(best.parents):
        assert p < i


def test_greedy_walk_follows_the_matching_child():
    tree = DraftTree()
    a = tree.add(7, -1, -0.1)
    tree.add(8, -1, -0.2)
    b = tree.add(9, a, -0.3)
    tree.add(10, a, -0.4)
    # root argmax 7 -> node a; a's argmax 10 -> node 3; node 3's argmax 2 -> bonus
    argmax = [7, 10, 0, 0, 2]
    path, bonus = verify_tree_greedy(tree, argmax)
    assert path == [a, 3] and bonus == 2
    assert verify_tree_greedy(tree, [5, 0, 0, 0, 0]) == ([], 5)
    assert b == 2


def _law(seed: int, vocab: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)


def _two_token_laws(vocab: int = 6):
    """A target over two tokens: p(x1) and p(x2 | x1), and a tree guessing both levels."""
    p1 = _law(0, vocab)
    p2 = {x: _law(10 + x, vocab) for x in range(vocab)}
    tree = DraftTree()
    a = tree.add(2, -1, -0.1)
    b = tree.add(4, -1, -0.5)
    tree.add(1, a, -0.2)
    tree.add(3, a, -0.3)
    tree.add(0, b, -0.6)
    probs = torch.stack([p1, p2[2], p2[4], p2[1], p2[3], p2[0]])  # root, nodes 0..4
    return p1, p2, tree, probs


def _emitted_pairs(tree, probs, p2, draws, rule):
    gen = torch.Generator().manual_seed(123)
    counts = torch.zeros(probs.shape[1], probs.shape[1])
    for _ in range(draws):
        path, bonus = rule(tree, probs, gen)
        tokens = [tree.tokens[i] for i in path] + [bonus]
        if len(tokens) == 1:  # the second token comes from the target after the first
            tokens.append(int(torch.multinomial(p2[tokens[0]], 1, generator=gen)))
        counts[tokens[0], tokens[1]] += 1
    return counts


def _chi2_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    from scipy.stats import chisquare

    n = counts.sum()
    expected = (law * n).reshape(-1)
    keep = expected > 0
    return float(chisquare(counts.reshape(-1)[keep], expected[keep]).pvalue)


def test_tree_sampling_rule_emits_the_target_law():
    p1, p2, tree, probs = _two_token_laws()
    joint = torch.stack([p1[x] * p2[x] for x in range(6)])
    counts = _emitted_pairs(tree, probs, p2, 4000, verify_tree_sampled)
    assert _chi2_pvalue(counts, joint) > 1e-4


def test_a_rule_that_keeps_guesses_too_often_is_caught():
    def greedy_keep(tree, probs, gen):  # keeps the best child whenever the target allows it
        path, node = [], -1
        while True:
            kids = [c for c in tree.children(node) if probs[node + 1][tree.tokens[c]] > 0]
            if not kids:
                return path, int(torch.multinomial(probs[node + 1], 1, generator=gen))
            path.append(kids[0])
            node = kids[0]

    p1, p2, tree, probs = _two_token_laws()
    joint = torch.stack([p1[x] * p2[x] for x in range(6)])
    counts = _emitted_pairs(tree, probs, p2, 4000, greedy_keep)
    assert _chi2_pvalue(counts, joint) < 1e-8


def test_sampled_decoding_runs_and_stays_in_vocabulary(target, head):
    dec = FeatureTreeDecoder(target, head, 60, TreeConfig(3, 3, 6))
    gen = torch.Generator().manual_seed(0)
    out = dec.generate([5, 9, 1], 16, SamplingParams(temperature=0.7), gen)
    assert len(out) == 16 and all(0 <= t < 96 for t in out)


def test_heads_round_trip_with_a_version_and_refuse_another_target(target, head, tmp_path):
    head.save(tmp_path / "h", step=0)
    mask = os.umask(0o022)
    os.umask(mask)
    for name in ("feature_head.safetensors", "feature_head.json"):  # files follow the umask
        assert (tmp_path / "h" / name).stat().st_mode & 0o777 == 0o666 & ~mask
    back = load_feature_head(tmp_path / "h", target)
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    prompt = [5, 9, 1, 33, 7]
    one = FeatureTreeDecoder(target, head, 60, TreeConfig(3, 2, 4))
    two = FeatureTreeDecoder(target, back, 60, TreeConfig(3, 2, 4))
    assert one.generate(prompt, 10) == two.generate(prompt, 10)
    assert one.stats.accept_lengths == two.stats.accept_lengths
    meta = json.loads((tmp_path / "h" / "feature_head.json").read_text())
    meta["version"] = 99
    (tmp_path / "h" / "feature_head.json").write_text(json.dumps(meta))
    with pytest.raises(FeatureHeadError, match="version 99"):
        load_feature_head(tmp_path / "h", target)
    meta["version"] = 1
    (tmp_path / "h" / "feature_head.json").write_text(json.dumps(meta))
    other = tiny_model("qwen3")  # same vocabulary and hidden size, but check the vocabulary
    other.config = type(other.config)(**{**other.config.__dict__, "vocab_size": 95})
    with pytest.raises(FeatureHeadError, match="vocab 95"):
        load_feature_head(tmp_path / "h", other)


def test_bad_tree_settings_are_refused():
    with pytest.raises(ValueError, match="top_k=0"):
        TreeConfig(3, 0, 3)
    with pytest.raises(ValueError, match="budget=50 exceeds"):
        TreeConfig(2, 2, 50)
    with pytest.raises(FeatureTrainError, match="min_lr"):
        FeatureTrainConfig(lr=1e-4, min_lr=1e-3)


def test_training_lowers_the_loss_and_resumes(target, tmp_path):
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 96, (12, 24), generator=gen)
    data = target_windows(target, windows, top_k=8)
    ids = torch.arange(96)
    cfg = FeatureTrainConfig(seq_len=24, steps=40, batch=4, lr=3e-3, warmup=5, save_every=20)
    logs: list[dict] = []
    train_feature_head(
        target, data, tmp_path / "r", cfg, ids, log=lambda s: logs.append(json.loads(s))
    )
    assert logs[-1]["loss_feature"] < logs[0]["loss_feature"]
    # a longer run resumed from step 40 continues at 41 and ends at 60
    longer = FeatureTrainConfig(seq_len=24, steps=60, batch=4, lr=3e-3, warmup=5, save_every=20)
    more: list[dict] = []
    train_feature_head(target, data, tmp_path / "r", longer, ids, resume=True,
                       log=lambda s: more.append(json.loads(s)))  # fmt: skip
    assert [r["step"] for r in more] == [60]
    saved = json.loads((tmp_path / "r" / "head" / "feature_head.json").read_text())
    assert saved["step"] == 60


@pytest.mark.slow  # trains a head and runs two CLIs (~15 s on 2 cores)
def test_distill_feature_head_cli_trains_a_head_generate_uses(tiny_hf_dir, tmp_path, capsys):
    """`llmopt distill --feature-head` on real text, then `llmopt generate --draft <head>`:
    greedy output identical to plain decoding, stats with τ and the predicted speedup."""
    from llmopt.cli import main

    model_dir = tiny_hf_dir("fh-cli")
    out = tmp_path / "fh"
    rc = main(["distill", "--feature-head", "--teacher", str(model_dir), "--text",
               "mix:default", "--seq-len", "32", "--windows", "12",
               "--generations", "4", "--steps", "6", "--global-batch", "2", "--draft-vocab", "512",
               "--save-every", "3", "--out", str(out), "--json"])  # fmt: skip
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 6 and (out / "head" / "feature_head.json").is_file()
    rc = main(["generate", "--model", str(model_dir), "--prompt", "In the beginning God",
               "--max-new-tokens", "12", "--ignore-eos", "--draft", str(out / "head"),
               "--tree", "3x2x4", "--stats", "--json"])  # fmt: skip
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    spec = result["speculative"]
    assert spec["identical_to_plain"] is True
    assert spec["tokens_per_pass"] >= 1 and spec["predicted_speedup"] > 0
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--draft",
                 str(out / "head"), "--tree", "3x2"]) == 2  # fmt: skip
    assert "DEPTHxTOPKxBUDGET" in capsys.readouterr().err
    assert main(["distill", "--feature-head", "--teacher", str(model_dir), "--text", "mix:default",
                 "--generations", "2", "--out", str(tmp_path / "fh2")]) == 2  # fmt: skip
    assert "--generations 2" in capsys.readouterr().err
