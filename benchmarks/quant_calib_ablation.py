"""Why GPTQ and AWQ lose out of domain: calibration source, size and method knobs, measured.

Each variant quantizes SmolLM2-135M at W4-g128 and is scored (ppl, mean KL, top-1 against
the unquantized model) on web-bible (in domain for the old default calibration) and on two
corpora no calibration mix may use (`corpus.EVAL_ONLY`): torch docstrings and package
READMEs. Variants change one thing at a time against the default recipe.

    python benchmarks/quant_calib_ablation.py --out runs/quant_calib_ablation.json
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

BIBLE = "corpus:web-bible"
# label -> (method, calib mix or "default", n_samples, seq_len, QuantConfig overrides)
VARIANTS: dict[str, tuple[str, str, int, int, dict[str, Any]]] = {
    "rtn": ("rtn", "default", 16, 512, {}),
    "gptq-ao bible (old default)": ("gptq", BIBLE, 16, 512, {}),
    "gptq-ao mix": ("gptq", "default", 16, 512, {}),
    "gptq-ao mix damp=0.1": ("gptq", "default", 16, 512, {"gptq_damp": 0.1}),
    "gptq mix no act-order": ("gptq", "default", 16, 512, {"gptq_act_order": False}),
    "gptq-ao bible damp=0.1": ("gptq", BIBLE, 16, 512, {"gptq_damp": 0.1}),
    "gptq-ao mix 64x128": ("gptq", "default", 64, 128, {}),
    "awq bible (old default)": ("awq", BIBLE, 16, 512, {}),
    "awq mix": ("awq", "default", 16, 512, {}),
}


def main(argv: list[str] | None = None) -> None:
    from llmopt.compress.quant.calibration import DEFAULT_MIX

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="labels, comma-separated")
    parser.add_argument("--eval", default=DEFAULT_EVAL)
    parser.add_argument("--eval-tokens", type=int, default=2048, help="per corpus")
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
        method, mix, n, seq_len, overrides = VARIANTS[label]
        mix = DEFAULT_MIX if mix == "default" else mix
        calib = calibration_set(tokenizer, mix, n, seq_len)
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
