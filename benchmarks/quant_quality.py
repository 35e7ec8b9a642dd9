"""Accuracy and cost of RTN, AWQ and GPTQ on a real model (default SmolLM2-135M).

For each (method, bits, group size): quantization time (wall and CPU), and on every
evaluation corpus perplexity, KL(reference || quantized) statistics and top-1 agreement
against the unquantized model; quantized-linear bytes vs fp16 and the size on disk.
Evaluation reads each corpus from its beginning; calibration windows come from the second
half of its sources, and the out-of-domain corpora (`corpus.EVAL_ONLY`) are never in a
calibration mix, so they are disjoint from it by source.

    python benchmarks/quant_quality.py --out runs/quant_quality.json
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch
from _report import run_info, save_figure, table, write_report

from llmopt.models.packed.metadata import compression_metadata


def parse_schemes(text: str) -> list[tuple[int, int]]:
    """'4:128,3:128' -> [(4, 128), (3, 128)]."""
    schemes = []
    for part in text.split(","):
        bits, _, group = part.partition(":")
        schemes.append((int(bits), int(group or 128)))
    return schemes


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


DEFAULT_EVAL = "corpus:web-bible,corpus:torch-docs,corpus:pkg-readmes"


def eval_sets(tokenizer, corpora: str, n_tokens: int) -> dict[str, list[int]]:
    """The first n_tokens of each corpus (comma-separated specs), keyed by corpus name."""
    from llmopt.data.corpus import load_text

    sets = {}
    for spec in corpora.split(","):
        ids = tokenizer.encode(load_text(spec, max_chars=n_tokens * 8))[:n_tokens]
        if len(ids) < n_tokens:
            raise SystemExit(f"{spec}: only {len(ids)} evaluation tokens; lower --eval-tokens")
        sets[spec.removeprefix("corpus:")] = ids
    return sets


def reference_copy(model):
    """A copy of the reference whose hidden states are memoised per window.

    Every variant is scored on the same windows, so the reference's forward runs once per
    window. A copy, because `quantize_model` deep-copies its input (with the memo).
    """
    ref = copy.deepcopy(model)
    cache: dict[bytes, torch.Tensor] = {}
    compute = ref.hidden_states

    def hidden_states(ids, *args, **kwargs):
        if args or kwargs:
            return compute(ids, *args, **kwargs)
        key = ids.cpu().numpy().tobytes()
        if key not in cache:
            cache[key] = compute(ids)
        return cache[key]

    ref.hidden_states = hidden_states
    return ref


def score(q, ref, sets: dict[str, list[int]], ctx: int) -> dict[str, dict[str, float]]:
    """KL/ppl/top-1 of q against the reference on each evaluation set."""
    from llmopt.eval.kl import kl_divergence

    out = {}
    for name, ids in sets.items():
        kl = kl_divergence(q, ref, ids, ctx=ctx, stride=ctx)
        out[name] = {
            "ppl": kl.ppl,
            "ref_ppl": kl.ref_ppl,
            "kl_mean": kl.mean,
            "kl_median": kl.median,
            "kl_p99": kl.p99,
            "top1": kl.top1_agreement,
            "rms_delta_p": kl.rms_delta_p,
        }
    return out


def quality_cells(label: str, stats: dict[str, dict[str, float]]) -> tuple[str, ...]:
    """One table row: ppl / KL / top-1 per corpus."""
    cells = [label]
    for s in stats.values():
        cells += [f"{s['ppl']:.2f}", f"{s['kl_mean']:.4f}", f"{s['top1']:.3f}"]
    return tuple(cells)


def quality_columns(sets: dict[str, list[int]]) -> tuple[str, ...]:
    cols = ["variant"]
    for name in sets:
        cols += [f"{name} ppl", "KL", "top-1"]
    return tuple(cols)


def main(argv: list[str] | None = None) -> None:
    from llmopt.compress.quant.calibration import DEFAULT_MIX

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="rtn,awq,gptq")
    parser.add_argument("--schemes", default="4:128", help="bits:group,...")
    parser.add_argument("--calib", default=DEFAULT_MIX, help="calibration mix (llmopt.data.mix)")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument(
        "--eval", default=DEFAULT_EVAL, help="evaluation corpora, first = in-domain"
    )
    parser.add_argument("--eval-tokens", type=int, default=4096, help="per corpus")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument(
        "--act-order", action=argparse.BooleanOptionalAction, default=True, help="GPTQ act-order"
    )
    parser.add_argument("--out", default="runs/quant_quality.json")
    parser.add_argument("--png", default=None, help="bar chart (default: next to --out)")
    args = parser.parse_args(argv)

    from rich.console import Console

    from llmopt.compress.quant.apply import model_nbytes, quantize_model
    from llmopt.compress.quant.calibration import calibration_set
    from llmopt.compress.quant.io import save_quantized
    from llmopt.models.loading import load_model, load_tokenizer

    console = Console()
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    sets = eval_sets(tokenizer, args.eval, args.eval_tokens)
    calib = calibration_set(tokenizer, args.calib, args.calib_samples, args.calib_seq_len)
    ref = reference_copy(model)
    rows, cells = [], []
    for bits, group in parse_schemes(args.schemes):
        for method in args.methods.split(","):
            ao = args.act_order and method == "gptq"
            label = f"{method.upper()}{' + act-order' if ao else ''} W{bits} g{group}"
            console.print(f"[bold]{label}[/bold]")
            t0, c0 = time.perf_counter(), time.process_time()
            q = quantize_model(
                model,
                method,
                bits,
                group,
                calib_tokens=calib.tokens,
                progress=True,
                calib=args.calib,
                calib_samples=args.calib_samples,
                calib_seq_len=args.calib_seq_len,
                gptq_act_order=ao,
            )
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            stats = score(q, ref, sets, args.ctx)
            sizes = model_nbytes(q)
            with tempfile.TemporaryDirectory() as tmp:
                save_quantized(q, tmp, float_dtype=torch.float16)
                disk = dir_bytes(Path(tmp))
            row = {
                "method": method + ("+act-order" if ao else ""),
                "bits": bits,
                "group_size": group,
                "eval": stats,
                "quant_seconds": seconds,
                "quant_cpu_seconds": cpu,
                "quant_linear_bytes": sizes["quant_linear_bytes"],
                "quant_linear_fp16_bytes": sizes["quant_linear_fp16_bytes"],
                "disk_bytes_fp16_rest": disk,
            }
            if method == "awq":
                alphas = [
                    g["alpha"]
                    for layer in compression_metadata(q).quant_report["layers"]
                    for g in layer["groups"]
                ]
                row["awq_alpha_mean"] = sum(alphas) / len(alphas)
            console.print(
                "  "
                + "  ".join(
                    f"{k}: ppl {v['ppl']:.2f} KL {v['kl_mean']:.4f}" for k, v in stats.items()
                )
                + f"  ({seconds:.0f} s wall / {cpu:.0f} s CPU)"
            )
            rows.append(row)
            cells.append(quality_cells(label, stats))
            del q
    ref_cells = ["fp32 reference"]
    for name in sets:
        ref_cells += [f"{rows[0]['eval'][name]['ref_ppl']:.2f}", "0", "1.000"] if rows else []
    title = f"Weight quantization of {args.model}: {args.eval_tokens} tokens per corpus"
    console.print(table(title, quality_columns(sets), [tuple(ref_cells), *cells]))
    result = {
        "model": args.model,
        **run_info(),
        "eval_tokens": args.eval_tokens,
        "eval": list(sets),
        "ctx": args.ctx,
        "calibration": calib.coverage,
        "rows": rows,
    }
    out = Path(args.out)
    write_report(console, out, result)
    _plot(rows, list(sets), Path(args.png) if args.png else out.with_suffix(".png"))


def _plot(rows: list[dict], corpora: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['method'].upper()}\nW{r['bits']} g{r['group_size']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(corpora), 1)
    for k, name in enumerate(corpora):
        xs = [i + k * width for i in range(len(rows))]
        axes[0].bar(xs, [r["eval"][name]["kl_mean"] for r in rows], width, label=name)
        ratio = [r["eval"][name]["ppl"] / r["eval"][name]["ref_ppl"] for r in rows]
        axes[1].bar(xs, ratio, width, label=name)
    axes[0].set_ylabel("mean KL(ref || quantized), nats")
    axes[1].set_ylabel("perplexity / fp32 perplexity")
    axes[1].axhline(1.0, color="k", linestyle="--")
    for ax in axes:
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], labels, fontsize=7)
        ax.legend(fontsize=7)
    fig.suptitle("RTN vs AWQ vs GPTQ, in domain and out of domain")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
