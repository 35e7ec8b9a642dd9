"""Feature draft head for SmolLM2-135M: build its training data, train it, measure it.

    python benchmarks/feature_head.py data  --out runs/fh      # target features (slow part)
    python benchmarks/feature_head.py train --out runs/fh      # resumable (--resume)
    python benchmarks/feature_head.py bench --out runs/fh --json runs/fh/bench.json

Training text is a broad mix — World English Bible with every benchmark passage's book region
cut out, Python's reference docs, stdlib docstrings and comments (`mix:default`'s sources) —
plus the target's own greedy continuations of prompts from that mix. The benchmark measures on
text the head never saw: narrative = held-out Bible passages (John 1, Psalm 1), technical =
`corpus:torch-docs` (an evaluation-only corpus: no training or calibration mix may use it).
Plain decoding and speculation run the same fused kernels (the packaged Q4_1 GGUF as served),
on one thread, interleaved per prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

HELD_OUT_OPENINGS = (  # benchmark passages (benchmarks/speculative.py) and their surroundings
    "He who offered his offering the first day",
    "Give thanks to Yahweh, for he is good; For his lovingkindness",
    "This is the book of the generations of Adam",
    "In the beginning God created the heavens",
    "In the beginning was the Word",
    "Blessed is the man who doesn`t walk",
)
HELD_OUT_BEFORE, HELD_OUT_AFTER = 2_000, 40_000  # characters cut around each opening
TRAIN_SOURCES = {"web-bible": 260, "py-docs": 80, "stdlib-docs": 80, "stdlib-comments": 60}
NARRATIVE = (
    ("john-1", "In the beginning was the Word"),
    ("psalm-1", "Blessed is the man who doesn`t walk"),
)


def training_bible(text: str) -> str:
    """The Bible with every held-out region removed."""
    cuts = []
    for opening in HELD_OUT_OPENINGS:
        start = text.find(opening)
        if start < 0:
            raise ValueError(f"passage opening {opening!r} not found")
        cuts.append((max(0, start - HELD_OUT_BEFORE), start + HELD_OUT_AFTER))
    cuts.sort()
    parts, pos = [], 0
    for a, b in cuts:
        parts.append(text[pos:a])
        pos = max(pos, b)
    parts.append(text[pos:])
    return " ".join(parts)


def windows_of(ids: list[int], count: int, seq_len: int, rng: random.Random) -> list[list[int]]:
    starts = sorted(rng.sample(range(0, len(ids) - seq_len), count))
    return [ids[s : s + seq_len] for s in starts]


def load_target():
    from llmopt.models.loading import load_model, load_tokenizer

    return load_model("smollm2-135m", dtype="auto"), load_tokenizer("smollm2-135m")


def fused_forward(target, seq_len: int):
    """window [T] -> (logits, final-norm features) through the fused kernels (as served)."""
    from llmopt.infer.fast import FusedModel

    fused = FusedModel(target)
    rows = -(-seq_len // 16) * 16
    k = torch.zeros(fused.kv_shape(rows))
    v = torch.zeros_like(k)
    table = torch.arange(rows // 16, dtype=torch.int32).view(1, -1)

    def run(window):
        t = window.numel()
        pos = torch.arange(t)
        hidden = torch.empty(t, target.config.hidden_size)
        logits = fused.forward_tensors(
            window, pos, pos, torch.tensor([0, t]), torch.tensor([t]), table, pos, k, v, 16,
            hidden=hidden,
        )  # fmt: skip
        return logits, hidden

    return run


def fused_greedy(target):
    """(prompt, n) -> prompt + n greedy tokens through the fused batch-1 decoder."""
    from llmopt.infer.fast import FastDecoder

    def run(prompt, n):
        return list(prompt) + FastDecoder(target, len(prompt) + n + 1).greedy(prompt, n)[0]

    return run


def cmd_data(args) -> int:
    from llmopt.compress.distill.feature import own_generations, target_windows
    from llmopt.data.corpus import read_corpus

    torch.set_num_threads(args.threads)
    target, tok = load_target()
    rng = random.Random(0)
    windows, prompts = [], []
    for name, count in TRAIN_SOURCES.items():
        text = read_corpus(name)
        if name == "web-bible":
            text = training_bible(text)
        ids = tok.encode(text[: args.max_chars], add_bos=False)
        windows += windows_of(ids, int(count * args.scale), args.seq_len, rng)
        prompts += [w[:64] for w in windows_of(ids, max(1, int(10 * args.scale)), 64, rng)]
    t0 = time.time()
    gens = own_generations(target, prompts, args.seq_len - 64, fused_greedy(target))
    print(f"own generations: {len(gens)} x {args.seq_len} tokens in {time.time() - t0:.0f} s")
    windows += gens
    data = target_windows(
        target, torch.tensor(windows), 16,
        forward=fused_forward(target, args.seq_len),
        progress=lambda i, n: i % 25 == 0 and print(f"target windows {i}/{n} {time.time() - t0:.0f} s", flush=True),
    )  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data.save(out / "train_data.safetensors")
    counts = torch.bincount(data.tokens.reshape(-1).long(), minlength=target.config.vocab_size)
    json.dump({"windows": len(windows), "seq_len": args.seq_len, "generated": len(gens),
               "sources": TRAIN_SOURCES, "scale": args.scale, "counts_nonzero": int((counts > 0).sum())},
              open(out / "train_data.json", "w"))  # fmt: skip
    print(
        f"wrote {out / 'train_data.safetensors'}: {len(windows)} windows, {time.time() - t0:.0f} s"
    )
    return 0


def cmd_train(args) -> int:
    from llmopt.compress.distill.draft import frequent_tokens
    from llmopt.compress.distill.feature import FeatureData, FeatureTrainConfig, train_feature_head

    torch.set_num_threads(args.threads)
    target, _ = load_target()
    out = Path(args.out)
    data = FeatureData.load(out / "train_data.safetensors")
    cfg = FeatureTrainConfig(draft_vocab=args.draft_vocab, steps=args.steps, batch=args.batch,
                             lr=args.lr, save_every=args.save_every)  # fmt: skip
    config = target.config
    always = [t for t in (*config.stop_token_ids, config.bos_token_id) if t is not None]
    # draft vocabulary: the training text's and the target's own top-1 predictions' frequent ids
    pool = torch.cat([data.tokens.reshape(-1).long(), data.top_ids[..., 0].reshape(-1).long()])
    ids = frequent_tokens(pool, cfg.draft_vocab, config.vocab_size, always)
    n = data.tokens.shape[0]
    hold = max(4, n // 50)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    train = FeatureData(
        *(getattr(data, f)[perm[hold:]] for f in ("tokens", "features", "top_ids", "top_probs"))
    )
    held = FeatureData(
        *(getattr(data, f)[perm[:hold]] for f in ("tokens", "features", "top_ids", "top_probs"))
    )
    train_feature_head(target, train, out / "run", cfg, ids, resume=args.resume, eval_data=held)
    return 0


def _prompts(tok, chars: int) -> dict[str, list[int]]:
    from llmopt.data.corpus import read_corpus

    bible = read_corpus("web-bible")
    out = {}
    for name, opening in NARRATIVE:
        start = bible.find(opening)
        out[name] = (
            "narrative",
            tok.encode(bible[start : bible.rfind(" ", start, start + chars)], add_bos=False),
        )
    docs = read_corpus("torch-docs")
    for i, frac in enumerate((0.2, 0.6)):
        start = docs.find(" ", int(len(docs) * frac)) + 1
        out[f"torch-docs-{i}"] = (
            "technical",
            tok.encode(docs[start : docs.rfind(" ", start, start + chars)], add_bos=False),
        )
    return out


def cmd_bench(args) -> int:
    from llmopt.infer.drafts import NGramDraft, SpeculativeConfig
    from llmopt.infer.fast import FastDecoder
    from llmopt.infer.speculative import compare_with_plain
    from llmopt.infer.speculative.tree_decode import FeatureTreeDecoder, TreeConfig, calibrate_tree
    from llmopt.models.feature_head import load_feature_head

    torch.set_num_threads(1)
    target, tok = load_target()
    head = load_feature_head(Path(args.out) / "run" / "head", target)
    prompts = _prompts(tok, args.chars)
    trees = [TreeConfig(*map(int, t.split("x"))) for t in args.trees.split(",")]
    rows = []
    for name, (kind, ids) in prompts.items():
        max_len = len(ids) + args.new + 32
        plain_times, spec = [], {t: [] for t in trees}
        want = None
        for _ in range(args.repeats):
            want, plain_s = FastDecoder(target, max_len, threads=1).greedy(ids, args.new)
            plain_times.append(plain_s)
            for t in trees:
                tdec = FeatureTreeDecoder(target, head, max_len, t, threads=1)
                got = tdec.generate(ids, args.new)
                spec[t].append((tdec.stats, got == want))
        plain = statistics.median(plain_times)
        for t in trees:
            stats = [s for s, _ in spec[t]]
            same = all(ok for _, ok in spec[t])
            dec_s = statistics.median(s.decode_s for s in stats)
            s0 = stats[0]
            rows.append({
                "prompt": name, "kind": kind, "tree": f"{t.depth}x{t.top_k}x{t.budget}",
                "same": same, "tokens_per_pass": s0.tokens_per_pass, "first_accept": s0.first_accept_rate,
                "plain_tok_s": args.new / plain, "spec_tok_s": args.new / dec_s, "speedup": plain / dec_s,
                "draft_share": statistics.median(s.draft_s / s.decode_s for s in stats),
                "draft_calls_per_round": s0.draft_calls / max(s0.rounds, 1),
                "verify_ms": 1000 * statistics.median(s.verify_s / s.rounds for s in stats),
                "draft_ms_per_round": 1000 * statistics.median(s.draft_s / s.rounds for s in stats),
            })  # fmt: skip
            r = rows[-1]
            print(f"{name:12s} {r['tree']:8s} same={same} tau={r['tokens_per_pass']:.2f} "
                  f"a1={r['first_accept']:.2f} plain={r['plain_tok_s']:.1f} spec={r['spec_tok_s']:.1f} "
                  f"x{r['speedup']:.2f} verify={r['verify_ms']:.1f}ms draft={r['draft_ms_per_round']:.1f}ms",
                  flush=True)  # fmt: skip
    for name, (kind, ids) in prompts.items():  # prompt lookup on the same target and kernels
        for gamma in [int(g) for g in args.ngram.split(",") if g]:
            comps = [compare_with_plain(target, NGramDraft(max_n=3), ids, max_new_tokens=args.new,
                                        config=SpeculativeConfig(gamma=gamma))[1]
                     for _ in range(args.repeats)]  # fmt: skip
            st = comps[0].stats
            rows.append({
                "prompt": name, "kind": kind, "tree": f"ngram:3@{gamma}",
                "same": all(c.identical for c in comps), "tokens_per_pass": st.tokens_per_pass,
                "first_accept": st.alpha, "speedup": statistics.median(c.speedup("wall") for c in comps),
            })  # fmt: skip
            r = rows[-1]
            print(f"{name:12s} {r['tree']:8s} same={r['same']} tau={r['tokens_per_pass']:.2f} "
                  f"alpha={r['first_accept']:.2f} x{r['speedup']:.2f}", flush=True)  # fmt: skip
    calib = {}
    for t in trees:  # pass costs timed apart from the runs (the predictor's inputs)
        ids = next(iter(prompts.values()))[1]
        dec = FeatureTreeDecoder(target, head, len(ids) + args.new + 32, t, threads=1)
        calib[f"{t.depth}x{t.top_k}x{t.budget}"] = (t, calibrate_tree(dec, ids))
    for r in rows:
        if r["tree"] in calib:
            t, costs = calib[r["tree"]]
            r["predicted"] = costs.predict(r["tokens_per_pass"], t.depth, t.budget)
    calib = {name: costs.to_dict() for name, (_, costs) in calib.items()}
    print(json.dumps(calib, indent=1))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "costs": calib, "load": os.getloadavg()}, indent=1)
        )
    return 0


def cmd_sample(args) -> int:
    """Sampling at a temperature: the first `--tokens` tokens of `--draws` speculative and
    `--draws` plain generations from fixed prompts; two-sample chi-square on the first token
    and on the (first, second) pair (categories with fewer than 5 expected draws pooled)."""
    from scipy.stats import chi2_contingency

    from llmopt.infer.fast import FastDecoder
    from llmopt.infer.sampling import SamplingParams, logits_to_probs
    from llmopt.infer.speculative.tree_decode import FeatureTreeDecoder, TreeConfig
    from llmopt.models.feature_head import load_feature_head

    torch.set_num_threads(1)
    target, tok = load_target()
    head = load_feature_head(Path(args.out) / "run" / "head", target)
    sampling = SamplingParams(temperature=args.temperature)
    tree = TreeConfig(*map(int, args.tree.split("x")))
    results = {}
    for text in args.prompts.split("|"):
        ids = tok.encode(text, add_bos=False)
        max_len = len(ids) + args.tokens + tree.depth + 4
        gen = torch.Generator().manual_seed(1)
        spec, plain = [], []
        spec_s = plain_s = 0.0
        dec = FeatureTreeDecoder(target, head, max_len, tree, threads=1)
        for _ in range(args.draws):
            out = dec.generate(ids, args.tokens, sampling, gen)
            spec.append(tuple(out[: args.tokens]))
            spec_s += dec.stats.decode_s
        pdec = FastDecoder(target, max_len, threads=1)
        for _ in range(args.draws):
            logits = pdec.prefill(ids)
            t0 = time.perf_counter()
            out = []
            for i in range(args.tokens):
                out.append(
                    int(
                        torch.multinomial(
                            logits_to_probs(logits[None], sampling)[0], 1, generator=gen
                        )
                    )
                )
                if i + 1 < args.tokens:
                    logits = pdec.step(out[-1])
            plain_s += time.perf_counter() - t0
            plain.append(tuple(out))
        row = {"draws": args.draws, "speedup_first_tokens": plain_s / spec_s if spec_s else None}
        for name, key in (("first", lambda t: t[:1]), ("pair", lambda t: t[:2])):
            cats = sorted(set(map(key, spec)) | set(map(key, plain)))
            table = [
                [sum(key(t) == c for t in spec) for c in cats],
                [sum(key(t) == c for t in plain) for c in cats],
            ]
            keep = [i for i in range(len(cats)) if table[0][i] + table[1][i] >= 10]
            rest = [i for i in range(len(cats)) if i not in keep]
            cols = [[table[0][i], table[1][i]] for i in keep]
            if rest:
                cols.append([sum(table[0][i] for i in rest), sum(table[1][i] for i in rest)])
            chi = chi2_contingency(list(map(list, zip(*cols, strict=True))))
            row[f"{name}_pvalue"] = float(chi.pvalue)
            row[f"{name}_categories"] = len(cols)
        results[text] = row
        print(text[:40], json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"temperature": args.temperature, "tree": args.tree,
                                               "results": results, "load": os.getloadavg()}, indent=1))  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--out", required=True)
    d.add_argument("--seq-len", type=int, default=256)
    d.add_argument("--scale", type=float, default=1.0, help="multiplies the window counts")
    d.add_argument("--max-chars", type=int, default=4_000_000)
    d.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=600)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--draft-vocab", type=int, default=8192)
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--resume", action="store_true")
    t.add_argument("--threads", type=int, default=2)
    b = sub.add_parser("bench")
    b.add_argument("--out", required=True)
    b.add_argument("--trees", default="3x1x3,4x4x8", help="DEPTHxTOPKxBUDGET,...")
    b.add_argument("--new", type=int, default=64)
    b.add_argument("--chars", type=int, default=1000)
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument(
        "--ngram", default="4,8", help="prompt-lookup gammas to run beside (empty: none)"
    )
    b.add_argument("--json", default=None)
    sp = sub.add_parser("sample")
    sp.add_argument("--out", required=True)
    sp.add_argument("--prompts", default="The capital of France is|def fibonacci(n):")
    sp.add_argument("--draws", type=int, default=2000)
    sp.add_argument("--tokens", type=int, default=3)
    sp.add_argument("--temperature", type=float, default=0.7)
    sp.add_argument("--tree", default="3x2x4")
    sp.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cmds = {"data": cmd_data, "train": cmd_train, "bench": cmd_bench, "sample": cmd_sample}
    return cmds[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
