"""`llmopt profile`: profile generation (prefill + decode steps) and write the artifacts.

Writes into --out: trace.json (Chrome/Perfetto), ops.json (summary, per-op tables, counts,
memory timeline, measured peaks), roofline.png and memory.png; prints the decode op table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmopt import cli_args
from llmopt.dtypes import torch_dtype
from llmopt.errors import UsageError
from llmopt.infer.cli import add_model_arguments, check_model_args

DEFAULT_PROMPT = "The history of the printing press begins with"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="profile generation: trace, op table, launches per step, memory, roofline",
        description="Greedy generation under torch.profiler with llmopt phase ranges (NVTX on "
        "CUDA, for `nsys profile`). Writes trace.json, ops.json, roofline.png and memory.png.",
    )
    add_model_arguments(parser)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens to generate (32)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--out", required=True, help="output directory")
    cli_args.add_overwrite(parser)
    parser.add_argument(
        "--json", action="store_true", help="print the summary (ops.json) instead of the table"
    )
    parser.add_argument("--top", type=int, default=15, help="op-table rows to print (15)")
    parser.add_argument(
        "--fast",
        action="store_true",
        help="profile the fused C++ decode step (generate's default path: one op per step) "
        "instead of the eager model op by op",
    )
    parser.set_defaults(func=run, check=check_args)


def check_args(args: argparse.Namespace) -> None:
    """What `profile` can refuse before loading the model."""
    check_model_args(args)
    cli_args.text(args, "prompt")
    cli_args.text(args, "device")
    cli_args.device(args, "device")
    cli_args.integer(args, "new_tokens", 2)
    cli_args.integer(args, "top", 1)
    cli_args.output_dir(args, "profile")


def _thin(points: list, limit: int = 2000) -> list:
    """At most ~`limit` timeline points, always keeping the peak."""
    if len(points) <= limit:
        return points
    step = -(-len(points) // limit)
    peak = max(range(len(points)), key=lambda i: points[i][1])
    keep = sorted(set(range(0, len(points), step)) | {peak, len(points) - 1})
    return [points[i] for i in keep]


def run(args: argparse.Namespace) -> int:
    import torch

    from llmopt.artifacts import atomic_write_json
    from llmopt.models.loading import load_model, load_tokenizer
    from llmopt.output_dir import record_in_place
    from llmopt.peaks import measure_peaks
    from llmopt.profile.plots import plot_memory, plot_roofline
    from llmopt.profile.session import profile_generate

    check_args(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    dtype = torch_dtype(args.dtype)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=dtype, device=device)
    ids = tokenizer.encode(args.prompt, add_bos=tokenizer.add_bos)
    peaks = measure_peaks(device, dtype)
    summary = profile_generate(
        model, ids, args.new_tokens, peaks, trace_path=out / "trace.json", fast=args.fast
    )
    summary["model"] = args.model
    summary["memory"]["timeline_ms_bytes"] = _thin(summary["memory"]["timeline_ms_bytes"])
    summary["roofline_points"] = plot_roofline(summary, out / "roofline.png")
    plot_memory(summary, out / "memory.png")
    summary["files"] = ["trace.json", "ops.json", "roofline.png", "memory.png"]
    atomic_write_json(out / "ops.json", summary)
    record_in_place(out, "profile", summary["files"])
    if args.json:
        from llmopt.jsonout import dumps

        print(dumps({"out": str(out), **summary}, indent=1))
        return 0
    _print(summary, args.top)
    print(f"wrote {', '.join(str(out / f) for f in summary['files'])}")
    return 0


def _print(summary: dict, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    d = summary["decode"]
    key = "self_device_us" if summary["time_basis"] == "device" else "self_cpu_us"
    table = Table(title=f"decode step: {summary['model']} on {summary['device']} ({key}, per step)")
    for col in ("op", "calls", "self ms", "%", "GFLOP", "MB", "FLOP/B"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for row in d["table"][:top]:
        flops, moved = row["flops"], row["bytes"]
        table.add_row(
            row["name"],
            f"{row['calls']:.0f}",
            f"{row[key] / 1e3:.3f}",
            f"{row['percent']:.1f}",
            "-" if flops is None else f"{flops / 1e9:.4f}",
            "-" if moved is None else f"{moved / 1e6:.3f}",
            "-" if not flops or not moved else f"{flops / moved:.2f}",
        )
    table.add_row(
        "(outside ops: Python, modules)",
        "",
        f"{d['outside_ops_ms_per_step']:.3f}",
        "",
        "",
        "",
        "",
    )
    console = Console()
    console.print(table)
    p = summary["prefill"]
    mem = summary["memory"]
    console.print(
        f"decode: {d['wall_ms_per_step']:.2f} ms/step profiled "
        f"({d['unprofiled_wall_ms_per_step']:.2f} unprofiled), ops self time "
        f"{d['op_self_ms_per_step']:.2f} ms/step ({100 * d['op_coverage']:.1f}% of wall; "
        f"{100 * d['profile_coverage']:.1f}% with the time outside ops), "
        f"{d['ops_per_step']:.0f} ops/step, {d['kernel_launches_per_step']:.0f} kernel launches/step "
        f"[{summary['launch_kind']}]\n"
        f"prefill: {p['wall_ms']:.2f} ms ({summary['prompt_tokens']} tokens), {p['ops']} ops, "
        f"{p['kernel_launches']} launches; peak memory {mem['peak_bytes'] / 2**20:.1f} MiB "
        f"(weights/baseline {mem['baseline_bytes'] / 2**20:.1f} MiB); NVTX ranges: "
        f"{'on' if summary['nvtx'] else 'off (no CUDA)'}"
    )
