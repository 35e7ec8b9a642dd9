"""Accuracy of magnitude, Wanda and SparseGPT pruning on a real model (default SmolLM2-135M).

For each (sparsity, method): pruning time (wall and CPU), and on every evaluation corpus
perplexity, KL(dense || pruned) statistics and top-1 agreement against the dense model
(`quant_quality`'s scoring: the first --eval-tokens of each corpus, ctx = stride windows),
and the bytes the saved pruned linears take relative to dense fp16 (N:M packed; unstructured
stored dense + 1-bit mask). Calibration windows (Wanda, SparseGPT) come from the second half
of `--calib` (default: `PruneConfig`'s, the broad `mix:default`), disjoint from the evaluation slice; the
out-of-domain corpora (`corpus.EVAL_ONLY`) are never calibration sources.

    OMP_NUM_THREADS=1 python benchmarks/prune_quality.py --sparsities 0.5,2:4 --out runs/prune.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _report import run_info, table, write_report
from quant_quality import (
    DEFAULT_EVAL,
    eval_sets,
    quality_cells,
    quality_columns,
    reference_copy,
    score,
)

from llmopt.models.packed.metadata import compression_metadata


def stored_ratio(pruned: torch.nn.Module) -> float:
    """Saved bytes of the pruned linears / their dense fp16 bytes (the save_pruned layout)."""
    from llmopt.models.packed.sparse.format import pack_nm

    sparsity = compression_metadata(pruned).prune_config.sparsity
    stored = dense = 0
    for name, keep in compression_metadata(pruned).prune_masks.items():
        weight = pruned.get_submodule(name).weight.data
        dense += 2 * weight.numel()
        if sparsity.structured:
            stored += pack_nm(weight, keep, sparsity.n, sparsity.m).nbytes()
        else:
            stored += 2 * weight.numel() + (weight.shape[1] + 7) // 8 * weight.shape[0]
    return stored / dense


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", default="magnitude,wanda,sparsegpt")
    parser.add_argument("--sparsities", default="0.5,2:4", help="comma-separated: 0.5, 2:4, 4:8")
    parser.add_argument("--calib", default=None, help="calibration text (default: PruneConfig's)")
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument(
        "--eval", default=DEFAULT_EVAL, help="evaluation corpora, first = in-domain"
    )
    parser.add_argument("--eval-tokens", type=int, default=4096, help="per corpus")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--out", default="runs/prune_quality.json")
    args = parser.parse_args(argv)

    from rich.console import Console

    from llmopt.compress.prune import PruneConfig, PruneConfigError, Sparsity, prune_model
    from llmopt.compress.quant.calibration import calibration_set
    from llmopt.data.corpus import CorpusError
    from llmopt.models.loading import load_model, load_tokenizer

    console = Console(width=max(Console().width, 160))
    calib_option = {} if args.calib is None else {"calib": args.calib}
    try:
        configs = {
            (str(s), m): PruneConfig(
                method=m,
                sparsity=s,
                calib_tokens=args.calib_tokens,
                calib_seq_len=args.calib_seq_len,
                **calib_option,
            )
            for s in (Sparsity.parse(text) for text in args.sparsities.split(","))
            for m in args.methods.split(",")
        }  # every option validated before any work
    except PruneConfigError as err:
        parser.error(str(err))
    tokenizer = load_tokenizer(args.model)
    try:
        sets = eval_sets(tokenizer, args.eval, args.eval_tokens)
    except CorpusError as err:
        parser.error(f"--eval: {err}")
    first = next(iter(configs.values()))
    try:  # the windows `calibration_tokens` gives, with their coverage report
        calib = calibration_set(
            tokenizer, first.calib, first.calib_samples, first.calib_seq_len, first.calib_seed
        )
    except CorpusError as err:
        parser.error(str(err) if str(err).startswith("--calib") else f"--calib: {err}")
    model = load_model(args.model)
    ref = reference_copy(model)
    result = {
        "model": args.model,
        **run_info(),
        "eval_tokens": args.eval_tokens,
        "eval": list(sets),
        "ctx": args.ctx,
        "calibration": calib.coverage,
        "rows": [],
    }
    cells = []
    for (sparsity, method), config in configs.items():
        console.print(f"[bold]{method} {sparsity}[/bold]")
        t0, c0 = time.perf_counter(), time.process_time()
        pruned = prune_model(model, config=config, calib_tokens=calib.tokens, progress=True)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = score(pruned, ref, sets, args.ctx)
        row = {
            "sparsity": sparsity,
            "method": method,
            "pruned_fraction": compression_metadata(pruned).prune_report["pruned_fraction"],
            "eval": stats,
            "stored_vs_fp16": stored_ratio(pruned),
            "prune_seconds": seconds,
            "prune_cpu_seconds": cpu,
        }
        console.print(
            "  "
            + "  ".join(
                f"{k}: ppl {v['ppl']:.2f} KL {v['kl_mean']:.4f} top-1 {v['top1']:.3f}"
                for k, v in stats.items()
            )
            + f"  ({seconds:.0f} s wall / {cpu:.0f} s CPU)"
        )
        result["rows"].append(row)
        cells.append(
            (
                *quality_cells(f"{method} {sparsity}", stats),
                f"{row['stored_vs_fp16']:.4f}",
                f"{cpu:.0f}",
            )
        )
        write_report(console, Path(args.out), result)  # after every row: a killed run keeps them
        del pruned

    dense = ["dense fp32"]
    for name in sets:
        dense += [f"{result['rows'][0]['eval'][name]['ref_ppl']:.2f}", "0", "1.000"]
    title = f"Pruning {args.model}: {args.eval_tokens} tokens per corpus"
    columns = (*quality_columns(sets), "bytes/fp16", "CPU s")
    console.print(table(title, columns, [(*dense, "1", "-"), *cells]))


if __name__ == "__main__":
    main()
