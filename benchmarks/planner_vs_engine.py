"""The planner's prediction against the engine's measurement, for small 3D configs on CPU.

For each config, every rank of a real gloo run counts its communication per process group and
op (through `llmopt.parallel.comm`) for one optimizer step, and meters the bytes autograd saves
for backward (activation memory). The planner (`llmopt.plan.comm.collectives_for`,
`llmopt.plan.memory`) predicts both for the first and the last pipeline stage. The engine runs
in bf16 (fp32 gradient reduction), the planner's "megatron" numerics.

    python benchmarks/planner_vs_engine.py --out runs/planner_vs_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from llmopt.validate.crosscheck import MB, SEQ, CrosscheckCase, crosscheck_model
from llmopt.validate.planner_engine import planner_prediction

CONFIGS = {
    "pp4": CrosscheckCase.of(pp=4, num_microbatches=4),
    "tp2-sp-pp2-z1": CrosscheckCase.of(
        tp=2, pp=2, sequence_parallel=True, zero_stage=1, num_microbatches=2
    ),
    "pp2-dp2-interleaved-z2": CrosscheckCase.of(
        pp=2, dp=2, zero_stage=2, num_microbatches=2, schedule="interleaved", virtual_stages=2
    ),
    "tp2-pp2-dp2-z1-sel": CrosscheckCase.of(
        tp=2, pp=2, dp=2, zero_stage=1, num_microbatches=2, recompute="selective"
    ),
    "pp2-dp2-gpipe-z3-full-tied": CrosscheckCase.of(
        pp=2, dp=2, zero_stage=3, num_microbatches=3, schedule="gpipe", recompute="full", tied=True
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    parser.add_argument("--out", default="runs/planner_vs_engine.json")
    args = parser.parse_args(argv)
    from llmopt.train.launch import spawn
    from llmopt.validate.crosscheck import engine_step

    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    console = Console(width=160)
    report = {}
    t0 = time.perf_counter()
    for name in names:
        case = CONFIGS[name]
        plan = case.plan
        world, dp = plan.world_size, plan.dp
        ranks = spawn(engine_step, world, case)
        pred = planner_prediction(case)
        first = next(r for r in ranks if r["coords"]["pp"] == 0)
        last = next(r for r in ranks if r["coords"]["pp"] == plan.pp - 1)
        interior = [r for r in ranks if 0 < r["coords"]["pp"] < plan.pp - 1]
        table = Table(title=f"{name}: {plan.short()} — bytes per step (calls)")
        for col in ("group/op", "planner first", "engine first", "planner last", "engine last"):
            table.add_column(col, justify="right")
        if interior:
            table.add_column("engine interior", justify="right")
        rows = []
        keys = sorted(
            set(pred["comm"]["first"])
            | set(pred["comm"]["last"])
            | set(first["comm"])
            | set(last["comm"])
        )
        for key in keys:
            pf, pl = pred["comm"]["first"].get(key), pred["comm"]["last"].get(key)
            ef, el = first["comm"].get(key), last["comm"].get(key)
            ei = interior[0]["comm"].get(key) if interior else None
            row = {
                "key": key,
                "planner_first": pf,
                "engine_first": ef,
                "planner_last": pl,
                "engine_last": el,
                "engine_interior": ei,
            }
            rows.append(row)
            cells = [key, _fmt(pf), _fmt(ef, pf), _fmt(pl), _fmt(el, pl)]
            if interior:
                cells.append(_fmt(ei))  # the planner lists only first and last stages
            table.add_row(*cells)
        console.print(table)
        acts = []
        for stage, rec in (("first", first), ("last", last)):
            planned = pred["activations"][stage]
            measured = rec["activation_peak_bytes"]
            acts.append(
                {
                    "stage": stage,
                    "planner": planned,
                    "measured": measured,
                    "ratio": measured / planned,
                }
            )
            console.print(
                f"  block activations, {stage} stage: planner {planned / 1024:.1f} KiB, "
                f"measured (saved tensors, peak) {measured / 1024:.1f} KiB, "
                f"ratio {measured / planned:.2f}"
            )
        report[name] = {
            "case": case.to_dict(),
            "dp": dp,
            "comm": rows,
            "activations": acts,
            "loss": first["loss"],
        }
    payload = {
        "configs": report,
        "seq_len": SEQ,
        "micro_batch": MB,
        "model": crosscheck_model().to_dict(),
        "wall_s": time.perf_counter() - t0,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=float))
    os.replace(tmp, out)
    console.print(f"wrote {out}")
    return 0


_NO_REF = object()


def _fmt(entry: dict | None, ref: object = _NO_REF) -> str:
    """`bytes (calls)`; engine cells get ✓ / ✗ for exact byte agreement with the planner."""
    text = "-" if entry is None else f"{int(entry['bytes'])} ({int(entry['calls'])})"
    if ref is _NO_REF or (entry is None and ref is None):
        return text
    same = entry is not None and ref is not None and int(entry["bytes"]) == int(ref["bytes"])
    return text + (" ✓" if same else " ✗")


if __name__ == "__main__":
    sys.exit(main())
