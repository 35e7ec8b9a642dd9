"""Accuracy of magnitude, Wanda and SparseGPT pruning on a real model (default SmolLM2-135M).

For each (sparsity, method): pruning time (wall and CPU), perplexity on a fixed web-bible slice
(the corpus's first tokens; calibration windows come from its second half), KL(dense || pruned)
statistics and top-1 agreement against the dense model, and the bytes the saved pruned linears
take relative to dense fp16 (N:M packed; unstructured stored dense + 1-bit mask).

    OMP_NUM_THREADS=1 python benchmarks/prune_quality.py --sparsities 0.5 --out runs/prune_50.json
"""

from __future__ import annotations

import argparse
import time

import torch


def stored_ratio(pruned: torch.nn.Module) -> float:
    """Saved bytes of the pruned linears / their dense fp16 bytes (the save_pruned layout)."""
    from llmopt.compress.prune.packed import pack_nm

    sparsity = pruned.prune_config.sparsity
    stored = dense = 0
    for name, keep in pruned.prune_masks.items():
        weight = pruned.get_submodule(name).weight.data
        dense += 2 * weight.numel()
        if sparsity.structured:
            stored += pack_nm(weight, keep, sparsity.n, sparsity.m).nbytes()
        else:
            stored += 2 * weight.numel() + (weight.shape[1] + 7) // 8 * weight.shape[0]
    return stored / dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="magnitude,wanda,sparsegpt")
    parser.add_argument("--sparsities", default="0.5,2:4", help="comma-separated: 0.5, 2:4, 4:8")
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--out", default="runs/prune_quality.json")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from llmopt.artifacts import atomic_write_json
    from llmopt.compress.prune import PruneConfig, Sparsity, prune_model
    from llmopt.compress.quant.calibration import calibration_tokens
    from llmopt.data.corpus import load_text
    from llmopt.eval.kl import kl_divergence
    from llmopt.eval.perplexity import perplexity
    from llmopt.models.loading import load_model, load_tokenizer

    console = Console()
    sparsities = [Sparsity.parse(s) for s in args.sparsities.split(",")]
    methods = args.methods.split(",")
    configs = {
        (str(s), m): PruneConfig(
            method=m,
            sparsity=s,
            calib_tokens=args.calib_tokens,
            calib_seq_len=args.calib_seq_len,
        )
        for s in sparsities
        for m in methods
    }  # every option validated before any work
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    text = load_text("corpus:web-bible", max_chars=args.eval_tokens * 8)
    eval_ids = tokenizer.encode(text)[: args.eval_tokens]
    if len(eval_ids) < args.eval_tokens:
        raise SystemExit(f"only {len(eval_ids)} evaluation tokens; lower --eval-tokens")
    first = next(iter(configs.values()))
    calib = calibration_tokens(
        tokenizer, first.calib, first.calib_samples, first.calib_seq_len, first.calib_seed
    )
    ctx = args.ctx
    ref = perplexity(model, eval_ids, ctx=ctx, stride=ctx)
    console.print(f"dense {args.model} (fp32): ppl {ref.ppl:.3f} on {len(eval_ids)} tokens")
    result = {
        "model": args.model,
        "eval_tokens": len(eval_ids),
        "ctx": ctx,
        "calib_tokens": int(calib.numel()),
        "calib_seq_len": args.calib_seq_len,
        "dense_ppl": ref.ppl,
        "rows": [],
    }
    for (sparsity, method), config in configs.items():
        console.print(f"[bold]{method} {sparsity}[/bold]")
        t0, c0 = time.perf_counter(), time.process_time()
        pruned = prune_model(model, config=config, calib_tokens=calib, progress=True)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        kl = kl_divergence(pruned, model, eval_ids, ctx=ctx, stride=ctx)
        row = {
            "sparsity": sparsity,
            "method": method,
            "pruned_fraction": pruned.prune_report["pruned_fraction"],
            "ppl": kl.ppl,
            "kl_mean": kl.mean,
            "kl_median": kl.median,
            "kl_p99": kl.p99,
            "top1": kl.top1_agreement,
            "rms_delta_p": kl.rms_delta_p,
            "stored_vs_fp16": stored_ratio(pruned),
            "prune_seconds": seconds,
            "prune_cpu_seconds": cpu,
        }
        console.print(
            f"  ppl {kl.ppl:.3f}  KL {kl.mean:.4f}  top-1 {kl.top1_agreement:.3f}  "
            f"{seconds:.0f} s wall / {cpu:.0f} s CPU"
        )
        result["rows"].append(row)
        atomic_write_json(args.out, result)  # after every row: a killed run keeps its rows
        del pruned

    table = Table(
        title=f"Pruning {args.model}: {len(eval_ids)} web-bible tokens, dense ppl {ref.ppl:.2f}"
    )
    for col in ("sparsity", "method", "ppl", "KL mean", "KL p99", "top-1", "bytes/fp16", "CPU s"):
        table.add_column(col, justify="left" if col in ("sparsity", "method") else "right")
    for r in result["rows"]:
        table.add_row(
            r["sparsity"],
            r["method"],
            f"{r['ppl']:.2f}",
            f"{r['kl_mean']:.3f}",
            f"{r['kl_p99']:.2f}",
            f"{r['top1']:.3f}",
            f"{r['stored_vs_fp16']:.3f}",
            f"{r['prune_cpu_seconds']:.0f}",
        )
    console.print(table)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
