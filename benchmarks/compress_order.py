"""Which order of compression steps for SmolLM2-135M: quantize only; prune 2:4 -> quantize;
prune -> distil (recover) -> quantize; distil (a depth-pruned student) -> quantize.

Each order is an `llmopt compress --recipe` run (`llmopt.recipe`), so every
intermediate is measured the same way: size on disk and batch-1 greedy decode tokens/s, and
on every --eval corpus (`quant_quality`'s scoring: the first --eval-tokens of each, ctx =
stride = 256) perplexity, KL(original ‖ model) and top-1 agreement with the original. The
WEB Bible is in domain (calibration and the distil text come from its second half); the
`corpus.EVAL_ONLY` corpora are never calibrated or trained on. The recipe's own metrics
(its overlapping windows on the Bible) stay in the JSON rows.

    python benchmarks/compress_order.py --out runs/compress_order.json
"""

from __future__ import annotations

import argparse
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
from rich.console import Console

from llmopt.data.corpus import CorpusError
from llmopt.models.loading import load_model, load_tokenizer
from llmopt.recipe import Recipe, run_recipe


def orders(args: argparse.Namespace) -> dict[str, list[dict]]:
    prune = {"kind": "prune", "method": args.prune_method, "sparsity": "2:4",
             "calib_tokens": args.calib_tokens, "calib_seq_len": 256}  # fmt: skip
    quant = {"kind": "quantize", "method": "rtn", "bits": 4, "group_size": 64}
    distil = {"kind": "distill", "steps": args.distil_steps, "seq_len": args.seq_len,
              "global_batch": 2, "micro_batch": 2, "lr": args.lr, "warmup_steps": 2,
              "max_chars": 400_000}  # fmt: skip
    student = {**distil, "student": f"init:teacher-layers={args.student_layers}"}
    return {
        "quantize": [quant],
        "prune-quantize": [prune, quant],
        "prune-distil-quantize": [prune, distil, quant],
        "distil-quantize": [student, quant],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--orders", default="quantize,prune-quantize,prune-distil-quantize,distil-quantize"
    )
    p.add_argument("--prune-method", default="sparsegpt")
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--distil-steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--student-layers", default="0-23,29", help="the depth-pruned student")
    p.add_argument("--eval", default=DEFAULT_EVAL, help="evaluation corpora, first = in-domain")
    p.add_argument("--eval-tokens", type=int, default=1024, help="per corpus")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--decode", default="auto", choices=("auto", "fast", "eager"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default="runs/compress_order")
    p.add_argument("--out", default="runs/compress_order.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 140))
    ev = {"max_tokens": args.eval_tokens, "ctx": 256, "decode_tokens": args.decode_tokens,
          "decode": args.decode}  # fmt: skip
    chosen = orders(args)
    unknown = sorted(set(args.orders.split(",")) - set(chosen))
    if unknown:
        p.error(f"--orders: unknown order {unknown[0]!r}; valid: {', '.join(chosen)}")
    tokenizer = load_tokenizer(args.model)
    try:
        sets = eval_sets(tokenizer, args.eval, args.eval_tokens)
    except CorpusError as err:
        p.error(f"--eval: {err}")
    ref = reference_copy(load_model(args.model))
    results: dict[str, list[dict]] = {}
    original = None
    for name in args.orders.split(","):
        recipe = Recipe.from_dict(
            {
                "model": args.model,
                "out": str(Path(args.work) / name),
                "eval": ev,
                "stage": chosen[name],
            }  # fmt: skip
        )
        rows = run_recipe(recipe, log=console.print, original_row=original)
        for row in rows[0 if original is None else 1 :]:  # the original is scored once
            row["eval"] = score(load_model(row["model"]), ref, sets, ev["ctx"])
        original = rows[0]
        results[name] = rows
        report = {**run_info(), "args": vars(args), "eval": list(sets), "orders": results}
        write_report(console, Path(args.out), report)
    cells = [("original", *_cells("-", original))]
    for name, rows in results.items():
        for r in rows[1:]:
            cells.append((name, *_cells(r["stage"], r)))
    cols = ("order", *quality_columns(sets), "MiB", "decode tok/s", "path")
    title = f"compression orders, {args.model}: {args.eval_tokens} tokens per corpus"
    console.print(table(title, ("stage" if c == "variant" else c for c in cols), cells))
    return 0


def _cells(stage: str, r: dict) -> tuple[str, ...]:
    return (
        *quality_cells(stage, r["eval"]),
        f"{r['disk_bytes'] / 2**20:.1f}",
        f"{r['decode_tokens_per_s']:.1f}",
        r["decode_path"],
    )


if __name__ == "__main__":
    raise SystemExit(main())
