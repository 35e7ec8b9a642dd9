"""Why GPTQ and AWQ lose out of domain: calibration source, size and method knobs, measured.

Each variant quantizes SmolLM2-135M at W4-g128 and is scored (ppl, mean KL, top-1 against
the unquantized model) on web-bible (in domain for the old default calibration) and on two
corpora no calibration mix may use (`corpus.EVAL_ONLY`): torch docstrings and package
READMEs. Variants change one thing at a time (calibration mix, its size, one method
knob) against the default recipe (`mix25`, 16 x 512); docs/benchmarks/quant.md has the table.

    python benchmarks/quant_calib_ablation.py --out runs/quant_calib_ablation.json
    python benchmarks/quant_calib_ablation.py --eval-tokens 2048 --variants "rtn,gptq-ao mix50 16x512"
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from _report import run_info, table, write_report
from quant_quality import (
    DEFAULT_EVAL,
    eval_sets,
    quality_cells,
    quality_columns,
    reference_copy,
    score,
)

# the calibration mixes compared (labels in the table)
MIXES = {
    "bible": "corpus:web-bible",
    "mix25": (
        "corpus:web-bible=0.25,corpus:py-docs=0.25,corpus:stdlib-docs=0.25,"
        "corpus:stdlib-comments=0.25"
    ),
    "mix50": (  # the default since: weight 3 for the Bible, 7 of 16 windows
        "corpus:web-bible=3,corpus:py-docs=1,corpus:stdlib-docs=1,corpus:stdlib-comments=1"
    ),
}
MINMAX = {"gptq_range_grid": 0}  # each group's range = its min/max (the default before issue 19)
RANGE = {"gptq_range_grid": 50, "gptq_max_shrink": 0.2}  # range searched, shrink <= 20%
# AWQ's clipping scored on 512 random tokens (the default before)
CLIP512 = {"awq_clip_tokens": 512}
# label -> (method, mix label, n_samples, seq_len, QuantConfig overrides); rows name their range
# and clipping rules, so a row means the same thing whatever the defaults are. Today's
# defaults: "gptq-ao mix50 + range shrink=0.35" and "awq mix50 clip=all".
VARIANTS: dict[str, tuple[str, str, int, int, dict[str, Any]]] = {
    "rtn": ("rtn", "mix25", 16, 512, {}),
    # calibration source and size, min/max ranges (the recipe issue 19 measured)
    "gptq-ao bible 16x512": ("gptq", "bible", 16, 512, MINMAX),
    "gptq-ao mix25 16x512": ("gptq", "mix25", 16, 512, MINMAX),
    "gptq-ao mix50 16x512": ("gptq", "mix50", 16, 512, MINMAX),
    "gptq-ao mix25 32x512": ("gptq", "mix25", 32, 512, MINMAX),
    "gptq-ao mix50 32x512": ("gptq", "mix50", 32, 512, MINMAX),
    "gptq-ao bible 32x512": ("gptq", "bible", 32, 512, MINMAX),
    "gptq-ao mix25 64x128": ("gptq", "mix25", 64, 128, MINMAX),
    # GPTQ knobs, min/max ranges (mix25, 16x512)
    "gptq mix25 no act-order": ("gptq", "mix25", 16, 512, {**MINMAX, "gptq_act_order": False}),
    "gptq-ao mix25 damp=0.1": ("gptq", "mix25", 16, 512, {**MINMAX, "gptq_damp": 0.1}),
    "gptq-ao mix25 damp=0.001": ("gptq", "mix25", 16, 512, {**MINMAX, "gptq_damp": 0.001}),
    "gptq-ao mix25 not true-seq": (
        "gptq",
        "mix25",
        16,
        512,
        {**MINMAX, "gptq_true_sequential": False},
    ),
    "gptq-ao mix25 lazy groups": ("gptq", "mix25", 16, 512, {**MINMAX, "gptq_groups": "lazy"}),
    # the group range searched (H_jj-weighted rounding error), then one knob at a time
    "gptq-ao mix25 + range": ("gptq", "mix25", 16, 512, RANGE),
    "gptq-ao bible + range": ("gptq", "bible", 16, 512, RANGE),
    "gptq-ao mix50 + range": ("gptq", "mix50", 16, 512, RANGE),
    "gptq-ao mix25 32x512 + range": ("gptq", "mix25", 32, 512, RANGE),
    "gptq-ao mix25 64x128 + range": ("gptq", "mix25", 64, 128, RANGE),
    "gptq mix25 no act-order + range": (
        "gptq",
        "mix25",
        16,
        512,
        {**RANGE, "gptq_act_order": False},
    ),
    "gptq-ao mix25 lazy + range": ("gptq", "mix25", 16, 512, {**RANGE, "gptq_groups": "lazy"}),
    "gptq-ao mix25 + range shrink=0.35": (
        "gptq",
        "mix25",
        16,
        512,
        {**RANGE, "gptq_max_shrink": 0.35},
    ),
    "gptq-ao bible seed=1": ("gptq", "bible", 16, 512, {**MINMAX, "calib_seed": 1}),
    "gptq-ao mix25 seed=1": ("gptq", "mix25", 16, 512, {**MINMAX, "calib_seed": 1}),
    "gptq-ao mix50 + range shrink=0.35": (
        "gptq",
        "mix50",
        16,
        512,
        {**RANGE, "gptq_max_shrink": 0.35},
    ),
    "gptq-ao mix50 32x512 + range": ("gptq", "mix50", 32, 512, RANGE),
    "gptq-ao mix25 + range damp=0.001": (
        "gptq",
        "mix25",
        16,
        512,
        {**RANGE, "gptq_damp": 0.001},
    ),
    # AWQ: source, then its search knobs (mix25, 16x512), clipping scored on 512 tokens
    "awq bible 16x512": ("awq", "bible", 16, 512, CLIP512),
    "awq mix25 16x512": ("awq", "mix25", 16, 512, CLIP512),
    "awq mix50 16x512": ("awq", "mix50", 16, 512, CLIP512),
    "awq mix50 search=16 seed=1": (
        "awq",
        "mix50",
        16,
        512,
        {**CLIP512, "awq_search_samples": 16, "calib_seed": 1},
    ),  # fmt: skip
    "awq mix50 32x512": ("awq", "mix50", 32, 512, CLIP512),
    "awq mix25 grid=10": ("awq", "mix25", 16, 512, {**CLIP512, "awq_grid": 10}),
    "awq mix25 no clip": ("awq", "mix25", 16, 512, {"awq_clip": False}),
    "awq mix25 search=16": ("awq", "mix25", 16, 512, {**CLIP512, "awq_search_samples": 16}),
}


# the same recipe on other calibration draws: "LABEL seed=N"
for _base, _seeds in {
    "gptq-ao mix25 + range": (1, 2),
    "gptq-ao mix25 32x512 + range": (1, 2),
    "gptq-ao mix50 + range": (1, 2),
    "gptq-ao bible + range": (1,),
    "gptq-ao mix50 + range shrink=0.35": (1, 2),
    "gptq-ao mix50 32x512 + range": (1, 2),
    "awq mix50 16x512": (1, 2),
    "awq bible 16x512": (1,),
}.items():
    _method, _mix, _n, _seq, _knobs = VARIANTS[_base]
    for _seed in _seeds:
        VARIANTS[f"{_base} seed={_seed}"] = (
            _method,
            _mix,
            _n,
            _seq,
            {**_knobs, "calib_seed": _seed},
        )

# the clipping search's token sample, the source of AWQ's seed-to-seed spread (issue 19), with
# plain and duo (activation and weight) scales; clip=all is the default since
for _clip in (512, 2048, 4096, None):
    for _seed in (0, 1, 2):
        _suffix = f" seed={_seed}" if _seed else ""
        _knobs = {"awq_clip_tokens": _clip, **({"calib_seed": _seed} if _seed else {})}
        _name = "all" if _clip is None else _clip
        if _clip != 512:
            VARIANTS[f"awq mix50 clip={_name}{_suffix}"] = ("awq", "mix50", 16, 512, _knobs)
        VARIANTS[f"awq mix50 duo clip={_name}{_suffix}"] = (
            "awq", "mix50", 16, 512, {**_knobs, "awq_duo_scaling": True}
        )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="labels, comma-separated")
    parser.add_argument("--eval", default=DEFAULT_EVAL)
    parser.add_argument("--eval-tokens", type=int, default=4096, help="per corpus")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--out", default="runs/quant_calib_ablation.json")
    args = parser.parse_args(argv)
    labels = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in labels if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")

    from rich.console import Console

    from llmopt.compress.quant.apply import quantize_model
    from llmopt.compress.quant.calibration import calibration_set
    from llmopt.models.loading import load_model, load_tokenizer

    console = Console()
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.model)
    sets = eval_sets(tokenizer, args.eval, args.eval_tokens)
    ref = reference_copy(model)
    rows, cells = [], []
    out = Path(args.out)
    for label in labels:
        method, mix_label, n, seq_len, overrides = VARIANTS[label]
        mix = MIXES[mix_label]
        calib = calibration_set(tokenizer, mix, n, seq_len, overrides.get("calib_seed", 0))
        console.print(f"[bold]{label}[/bold]")
        t0, c0 = time.perf_counter(), time.process_time()
        q = quantize_model(
            model,
            method,
            4,
            128,
            calib_tokens=calib.tokens,
            progress=False,
            calib=mix,
            calib_samples=n,
            calib_seq_len=seq_len,
            **overrides,
        )
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = score(q, ref, sets, args.ctx)
        console.print(
            "  "
            + "  ".join(f"{k}: ppl {v['ppl']:.2f} KL {v['kl_mean']:.4f}" for k, v in stats.items())
            + f"  ({seconds:.0f} s wall / {cpu:.0f} s CPU)"
        )
        rows.append(
            {
                "variant": label,
                "method": method,
                "mix": mix_label,
                "calib": calib.coverage,
                "overrides": overrides,
                "eval": stats,
                "quant_seconds": seconds,
                "quant_cpu_seconds": cpu,
            }
        )
        cells.append(quality_cells(label, stats))
        del q
        result = {"model": args.model, **run_info(), "eval_tokens": args.eval_tokens, "rows": rows}
        write_report(console, out, result)  # after every variant: a partial run is kept
    title = f"W4-g128 ablation, {args.model}: {args.eval_tokens} tokens per corpus"
    console.print(table(title, quality_columns(sets), cells))


if __name__ == "__main__":
    main()
