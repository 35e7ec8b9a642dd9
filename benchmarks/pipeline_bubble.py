"""Measured pipeline bubble vs theory: gpipe, 1f1b and interleaved on gloo CPU processes.

Stage compute is made uniform (tiny model + a fixed sleep per forward/backward, split over the
v chunks of a rank), so the idle fraction of each rank can be compared with
(p-1)/(m+p-1) and (p-1)/(v*m+p-1). Communication is real (`batch_isend_irecv` on gloo).

    python benchmarks/pipeline_bubble.py --pp 4 --num-microbatches 8 --out runs/pipeline_bubble.json \
        --png docs/pipeline_bubble.png
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

from llmopt.train.launch import spawn


def _worker(rank, world, cases, t_fwd, t_bwd, steps):
    """One pipeline rank (inside `llmopt.train.launch.spawn`'s gloo world): events per step."""
    import torch
    import torch.distributed as dist

    from llmopt.models import ModelConfig, build_model
    from llmopt.parallel.comm import CommCounter, Group
    from llmopt.parallel.pipeline.executor import PipelineExecutor
    from llmopt.parallel.pipeline.schedule import build_schedule
    from llmopt.parallel.pipeline.stage import split_model
    from llmopt.validate.pipeline_measure import add_uniform_delay

    group = Group("pp", tuple(range(world)), rank, dist.group.WORLD, CommCounter())
    out = []
    for name, m, v in cases:
        cfg = ModelConfig(
            "bubble", 64, 16, 32, world * v, num_heads=2, num_kv_heads=2, max_seq_len=16
        )
        model = build_model(cfg, seed=0)
        stages = [
            add_uniform_delay(s, t_fwd / v, t_bwd / v) for s in split_model(model, rank, world, v)
        ]
        executor = PipelineExecutor(
            stages, build_schedule(name, world, m, v), group, record_events=True
        )
        tokens = torch.randint(0, 64, (m, 8), generator=torch.Generator().manual_seed(0))
        runs = []
        for step in range(steps + 1):
            dist.barrier()
            result = executor.step(tokens, tokens)
            model.zero_grad(set_to_none=True)
            if step:  # step 0 warms up
                runs.append((result.events, (result.start, result.end)))
        out.append(runs)
    return out


def run(pp: int, cases, t_fwd: float, t_bwd: float, steps: int):
    return spawn(_worker, pp, cases, t_fwd, t_bwd, steps, timeout_s=600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("-m", "--num-microbatches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=2, help="for interleaved")
    parser.add_argument("--t-fwd", type=float, default=0.02, help="seconds per stage forward")
    parser.add_argument("--t-bwd", type=float, default=0.04, help="seconds per stage backward")
    parser.add_argument("--steps", type=int, default=5, help="measured steps (after 1 warm-up)")
    parser.add_argument("--out", default="runs/pipeline_bubble.json")
    parser.add_argument("--png", default="runs/pipeline_bubble.png", help="measured timelines")
    parser.add_argument(
        "--sim-png", default="runs/pipeline_schedules.png", help="simulated timelines (theory)"
    )
    args = parser.parse_args(argv)

    from llmopt.parallel.pipeline.schedule import build_schedule
    from llmopt.parallel.pipeline.simulate import simulate, theoretical_bubble
    from llmopt.parallel.pipeline.timeline import render_png
    from llmopt.validate.pipeline_measure import measure_bubble

    pp, m, v = args.pp, args.num_microbatches, args.virtual_stages
    cases = [("gpipe", m, 1), ("1f1b", m, 1), ("interleaved", m, v)]
    for name, cm, cv in cases:
        build_schedule(name, pp, cm, cv)  # validate before spawning
    t0 = time.perf_counter()
    per_rank = run(pp, cases, args.t_fwd, args.t_bwd, args.steps)
    rows, panels = [], []
    for i, (name, cm, cv) in enumerate(cases):
        measured = []
        for step in range(args.steps):
            events = [per_rank[r][i][step][0] for r in range(pp)]
            windows = [per_rank[r][i][step][1] for r in range(pp)]
            measured.append((measure_bubble(events, windows), events))
        measured.sort(key=lambda x: x[0].mean_bubble)
        # Best of N steps: other jobs on the machine only ever add idle time (a delayed wake-up
        # or message), while the dependency chain bounds the bubble from below, so the least
        # disturbed step is the measurement; the median is reported alongside.
        best, events = measured[0]
        median = measured[len(measured) // 2][0]
        theory = theoretical_bubble(pp, cm, cv)
        sim = simulate(build_schedule(name, pp, cm, cv), args.t_fwd, args.t_bwd).mean_bubble
        rows.append(
            {
                "schedule": name,
                "pp": pp,
                "num_microbatches": cm,
                "virtual_stages": cv,
                "theory": theory,
                "simulated": sim,
                "measured_mean": best.mean_bubble,
                "measured_per_rank": list(best.bubble),
                "measured_median_step": median.mean_bubble,
                "rel_error": abs(best.mean_bubble - theory) / theory,
                "worst_rank_rel_error": max(abs(b - theory) / theory for b in best.bubble),
                "step_s": best.makespan,
                "all_steps_mean_bubble": [x[0].mean_bubble for x in measured],
            }
        )
        panels.append(
            (
                f"{name} pp={pp} m={cm} v={cv}: measured idle {best.mean_bubble:.3f}, "
                f"theory {theory:.3f}",
                events,
            )
        )
    table = Table(title=f"Pipeline bubble, measured on {pp} gloo processes (uniform stages)")
    for col in (
        "schedule",
        "m",
        "v",
        "theory",
        "simulated",
        "measured (best step)",
        "median step",
        "per rank",
        "rel err",
        "step s",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["schedule"],
            str(r["num_microbatches"]),
            str(r["virtual_stages"]),
            f"{r['theory']:.4f}",
            f"{r['simulated']:.4f}",
            f"{r['measured_mean']:.4f}",
            f"{r['measured_median_step']:.4f}",
            " ".join(f"{b:.3f}" for b in r["measured_per_rank"]),
            f"{100 * r['rel_error']:.1f}% / {100 * r['worst_rank_rel_error']:.1f}%",
            f"{r['step_s']:.3f}",
        )
    Console(width=150).print(table)
    render_png(panels, args.png, pp=pp, time_unit="s")
    sim_panels = []
    for name, cm, cv in cases:
        sim = simulate(build_schedule(name, pp, cm, cv), args.t_fwd, args.t_bwd)
        sim_panels.append(
            (f"{name} pp={pp} m={cm} v={cv} (simulated): idle {sim.mean_bubble:.3f}", sim.events)
        )
    render_png(sim_panels, args.sim_png, pp=pp, time_unit="s")
    payload = {
        "args": vars(args),
        "rows": rows,
        "wall_s": time.perf_counter() - t0,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, out)
    print(f"wrote {out}, {args.png} and {args.sim_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
