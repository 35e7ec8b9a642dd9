"""Speculative decoding on SmolLM2-135M: drafts x gamma, measured vs predicted speedup.

For each real-text prompt (World English Bible passages: some with the repetitive structure
that prompt lookup exploits, some plain narrative) the target decodes greedily with our own
plain `generate` and speculatively with every (draft, gamma) through
`llmopt.infer.speculative.compare_with_plain`; outputs must be identical.

Predictions come from the library's one predictor (`llmopt.infer.speculative.predict`), fed
with costs calibrated apart from the timed runs (`time_passes`: v(t) of a t-token target pass
and a model draft's 1- and 2-token passes, on a cache of the prompt's length) and with the
runs' acceptance counters. The PNG plots measured speedup against alpha, with the predicted
curves and the break-even line.

    python benchmarks/speculative.py --out runs/speculative.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _report import run_info, save_figure, table, write_report
from rich.console import Console
from rich.progress import Progress

from llmopt.data.corpus import load_text
from llmopt.infer.drafts import ModelDraft, make_draft
from llmopt.infer.speculative import (
    Comparison,
    SpeculativeConfig,
    compare_with_plain,
    costs_from_times,
    measure_plain,
    predicted_speedup,
    time_passes,
)
from llmopt.models.loading import load_model, load_tokenizer

# name -> (opening words in the WEB text, repetitive structure?)
PASSAGES = {
    "numbers-7": ("He who offered his offering the first day", True),
    "psalm-136": ("Give thanks to Yahweh, for he is good; For his lovingkindness", True),
    "genesis-5": ("This is the book of the generations of Adam", True),
    "genesis-1": ("In the beginning God created the heavens", False),
    "john-1": ("In the beginning was the Word", False),
    "psalm-1": ("Blessed is the man who doesn`t walk", False),
}


def passage_prompt(text: str, opening: str, chars: int) -> str:
    start = text.find(opening)
    if start < 0:
        raise ValueError(f"passage opening {opening!r} not found in the corpus")
    end = text.rfind(" ", start, start + chars)
    return text[start:end]


def plot(rows: list[dict], v: dict[int, float], costs: dict[str, float], path: Path) -> None:
    """Measured decode speedup (CPU time) vs alpha, predicted curves and the break-even line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    alphas = [a / 100 for a in range(0, 101)]
    for gamma, style in ((2, ":"), (4, "--"), (8, "-")):
        if gamma + 1 not in v:
            continue
        for c, color in ((0.0, "tab:green"), (0.5, "tab:red")):
            ys = [predicted_speedup(a, gamma, c, v[gamma + 1]) for a in alphas]
            ax.plot(alphas, ys, style, color=color, lw=1, label=f"predicted, γ={gamma}, c={c}")
    ax.axhline(1.0, color="black", lw=1.5, label="break-even: plain decoding")
    palette = plt.get_cmap("tab10")
    drafts = sorted({r["draft"] for r in rows})
    for i, draft in enumerate(drafts):
        mine = [r for r in rows if r["draft"] == draft]
        for r in mine:
            marker = "o" if r["prompts"] == "repetitive" else "s"
            ax.scatter(
                r["alpha"],
                r["measured_speedup_cpu"],
                color=palette(i),
                marker=marker,
                s=50,
                edgecolor="black",
                linewidth=0.5,
                label=f"{draft} (c={costs[draft]:.2f})" if r is mine[0] else None,
            )
            ax.annotate(
                f"γ={r['gamma']}{'a' if r['adaptive'] else ''}",
                (r["alpha"], r["measured_speedup_cpu"]),
                fontsize=6,
                xytext=(4, -3),
                textcoords="offset points",
            )
    ax.set_xlabel("acceptance rate α (measured)")
    ax.set_ylabel("decode speedup over plain decoding (measured, CPU time)")
    ax.set_title(
        "SmolLM2-135M greedy speculative decoding, 2-core CPU\n"
        "circles: repetitive passages, squares: narrative; curves: prediction with measured v(γ)",
        fontsize=9,
    )
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save_figure(fig, path, dpi=130)


