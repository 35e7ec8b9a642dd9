"""Speculative decoding on SmolLM2-135M: drafts x gamma, measured vs predicted speedup.

For each real-text prompt (World English Bible passages: some with the repetitive structure
that prompt lookup exploits, some plain narrative) the target decodes greedily with our own
plain `generate` and speculatively with every (draft, gamma); outputs must be identical.

Predictions are made from quantities measured separately from the timed runs:
- v(gamma): cost of a (gamma+1)-token target pass relative to a 1-token step (calibrated on a
  cached prefix of the prompt's length),
- c: cost of one draft step relative to one target step (calibrated the same way; also the
  2-token pass a model draft makes to catch up after a fully accepted round),
- alpha and the fraction of rounds with a proposal: from the runs' acceptance counters,
and then speedup = E[tokens per round] / E[cost per round] (Leviathan et al. 2023 with the
verify cost v(gamma) in place of 1). The PNG plots measured speedup against alpha, with the
predicted curves and the break-even line.

    python benchmarks/speculative.py --out runs/speculative.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from llmopt.artifacts import atomic_write_json
from llmopt.data.corpus import load_text
from llmopt.infer.drafts import ModelDraft, make_draft
from llmopt.infer.generate import generate
from llmopt.infer.speculative import (
    SpeculativeConfig,
    expected_tokens_per_round,
    speculative_generate,
)
from llmopt.models.llama import KVCache
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


@dataclass
class Run:
    draft: str
    gamma: int
    adaptive: bool
    group: str  # "repetitive" or "narrative" passages
    prompts: list[str] = field(default_factory=list)
    plain_s: float = 0.0  # end to end (prefill + decode)
    spec_s: float = 0.0
    plain_decode_s: float = 0.0  # from the first new token on: tokens - 1 per prompt
    spec_decode_s: float = 0.0  # after the prefill: tokens per prompt
    plain_decode_cpu: float = 0.0  # the same in process CPU seconds
    spec_decode_cpu: float = 0.0
    plain_decode_tokens: int = 0
    tokens: int = 0
    rounds: int = 0
    proposing_rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0
    draft_forwards: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    identical: bool = True

    @property
    def alpha(self) -> float:
        trials = self.accepted + self.rejections
        return self.accepted / trials if trials else 0.0


def passage_prompt(text: str, opening: str, chars: int) -> str:
    start = text.find(opening)
    if start < 0:
        raise ValueError(f"passage opening {opening!r} not found in the corpus")
    end = text.rfind(" ", start, start + chars)
    return text[start:end]


@torch.inference_mode()
def pass_times(
    model, context: list[int], sizes: list[int], repeats: int
) -> dict[str, dict[int, float]]:
    """Median wall and CPU seconds of a t-token pass on a cached prefix, for each t
    (interleaved, so a change in machine load hits every size alike)."""
    cache = KVCache.for_model(model, 1, len(context) + max(sizes))
    model(torch.tensor([context]), cache)
    samples: dict[str, dict[int, list[float]]] = {"wall": {}, "cpu": {}}
    for _ in range(repeats + 1):
        for t in sizes:
            x = torch.tensor([context[-t:]])
            t0, c0 = time.perf_counter(), time.process_time()
            model(x, cache, last_only=t == 1)
            samples["wall"].setdefault(t, []).append(time.perf_counter() - t0)
            samples["cpu"].setdefault(t, []).append(time.process_time() - c0)
            cache.rollback(len(context))
    return {
        clock: {t: statistics.median(v[1:]) for t, v in by_size.items()}
        for clock, by_size in samples.items()
    }


def predict(run: Run, c: tuple[float, float], v: dict[int, float]) -> float:
    """Speedup predicted from alpha, the draft costs c = (1-token, 2-token pass) and v(gamma).

    Rounds without a proposal are plain steps. After a fully accepted round (probability
    alpha^gamma) a model draft's first pass catches up on two tokens (its last guess and the
    bonus token), so that pass costs c2 instead of c1.
    """
    if run.proposing_rounds == 0:
        return 1.0
    c1, c2 = c
    gamma = max(1, round(run.proposed / run.proposing_rounds))
    f = run.proposing_rounds / run.rounds
    alpha = run.alpha
    tokens = f * expected_tokens_per_round(alpha, gamma) + (1 - f)
    draft = gamma * c1 + alpha**gamma * (c2 - c1)
    cost = f * (draft + v[gamma + 1]) + (1 - f) * v[1]
    return tokens / cost


def leviathan(run: Run, c: float) -> float:
    gamma = max(1, round(run.proposed / max(run.proposing_rounds, 1)))
    return expected_tokens_per_round(run.alpha, gamma) / (gamma * c + 1)


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
            ys = [expected_tokens_per_round(a, gamma) / (gamma * c + v[gamma + 1]) for a in alphas]
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=130, bbox_inches="tight")
    os.replace(tmp, path)
    plt.close(fig)


def parse_configs(text: str) -> list[tuple[str, int, bool]]:
    """'ngram:3@4,early-exit:20@2,ngram:3@4a' -> [(draft, gamma, adaptive)]."""
    out = []
    for item in text.split(","):
        draft, _, gamma = item.strip().rpartition("@")
        if not draft:
            raise ValueError(f"config {item!r} must be DRAFT@GAMMA[a], e.g. ngram:3@4")
        adaptive = gamma.endswith("a")
        out.append((draft, int(gamma.rstrip("a")), adaptive))
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

    # ---- calibration: v(t) and the draft step costs, at the mean prompt length
    context = prompts[names[0]]
    gammas = sorted({g for _, g, _ in configs} | {2, 4, 8})
    sizes = sorted({1, *[g + 1 for g in gammas], *range(1, 10)})
    console.print(f"calibrating pass costs for {sizes} tokens at context {len(context)}")
    times = pass_times(model, context, sizes, args.calib_repeats)
    clocks = ("wall", "cpu")
    v = {k: {t: times[k][t] / times[k][1] for t in sizes} for k in clocks}
    costs: dict[str, dict[str, float]] = {k: {} for k in clocks}
    costs2: dict[str, dict[str, float]] = {k: {} for k in clocks}  # 2-token draft pass
    for spec, draft in drafts.items():
        if isinstance(draft, ModelDraft):
            dt = pass_times(draft.model, context, [1, 2], args.calib_repeats)
            for k in clocks:
                costs[k][spec] = dt[k][1] / times[k][1]
                costs2[k][spec] = dt[k][2] / times[k][1]
        else:  # prompt lookup: a dictionary probe, no model (its time is in the measurement)
            for k in clocks:
                costs[k][spec] = costs2[k][spec] = 0.0

    # ---- timed runs, interleaved per prompt so load changes hit all configs alike
    groups = {n: "repetitive" if PASSAGES[n][1] else "narrative" for n in names}
    runs = {
        (d, g, a, grp): Run(d, g, a, grp) for d, g, a in configs for grp in set(groups.values())
    }
    plain_total = 0.0
    with Progress(console=console) as progress:
        task = progress.add_task("prompts x configs", total=len(names) * (len(configs) + 1))
        for name in names:
            prompt = prompts[name]
            stamps: list[tuple[float, float]] = []
            t0 = time.perf_counter()
            ref = generate(
                model,
                prompt,
                max_new_tokens=args.max_new_tokens,
                on_token=lambda _, s=stamps: s.append((time.perf_counter(), time.process_time())),
            )
            plain_s = time.perf_counter() - t0
            # the first token came from the prefill: decoding is what follows it
            plain_decode_s = stamps[-1][0] - stamps[0][0]
            plain_decode_cpu = stamps[-1][1] - stamps[0][1]
            plain_total += plain_s
            progress.advance(task)
            for d, g, a in configs:
                cfg = SpeculativeConfig(gamma=g, adaptive=a, gamma_max=max(g, 12))
                t0 = time.perf_counter()
                res = speculative_generate(
                    model, drafts[d], prompt, max_new_tokens=args.max_new_tokens, config=cfg
                )
                spec_s = time.perf_counter() - t0
                st, run = res.stats, runs[(d, g, a, groups[name])]
                run.prompts.append(name)
                run.plain_s += plain_s
                run.spec_s += spec_s
                run.plain_decode_s += plain_decode_s
                run.plain_decode_tokens += len(ref) - 1
                run.spec_decode_s += st.total_time_s - st.prefill_time_s
                run.plain_decode_cpu += plain_decode_cpu
                run.spec_decode_cpu += st.total_cpu_s - st.prefill_cpu_s
                run.tokens += st.generated
                run.rounds += st.rounds
                run.proposing_rounds += st.proposing_rounds
                run.proposed += st.proposed
                run.accepted += st.accepted
                run.rejections += st.rejections
                run.draft_forwards += st.draft_forwards
                run.draft_s += st.draft_time_s
                run.verify_s += st.verify_time_s
                run.identical &= res.tokens == ref
                progress.advance(task)

    rows = []
    for run in runs.values():
        if not run.prompts:
            continue
        plain_rate = run.plain_decode_tokens / run.plain_decode_s
        spec_rate = run.tokens / run.spec_decode_s
        plain_cpu_rate = run.plain_decode_tokens / run.plain_decode_cpu
        spec_cpu_rate = run.tokens / run.spec_decode_cpu
        row = {
            "draft": run.draft,
            "gamma": run.gamma,
            "adaptive": run.adaptive,
            "prompts": run.group,
            "prompt_names": run.prompts,
            "identical_output": run.identical,
            "tokens": run.tokens,
            "alpha": run.alpha,
            "tokens_per_target_pass": run.tokens / run.rounds,
            "proposal_rate": run.proposing_rounds / run.rounds,
            "c_wall": costs["wall"][run.draft],
            "c_cpu": costs["cpu"][run.draft],
            "plain_s": run.plain_s,
            "speculative_s": run.spec_s,
            "plain_decode_tokens_per_s": plain_rate,
            "speculative_decode_tokens_per_s": spec_rate,
            "measured_speedup": spec_rate / plain_rate,
            "measured_speedup_end_to_end": run.plain_s / run.spec_s,
            "predicted_speedup": predict(
                run, (costs["wall"][run.draft], costs2["wall"][run.draft]), v["wall"]
            ),
            "measured_speedup_cpu": spec_cpu_rate / plain_cpu_rate,
            "predicted_speedup_cpu": predict(
                run, (costs["cpu"][run.draft], costs2["cpu"][run.draft]), v["cpu"]
            ),
            "predicted_speedup_leviathan_v1": leviathan(run, costs["cpu"][run.draft]),
        }
        row["prediction_error"] = row["predicted_speedup"] / row["measured_speedup"] - 1
        row["prediction_error_cpu"] = row["predicted_speedup_cpu"] / row["measured_speedup_cpu"] - 1
        rows.append(row)

    rows.sort(key=lambda r: (r["prompts"], r["draft"], r["gamma"], r["adaptive"]))
    table = Table(
        title=f"speculative decoding, {args.model}, greedy, decode-phase speedup over plain"
    )
    for col in (
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
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
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
    console.print(table)
    vt = Table(title="verify cost v(t) = t-token pass / 1-token step")
    vt.add_column("clock")
    for t in sizes:
        vt.add_column(str(t), justify="right")
    for k in clocks:
        vt.add_row(k, *[f"{v[k][t]:.2f}" for t in sizes])
    console.print(vt)
    console.print(
        f"1-token step at context {len(context)}: {1000 * times['wall'][1]:.1f} ms wall, "
        f"{1000 * times['cpu'][1]:.1f} ms CPU"
    )

    result = {
        "model": args.model,
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "passages": {n: {"tokens": len(prompts[n]), "repetitive": PASSAGES[n][1]} for n in names},
        "max_new_tokens": args.max_new_tokens,
        "step_time_s": {k: times[k][1] for k in clocks},
        "verify_cost": {k: {str(t): v[k][t] for t in sizes} for k in clocks},
        "draft_cost": costs,
        "draft_cost_2_tokens": costs2,
        "plain_total_s": plain_total,
        "rows": rows,
    }
    atomic_write_json(Path(args.out), result)
    if args.plot:
        plot(rows, v["cpu"], costs["cpu"], Path(args.plot))
        console.print(f"plot: {args.plot}")
    console.print(f"json: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
