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

from llmopt.validate.crosscheck import MB, SEQ, crosscheck_model
from llmopt.validate.planner_engine import planner_prediction

CONFIGS = {
    "pp4": dict(tp=1, pp=4, sp=False, zero=0, m=4, schedule="1f1b", v=1, rc="none"),
    "tp2-sp-pp2-z1": dict(tp=2, pp=2, sp=True, zero=1, m=2, schedule="1f1b", v=1, rc="none"),
    "pp2-dp2-interleaved-z2": dict(
        tp=1, pp=2, dp=2, sp=False, zero=2, m=2, schedule="interleaved", v=2, rc="none"
    ),
    "tp2-pp2-dp2-z1-sel": dict(
        tp=2, pp=2, dp=2, sp=False, zero=1, m=2, schedule="1f1b", v=1, rc="selective"
    ),
    "pp2-dp2-gpipe-z3-full-tied": dict(
        tp=1, pp=2, dp=2, sp=False, zero=3, m=3, schedule="gpipe", v=1, rc="full", tied=True
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
        world = case["tp"] * case["pp"] * case.get("dp", 1)
        dp = world // (case["tp"] * case["pp"])
        ranks = spawn(engine_step, world, case)
        pred = planner_prediction(case, dp)
        first = next(r for r in ranks if r["coords"]["pp"] == 0)
        last = next(r for r in ranks if r["coords"]["pp"] == case["pp"] - 1)
        interior = [r for r in ranks if 0 < r["coords"]["pp"] < case["pp"] - 1]
        table = Table(title=f"{name}: {case} dp={dp} — bytes per step (calls)")
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
            "case": case,
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
