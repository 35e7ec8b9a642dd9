"""Print (and draw) a pipeline schedule: `python -m llmopt.parallel.pipeline --help`.

    python -m llmopt.parallel.pipeline --schedule interleaved --pp 4 -m 8 -v 2 \
        --png runs/schedule.png

Shows each rank's program, the simulated timeline with uniform stage times, the idle (bubble)
fraction against theory and the peak activations held; `--json` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from llmopt.parallel.pipeline.schedule import SCHEDULES, ScheduleError, build_schedule
from llmopt.parallel.pipeline.simulate import simulate, theoretical_bubble
from llmopt.parallel.pipeline.timeline import render_png, render_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmopt.parallel.pipeline",
        allow_abbrev=False,
        description="Show a pipeline schedule: programs, simulated timeline, bubble, memory.",
    )
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)}")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    parser.add_argument("-m", "--num-microbatches", type=int, default=8)
    parser.add_argument("-v", "--virtual-stages", type=int, default=1, help="chunks per rank")
    parser.add_argument("--t-fwd", type=float, default=1.0, help="forward time of a stage")
    parser.add_argument("--t-bwd", type=float, default=2.0, help="backward time of a stage")
    parser.add_argument("--t-comm", type=float, default=0.0, help="latency of one message")
    parser.add_argument("--png", help="also draw the timeline into this PNG")
    parser.add_argument("--programs", action="store_true", help="print every rank's actions")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        schedule = build_schedule(
            args.schedule, args.pp, args.num_microbatches, args.virtual_stages
        )
        result = simulate(schedule, args.t_fwd, args.t_bwd, args.t_comm)
    except ScheduleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    theory = theoretical_bubble(args.pp, args.num_microbatches, args.virtual_stages)
    if args.png:
        title = f"{args.schedule} pp={args.pp} m={args.num_microbatches} v={args.virtual_stages}"
        render_png(result.events, args.png, pp=args.pp, title=title)
    if args.json:
        print(
            json.dumps(
                {
                    "schedule": args.schedule,
                    "pp": args.pp,
                    "num_microbatches": args.num_microbatches,
                    "virtual_stages": args.virtual_stages,
                    "makespan": result.makespan,
                    "bubble_per_rank": list(result.bubble),
                    "bubble_theory": theory,
                    "peak_in_flight": list(result.peak_in_flight),
                    "programs": [[str(a) for a in acts] for acts in schedule.actions],
                    "png": args.png,
                }
            )
        )
        return 0
    if args.programs:
        print(schedule.format())
        print()
    print(render_text(result.events, args.pp))
    print(
        f"\nidle fraction {result.mean_bubble:.4f} (theory for uniform stages, free "
        f"communication: {theory:.4f}); peak activations held per rank "
        f"(micro-batch x chunk): {' '.join(map(str, result.peak_in_flight))}"
    )
    if args.png:
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
