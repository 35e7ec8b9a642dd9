"""`llmopt compress --recipe recipe.toml`: chain prune / distil / quantize / fuse stages and
measure every intermediate against the original model.

    model = "smollm2-135m"
    out = "runs/order/prune-distil-quant"
    [eval]                      # held-out text: evaluation reads the corpus from its start
    text = "corpus:web-bible"
    max_tokens = 2048
    [[stage]]
    kind = "prune"              # the `llmopt prune` flags: method, sparsity, calib, ...
    sparsity = "2:4"
    [[stage]]
    kind = "distill"            # student ("previous" or init:...), steps, seq_len, ... (recover)
    steps = 40
    [[stage]]
    kind = "quantize"           # the `llmopt quantize` flags: method, bits, group_size, ...
    bits = 4

A prune or quantize stage takes the keys of the command's flags that describe the result
(`--group-size` is `group_size`, `--calib-samples` is `calib_samples`) with the command's
defaults (quantize: awq, 4 bits, group 128, 16 x 512 calibration tokens; prune: sparsegpt,
0.5, 8192 calibration tokens); the output flags (--format, --out, ...) do not apply. An older
recipe's quantize `calib_tokens` is refused naming `calib_samples`.

Each stage reads the previous stage's model and writes `<out>/NN-kind/`; its metrics (ppl,
KL and top-1 agreement vs the original, size on disk, batch-1 decode speed) go to
`<out>/NN-kind.metrics.json`, and all rows to `<out>/recipe_metrics.json`. A distil stage
after a prune stage keeps the sparsity: the masks are applied again to the trained weights
and the result is saved as a pruned directory. `fuse` writes nothing and measures the
previous model on the fused C++ decode path (`llmopt.infer.fast`), the others measure it on
whichever path `generate` picks.
"""

from __future__ import annotations

import argparse
import json

from llmopt import cli_args
from llmopt.recipe.config import Recipe
from llmopt.recipe.run import run_recipe


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compress", help="chain prune/distil/quantize from a recipe TOML", description=__doc__
    )
    p.add_argument("--recipe", required=True, help="recipe TOML (see llmopt compress -h)")
    p.add_argument("--out", default=None, help="output directory (overrides the recipe's)")
    cli_args.add_overwrite(p)
    p.add_argument("--json", action="store_true", help="print the metric rows as JSON")
    p.set_defaults(func=handle, check=check_args)


def check_args(args: argparse.Namespace) -> None:
    """The recipe (types, stages, values) and its output directory, before any stage runs."""
    Recipe.from_toml(args.recipe, args.out, args.overwrite)


def handle(args: argparse.Namespace) -> int:
    recipe = Recipe.from_toml(args.recipe, args.out, args.overwrite)
    rows = run_recipe(recipe, log=(lambda _: None) if args.json else print)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'stage':<28}{'ppl':>9}{'KL':>9}{'top-1':>8}{'MiB':>9}{'tok/s':>9}")
    for r in rows:
        print(
            f"{r['stage']:<28}{r['ppl']:>9.2f}{r['kl_vs_original']:>9.4f}"
            f"{r['top1_vs_original']:>8.3f}{r['disk_bytes'] / 2**20:>9.1f}"
            f"{r['decode_tokens_per_s']:>9.1f}"
        )
    return 0
