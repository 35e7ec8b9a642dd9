"""`llmopt report DIR --out report.html`: one self-contained page of the results under DIR."""

from __future__ import annotations

import argparse

from llmopt.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="one self-contained HTML page of the optimization results in a directory",
        description="Gather Markdown write-ups (tables, commands, machine), plots and llmopt "
        "result JSON (profile, eval gate/kl, quantize) under DIR into one HTML page with a "
        "trade-off table; plots are inlined as data URIs.",
    )
    parser.add_argument("dir", help="directory to gather (e.g. docs/benchmarks or a runs/ dir)")
    parser.add_argument("--out", required=True, help="HTML file to write")
    parser.add_argument("--title", default="llmopt optimization report", help="page title")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.set_defaults(func=run, check=check_args)


def check_args(args: argparse.Namespace) -> None:
    """What `report` can refuse before reading the directory."""
    from pathlib import Path

    if not args.out.endswith((".html", ".htm")):
        raise UsageError(f"--out {args.out} must end in .html or .htm")
    if not Path(args.dir).is_dir():
        raise FileNotFoundError(f"{args.dir} is not a directory")


def run(args: argparse.Namespace) -> int:
    from llmopt.artifacts import atomic_write_text
    from llmopt.report.collect import collect
    from llmopt.report.html import render
    from llmopt.report.tradeoff import tradeoff_rows

    check_args(args)
    results = collect(args.dir)
    atomic_write_text(args.out, render(results, args.title))
    n_images = len({p for w in results.writeups for p in w.images} | set(results.images))
    summary = {
        "out": str(args.out),
        "writeups": len(results.writeups),
        "plots": n_images,
        "result_files": sum(len(v) for v in results.json_results.values()),
        "tradeoff_rows": len(tradeoff_rows(results)),
        "unreadable": [{"file": str(p), "why": why} for p, why in results.unreadable],
    }
    if args.json:
        from llmopt.jsonout import dumps

        print(dumps(summary, indent=2))
        return 0
    print(
        f"wrote {args.out}: {summary['writeups']} write-ups, {n_images} plots, "
        f"{summary['result_files']} result JSON files, {summary['tradeoff_rows']} trade-off rows"
        + (f"; skipped {len(results.unreadable)} unreadable files" if results.unreadable else "")
    )
    return 0
