"""A distilled draft for speculative decoding of SmolLM2-135M: distilled vs undistilled drafts
of the same size and cost, α and decode speedup on held-out narrative text.

The drafts are students cut from the target (`llmopt distill --student init:teacher-layers=
0,1,29`), all given the same reduced-vocabulary head (`--draft-vocab K`: the K most frequent
tokens of the training text, `llmopt.compress.distill.draft`), so they cost the same per
token and differ only in training:
- `init`: the layer-dropped student, untrained;
- `ce`: trained on next-token CE only (alpha=0) for the same steps and text;
- `kd`: distilled (alpha·T²·KL + (1-alpha)·CE).
Prompts are narrative passages from the part of the WEB Bible after the training text.
Greedy outputs must equal plain decoding; speedups are decode phase, plain `generate` (fused
C++ decode when it builds) vs speculative (eager target verify passes), side by side, CPU time
and wall. c (draft 1-token pass / target 1-token eager pass) is timed apart from the runs,
and Leviathan's (1-α^(γ+1))/((1-α)(γc+1)) says what the measured α and c allow.

    python benchmarks/distill_draft.py --init runs/draft-kd/student_init \\
        --ce runs/draft-ce/checkpoints/step_000080/hf \\
        --kd runs/draft-kd/checkpoints/step_000080/hf --out runs/distill_draft.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _report import run_info, table, write_report
from rich.console import Console

from llmopt.compress.distill.draft import frequent_tokens, with_reduced_head
from llmopt.data.corpus import load_text
from llmopt.infer.drafts import ModelDraft
from llmopt.infer.speculative import (
    Comparison,
    SpeculativeConfig,
    compare_with_plain,
    costs_from_times,
    measure_plain,
    time_passes,
)
from llmopt.models.loading import load_model, load_tokenizer

# narrative passages of the New Testament (after the first 2,000,000 characters)
PASSAGES = {
    "luke-15": "Now all the tax collectors and sinners were coming close to him",
    "acts-27": "When it was determined that we should sail for Italy",
    "john-11": "Now a certain man was sick, Lazarus of Bethany",
    "mark-5": "They came to the other side of the sea, into the country of the Gadarenes",
}


def leviathan(alpha: float, gamma: int, c: float) -> float:
    """Expected speedup for per-guess acceptance α, γ guesses, draft cost c (verify = 1)."""
    if alpha >= 1:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--init", required=True, help="the undistilled (layer-dropped) student")
    p.add_argument("--ce", default=None, help="the same student trained on CE only")
    p.add_argument("--kd", required=True, help="the distilled student")
    p.add_argument("--extra", action="append", default=[], help="NAME=DIR: another draft")
    p.add_argument("--passages", default=",".join(PASSAGES), help="comma-separated names")
    p.add_argument("--vocab", type=int, default=8192, help="draft head size K")
    p.add_argument("--train-chars", type=int, default=2_000_000, help="the drafts' text prefix")
    p.add_argument("--gammas", default="2,4")
    p.add_argument("--chars", type=int, default=600, help="prompt length in characters")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/distill_draft.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 150))
    target = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    text = load_text("corpus:web-bible")
    train_ids = torch.tensor(tokenizer.encode(text[: args.train_chars]))
    cfg = target.config
    always = [t for t in (*cfg.stop_token_ids, cfg.bos_token_id) if t is not None]
    ids = frequent_tokens(train_ids, args.vocab, cfg.vocab_size, always)
    counts = torch.bincount(train_ids, minlength=cfg.vocab_size)
    coverage = float(counts[ids].sum() / counts.sum())
    prompts = {}
    for name in args.passages.split(","):
        opening = PASSAGES[name]
        start = text.find(opening)
        if start < args.train_chars:
            raise ValueError(f"passage {name} starts at {start}, inside the training text")
        end = text.rfind(" ", start, start + args.chars)
        prompts[name] = tokenizer.encode(text[start:end], add_bos=False)
    sources = {"init": args.init, "ce": args.ce, "kd": args.kd}
    sources.update(dict(item.split("=", 1) for item in args.extra))
    drafts = {
        name: ModelDraft(with_reduced_head(load_model(path), ids), name=name)
        for name, path in sources.items()
        if path
    }
    full_head = ModelDraft(load_model(args.kd), name="kd (full head)")
    drafts["kd-fullhead"] = full_head
    gammas = [int(g) for g in args.gammas.split(",")]

    context = len(next(iter(prompts.values())))
    target_times = time_passes(target, context, range(1, max(gammas) + 2), 7)
    costs = {
        n: costs_from_times(target_times, time_passes(d.model, context, (1, 2), 7))
        for n, d in drafts.items()
    }
    runs: dict[tuple[str, int], list[Comparison]] = {}
    for prompt in prompts.values():
        plain = measure_plain(target, prompt, max_new_tokens=args.max_new_tokens)
        for name, draft in drafts.items():
            for gamma in gammas:
                _, comp = compare_with_plain(
                    target,
                    draft,
                    prompt,
                    max_new_tokens=args.max_new_tokens,
                    config=SpeculativeConfig(gamma=gamma),
                    plain=plain,
                )
                runs.setdefault((name, gamma), []).append(comp)
    rows = []
    for (name, gamma), comps in runs.items():
        comp = Comparison.pooled(comps)
        st = comp.stats
        c_cpu = costs[name]["cpu"].draft
        rows.append(
            {
                "draft": name,
                "gamma": gamma,
                "identical_output": comp.identical,
                "alpha": st.alpha,
                "tokens_per_target_pass": st.tokens_per_pass,
                "c_cpu": c_cpu,
                "c_wall": costs[name]["wall"].draft,
                "measured_speedup_cpu": comp.speedup("cpu"),
                "measured_speedup": comp.speedup("wall"),
                "predicted_speedup_cpu": st.predict(costs[name]["cpu"])["predicted_speedup"],
                "leviathan": leviathan(st.alpha, gamma, c_cpu),
                "plain_decode_tokens_per_s": comp.plain_decode.rate("wall"),
                "speculative_decode_tokens_per_s": comp.speculative_decode.rate("wall"),
            }
        )
    cols = ("draft", "γ", "same", "α", "tok/pass", "c cpu", "speedup cpu", "wall", "pred", "Lev.")
    cells = [
        (
            r["draft"],
            str(r["gamma"]),
            "yes" if r["identical_output"] else "NO",
            f"{r['alpha']:.3f}",
            f"{r['tokens_per_target_pass']:.2f}",
            f"{r['c_cpu']:.3f}",
            f"{r['measured_speedup_cpu']:.2f}x",
            f"{r['measured_speedup']:.2f}x",
            f"{r['predicted_speedup_cpu']:.2f}x",
            f"{r['leviathan']:.2f}x",
        )
        for r in rows
    ]
    console.print(table(f"distilled drafts for {args.model}, held-out narrative", cols, cells))
    console.print(f"draft vocabulary: {len(ids)} tokens cover {coverage:.2%} of the training text")
    eager_step = target_times["cpu"][1]
    payload = {
        "model": args.model,
        **run_info(),
        "drafts": {k: str(v) for k, v in sources.items() if v},
        "draft_vocab": len(ids),
        "draft_vocab_coverage": coverage,
        "passages": {n: len(t) for n, t in prompts.items()},
        "max_new_tokens": args.max_new_tokens,
        "target_eager_step_cpu_s": eager_step,
        "rows": rows,
    }
    write_report(console, Path(args.out), payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
