"""Accuracy and cost of RTN, AWQ and GPTQ on a real model (default SmolLM2-135M).

For each (method, bits, group size): quantization time (wall and CPU), perplexity on a fixed
web-bible slice (the corpus's first tokens; calibration windows come from its second half),
KL(reference || quantized) statistics and top-1 agreement against the unquantized model,
quantized-linear bytes vs fp16, and the size on disk of the saved directory.

    python benchmarks/quant_quality.py --out runs/quant_quality.json
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
from _report import run_info, save_figure, table, write_report


def parse_schemes(text: str) -> list[tuple[int, int]]:
    """'4:128,3:128' -> [(4, 128), (3, 128)]."""
    schemes = []
    for part in text.split(","):
        bits, _, group = part.partition(":")
        schemes.append((int(bits), int(group or 128)))
    return schemes


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="rtn,awq,gptq")
    parser.add_argument("--schemes", default="4:128,3:128", help="bits:group,...")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--act-order", action="store_true", help="GPTQ with act-order")
    parser.add_argument("--out", default="runs/quant_quality.json")
    parser.add_argument("--png", default=None, help="bar chart (default: next to --out)")
    args = parser.parse_args(argv)

    from rich.console import Console

    from llmopt.compress.quant.apply import model_nbytes, quantize_model
    from llmopt.compress.quant.calibration import calibration_tokens
    from llmopt.compress.quant.io import save_quantized
    from llmopt.data.corpus import load_text
    from llmopt.eval.kl import kl_divergence
    from llmopt.eval.perplexity import perplexity
    from llmopt.models.loading import load_model, load_tokenizer

    console = Console()
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    text = load_text("corpus:web-bible", max_chars=args.eval_tokens * 8)
    eval_ids = tokenizer.encode(text)[: args.eval_tokens]
    if len(eval_ids) < args.eval_tokens:
        raise SystemExit(f"only {len(eval_ids)} evaluation tokens; lower --eval-tokens")
    calib = calibration_tokens(
        tokenizer, "corpus:web-bible", args.calib_samples, args.calib_seq_len
    )
    ctx = args.ctx
    ref = perplexity(model, eval_ids, ctx=ctx, stride=ctx)
    console.print(f"reference ({args.model}, fp32 dequantised GGUF): ppl {ref.ppl:.3f}")
    rows = [
        {
            "method": "fp32 reference",
            "bits": 32,
            "group_size": None,
            "ppl": ref.ppl,
            "kl_mean": 0.0,
            "kl_median": 0.0,
            "kl_p99": 0.0,
            "top1": 1.0,
        }
    ]
    for bits, group in parse_schemes(args.schemes):
        for method in args.methods.split(","):
            console.print(f"[bold]{method.upper()} W{bits} g{group}[/bold]")
            t0, c0 = time.perf_counter(), time.process_time()
            q = quantize_model(
                model,
                method,
                bits,
                group,
                calib_tokens=calib,
                progress=True,
                calib_samples=args.calib_samples,
                calib_seq_len=args.calib_seq_len,
                gptq_act_order=args.act_order and method == "gptq",
            )
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            kl = kl_divergence(q, model, eval_ids, ctx=ctx, stride=ctx)
            sizes = model_nbytes(q)
            with tempfile.TemporaryDirectory() as tmp:
                save_quantized(q, tmp, float_dtype=torch.float16)
                disk = dir_bytes(Path(tmp))
            row = {
                "method": method + ("+act-order" if args.act_order and method == "gptq" else ""),
                "bits": bits,
                "group_size": group,
                "ppl": kl.ppl,
                "kl_mean": kl.mean,
                "kl_median": kl.median,
                "kl_p99": kl.p99,
                "top1": kl.top1_agreement,
                "rms_delta_p": kl.rms_delta_p,
                "quant_seconds": seconds,
                "quant_cpu_seconds": cpu,
                "quant_linear_bytes": sizes["quant_linear_bytes"],
                "quant_linear_fp16_bytes": sizes["quant_linear_fp16_bytes"],
                "memory_bytes": sizes["quant_linear_bytes"] + sizes["other_bytes"],
                "disk_bytes_fp16_rest": disk,
            }
            if method == "awq":
                groups = [g for layer in q.quant_report["layers"] for g in layer["groups"]]
                by_prev: dict[str, list[float]] = {}
                for g in groups:
                    by_prev.setdefault(g["prev"], []).append(g["alpha"])
                row["awq_alpha_mean"] = {k: sum(v) / len(v) for k, v in by_prev.items()}
                row["awq_scale_max_mean"] = sum(g["scale_max"] for g in groups) / len(groups)
            console.print(
                f"  ppl {kl.ppl:.3f}  KL {kl.mean:.4f}  top-1 {kl.top1_agreement:.3f}  "
                f"{seconds:.0f} s wall / {cpu:.0f} s CPU"
            )
            rows.append(row)
            del q

    columns = (
        "method",
        "W",
        "g",
        "ppl",
        "KL mean",
        "KL p99",
        "top-1",
        "linears MiB",
        "x<fp16",
        "disk MiB",
        "time s (CPU s)",
    )
    cells = []
    for r in rows:
        if r["bits"] == 32:
            cells.append((r["method"], "32", "-", f"{r['ppl']:.3f}", "0", "0", "1.000", *["-"] * 4))
            continue
        cells.append(
            (
                r["method"].upper(),
                str(r["bits"]),
                str(r["group_size"]),
                f"{r['ppl']:.3f}",
                f"{r['kl_mean']:.4f}",
                f"{r['kl_p99']:.3f}",
                f"{r['top1']:.3f}",
                f"{r['quant_linear_bytes'] / 2**20:.1f}",
                f"{r['quant_linear_fp16_bytes'] / r['quant_linear_bytes']:.2f}",
                f"{r['disk_bytes_fp16_rest'] / 2**20:.1f}",
                f"{r['quant_seconds']:.0f} ({r['quant_cpu_seconds']:.0f})",
            )
        )
    title = f"Weight quantization of {args.model}: {len(eval_ids)} web-bible tokens"
    console.print(table(title, columns, cells))
    result = {
        "model": args.model,
        **run_info(),
        "eval_tokens": len(eval_ids),
        "ctx": ctx,
        "calib": f"{args.calib_samples}x{args.calib_seq_len}",
        "rows": rows,
    }
    out = Path(args.out)
    write_report(console, out, result)
    _plot(rows, Path(args.png) if args.png else out.with_suffix(".png"))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quant = [r for r in rows if r["bits"] != 32]
    labels = [f"{r['method'].upper()}\nW{r['bits']} g{r['group_size']}" for r in quant]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(labels, [r["kl_mean"] for r in quant], color="tab:blue")
    axes[0].set_ylabel("mean KL(ref || quantized), nats")
    axes[0].set_yscale("log")
    ref = next((r["ppl"] for r in rows if r["bits"] == 32), math.nan)
    axes[1].bar(labels, [r["ppl"] for r in quant], color="tab:orange")
    axes[1].axhline(ref, color="k", linestyle="--", label=f"fp32 {ref:.2f}")
    axes[1].set_ylabel("perplexity")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle("RTN vs AWQ vs GPTQ")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