def parse_configs(text: str) -> list[tuple[str, int, bool]]:
    """'ngram:3@4,early-exit:20@2,ngram:3@4a' -> [(draft, gamma, adaptive)]."""
    out = []
    for item in text.split(","):
        draft, _, gamma = item.strip().rpartition("@")
        if not draft or not gamma.rstrip("a").isdigit():
            raise ValueError(f"config {item!r} must be DRAFT@GAMMA[a], e.g. ngram:3@4")
        out.append((draft, int(gamma.rstrip("a")), gamma.endswith("a")))
    return out


def row(config: tuple[str, int, bool], group: str, comp: Comparison, costs: dict) -> dict:
    """One table/JSON row: a configuration pooled over the prompts of one group."""
    draft, gamma, adaptive = config
    st = comp.stats
    wall, cpu = st.predict(costs["wall"]), st.predict(costs["cpu"])
    out = {
        "draft": draft,
        "gamma": gamma,
        "adaptive": adaptive,
        "prompts": group,
        "identical_output": comp.identical,
        "tokens": st.generated,
        "alpha": st.alpha,
        "tokens_per_target_pass": st.tokens_per_pass,
        "proposal_rate": st.proposal_rate,
        "c_wall": costs["wall"].draft,
        "c_cpu": costs["cpu"].draft,
        "plain_s": comp.plain_total.wall_s,
        "speculative_s": comp.speculative_total.wall_s,
        "plain_decode_tokens_per_s": comp.plain_decode.rate("wall"),
        "speculative_decode_tokens_per_s": comp.speculative_decode.rate("wall"),
        "measured_speedup": comp.speedup("wall"),
        "measured_speedup_end_to_end": comp.speedup("wall", end_to_end=True),
        "predicted_speedup": wall["predicted_speedup"],
        "measured_speedup_cpu": comp.speedup("cpu"),
        "predicted_speedup_cpu": cpu["predicted_speedup"],
        "predicted_speedup_leviathan_v1": cpu["predicted_speedup_leviathan"],
        "optimal_gamma_cpu": cpu["optimal_gamma"],
    }
    out["prediction_error"] = out["predicted_speedup"] / out["measured_speedup"] - 1
    out["prediction_error_cpu"] = out["predicted_speedup_cpu"] / out["measured_speedup_cpu"] - 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--passages", default=",".join(PASSAGES), help="comma-separated names")
    parser.add_argument("--chars", type=int, default=1000, help="prompt length in characters")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--configs",
        default="ngram:3@2,ngram:3@4,ngram:3@8,ngram:3@4a,early-exit:20@2,"
        "early-exit:10@2,int8@3,int4@3",
        help="DRAFT@GAMMA (suffix a: adaptive gamma), comma-separated",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calib-repeats", type=int, default=7)
    parser.add_argument("--out", default="runs/speculative.json")
    parser.add_argument("--plot", default="docs/speculative_speedup.png")
    parser.add_argument(
        "--replot", metavar="JSON", default=None, help="only redraw --plot from a saved --out"
    )
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        v_cpu = {int(t): x for t, x in saved["verify_cost"]["cpu"].items()}
        plot(saved["rows"], v_cpu, saved["draft_cost"]["cpu"], Path(args.plot))
        return 0
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 170))
    configs = parse_configs(args.configs)
    names = [n.strip() for n in args.passages.split(",") if n.strip()]
    unknown = [n for n in names if n not in PASSAGES]
    if unknown:
        raise ValueError(f"unknown passages {unknown}; known: {', '.join(PASSAGES)}")

    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    text = load_text("corpus:web-bible")
    prompts = {
        n: tokenizer.encode(passage_prompt(text, PASSAGES[n][0], args.chars), add_bos=False)
        for n in names
    }
    drafts = {spec: make_draft(spec, model, tokenizer) for spec in {c[0] for c in configs}}

    # ---- calibration, apart from the timed runs: v(t) and the draft passes, at a prompt's length
    context_len = len(prompts[names[0]])
    # adaptive γ may reach gamma_max = max(γ, 12): its verify passes must be calibrated too
    top = {max(g, 12) if a else g for _, g, a in configs}
    sizes = sorted({*range(1, 10), *range(2, max(top) + 2)})
    console.print(f"calibrating pass costs for {sizes} tokens at context {context_len}")
    target_times = time_passes(model, context_len, sizes, args.calib_repeats)
    costs = {}
    for spec, draft in drafts.items():
        draft_times = None
        if isinstance(draft, ModelDraft):
            draft_times = time_passes(draft.model, context_len, (1, 2), args.calib_repeats)
        costs[spec] = costs_from_times(target_times, draft_times)
    verify = {clock: dict(costs[configs[0][0]][clock].target) for clock in ("wall", "cpu")}

    # ---- timed runs, interleaved per prompt so load changes hit all configs alike
    groups = {n: "repetitive" if PASSAGES[n][1] else "narrative" for n in names}
    runs: dict[tuple, list[Comparison]] = {}
    plain_total = 0.0
    with Progress(console=console) as progress:
        task = progress.add_task("prompts x configs", total=len(names) * (len(configs) + 1))
        for name in names:
            prompt = prompts[name]
            plain = measure_plain(model, prompt, max_new_tokens=args.max_new_tokens)
            plain_total += plain.total.wall_s
            progress.advance(task)
            for d, g, a in configs:
                _, comp = compare_with_plain(
                    model,
                    drafts[d],
                    prompt,
                    max_new_tokens=args.max_new_tokens,
                    config=SpeculativeConfig(gamma=g, adaptive=a, gamma_max=max(g, 12)),
                    plain=plain,
                )
                runs.setdefault((d, g, a, groups[name]), []).append(comp)
                progress.advance(task)

    rows = [
        row(key[:3], key[3], Comparison.pooled(comps), costs[key[0]]) for key, comps in runs.items()
    ]
    rows.sort(key=lambda r: (r["prompts"], r["draft"], r["gamma"], r["adaptive"]))
    columns = (
        "prompts",
        "draft",
        "γ",
        "same",
        "α",
        "tok/pass",
        "c cpu",
        "wall: meas.",
        "pred.",
        "err",
        "cpu: meas.",
        "pred.",
        "err",
        "Leviathan v=1",
    )
    cells = [
        (
            r["prompts"],
            r["draft"],
            f"{r['gamma']}{' adapt' if r['adaptive'] else ''}",
            "yes" if r["identical_output"] else "NO",
            f"{r['alpha']:.2f}",
            f"{r['tokens_per_target_pass']:.2f}",
            f"{r['c_cpu']:.2f}",
            f"{r['measured_speedup']:.2f}x",
            f"{r['predicted_speedup']:.2f}x",
            f"{100 * r['prediction_error']:+.0f}%",
            f"{r['measured_speedup_cpu']:.2f}x",
            f"{r['predicted_speedup_cpu']:.2f}x",
            f"{100 * r['prediction_error_cpu']:+.0f}%",
            f"{r['predicted_speedup_leviathan_v1']:.2f}x",
        )
        for r in rows
    ]
    title = f"speculative decoding, {args.model}, greedy, decode-phase speedup over plain"
    console.print(table(title, columns, cells))
    vt = [(clock, *[f"{verify[clock][t]:.2f}" for t in sizes]) for clock in verify]
    console.print(
        table("verify cost v(t) = t-token pass / 1-token step", ["clock", *map(str, sizes)], vt)
    )
    step = {clock: costs[configs[0][0]][clock].step_s for clock in verify}
    console.print(
        f"1-token step at context {context_len}: {1000 * step['wall']:.1f} ms wall, "
        f"{1000 * step['cpu']:.1f} ms CPU"
    )
    result = {
        "model": args.model,
        **run_info(),
        "passages": {n: {"tokens": len(prompts[n]), "repetitive": PASSAGES[n][1]} for n in names},
        "max_new_tokens": args.max_new_tokens,
        "step_time_s": step,
        "verify_cost": {k: {str(t): v for t, v in by_t.items()} for k, by_t in verify.items()},
        "draft_cost": {k: {d: c[k].draft for d, c in costs.items()} for k in verify},
        "draft_cost_2_tokens": {k: {d: c[k].draft_2 for d, c in costs.items()} for k in verify},
        "plain_total_s": plain_total,
        "rows": rows,
    }
    write_report(console, args.out, result)
    if args.plot:
        plot(rows, verify["cpu"], result["draft_cost"]["cpu"], Path(args.plot))
        console.print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
