"""`llmopt bench serve`: parse, run `llmopt.serve.bench`, print a table, write JSON + PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_PROMPTS = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a steam engine turns heat into motion.",
    "List the planets of the solar system and describe each one in detail.",
    "Describe a walk through a busy market in a city you have never visited.",
)


def _levels(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--concurrency {text!r} must be comma-separated integers, e.g. 1,2,4"
        ) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks against running services")
    sub = bench.add_subparsers(dest="bench_command", metavar="TARGET", required=True)
    p = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server on loopback",
        description="Stream /v1/completions at each concurrency level; report TTFT, ITL, TPOT, "
        "output tokens/s and requests/s. Only loopback hosts are accepted.",
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--concurrency",
        type=_levels,
        default=[1, 2, 4, 8, 16, 32],
        help="concurrency levels to run in turn, comma-separated",
    )
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per level (bound)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--model", default=None, help="model name to send (default: /v1/models)")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable)")
    p.add_argument(
        "--out", type=Path, default=Path("runs/bench_serve.json"), help="JSON report path"
    )
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out as .png)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llmopt.artifacts import atomic_write_json
    from llmopt.serve.bench import plot, run_bench

    report = run_bench(
        args.url,
        args.concurrency,
        args.requests,
        args.time_limit,
        prompts=list(args.prompt or DEFAULT_PROMPTS),
        max_tokens=args.max_tokens,
        model=args.model,
    )
    plot_path = args.plot or args.out.with_suffix(".png")
    if args.json:
        from llmopt.jsonout import dumps

        atomic_write_json(args.out, report)
        plot(report, plot_path)
        print(dumps(report, indent=1))
        return 0
    print(f"{report['model']} at {report['url']} ({args.max_tokens} tokens per request)")
    header = "conc  reqs  err  out tok/s  req/s  TTFT p50 ms  TTFT p90 ms  ITL p50 ms  TPOT ms"
    print(header)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    for r in report["levels"]:
        print(
            f"{r['concurrency']:>4}  {r['requests']:>4}  {r['errors']:>3}  "
            f"{r['output_tokens_per_s']:>9.1f}  {r['requests_per_s']:>5.2f}  "
            f"{ms(r['ttft_p50_s']):>11}  {ms(r['ttft_p90_s']):>11}  {ms(r['itl_p50_s']):>10}  "
            f"{ms(r['tpot_mean_s']):>7}"
        )
    atomic_write_json(args.out, report)
    plot(report, plot_path)
    print(f"wrote {args.out} and {plot_path}")
    return 0
