"""`llmopt prune`: prune a model's linears and write a directory `load_pruned` reads."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmopt import cli_args
from llmopt.jsonout import dumps

if TYPE_CHECKING:
    from llmopt.models.packed.sparse.config import PruneConfig


# the flags that make the PruneConfig (`prune_config`); a recipe's prune stage takes the same
# keys with the same defaults (`llmopt.recipe.options`)
CONFIG_FLAGS = (
    "--method", "--sparsity", "--calib", "--calib-tokens", "--calib-seq-len", "--damp",
    "--block-size",
)  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    from llmopt.models.packed.sparse.config import METHODS

    p = subparsers.add_parser(
        "prune",
        help="prune weights (magnitude, Wanda, SparseGPT), unstructured or N:M",
        description="Prune a model's block linears and write a directory that "
        "llmopt.compress.prune.load_pruned reads (N:M packed as fp16 values + bit-packed "
        "indices; unstructured stored dense with its mask).",
    )
    p.add_argument("--model", default="smollm2-135m", help="model name, .gguf or HF directory")
    p.add_argument(
        "--method",
        default="sparsegpt",
        choices=METHODS,
        help="magnitude: |w|; wanda: |w| x input norm; sparsegpt: Hessian-based with updates",
    )
    p.add_argument(
        "--sparsity",
        default="0.5",
        help="fraction pruned in (0, 1), e.g. 0.5, or N:M kept, e.g. 2:4",
    )
    p.add_argument(
        "--calib",
        default="mix:default",
        help="calibration sources (Wanda, SparseGPT): SOURCE[=WEIGHT],... as for quantize; "
        "mix:default is web-bible, py-docs, stdlib-docs, stdlib-comments",
    )
    p.add_argument(
        "--calib-tokens",
        type=int,
        default=8192,
        help="calibration tokens in all (whole windows of --calib-seq-len, rounded down)",
    )
    p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    p.add_argument("--damp", type=float, default=0.01, help="SparseGPT Hessian dampening")
    p.add_argument("--block-size", type=int, default=128, help="SparseGPT lazy-update block")
    cli_args.add_dtype(
        p,
        "--float-dtype",
        default="keep",
        choices=("keep", "float16", "bfloat16"),
        help="dtype of the unpruned tensors on disk (keep: exact round trip; float16 halves "
        "the embedding's bytes); pruned linears are fp16 either way",
    )
    p.add_argument("--out", required=True, help="output directory (not the source's)")
    cli_args.add_overwrite(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run, check=check_args)


def check_args(args: argparse.Namespace) -> None:
    """The output directory, before anything loads (`llmopt.output_dir`)."""
    from llmopt.compress.prune.io import KIND

    cli_args.output_dir(args, KIND)


def source_path(model: str) -> Path:
    """What --out must stay out of: a directory model, or a packaged model's data directory."""
    from llmopt.models.loading import resolve_spec
    from llmopt.models.registry import is_model_name

    _, path = resolve_spec(model)
    return path.parent if is_model_name(model) else path


def prune_config(args: argparse.Namespace) -> PruneConfig:
    """The PruneConfig the flags (CONFIG_FLAGS) describe."""
    from llmopt.models.packed.sparse.config import PruneConfig, Sparsity

    return PruneConfig(
        method=args.method,
        sparsity=Sparsity.parse(str(args.sparsity)),
        calib=args.calib,
        calib_tokens=args.calib_tokens,
        calib_seq_len=args.calib_seq_len,
        damp=args.damp,
        block_size=args.block_size,
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from llmopt.compress.prune.apply import prune_model
    from llmopt.compress.prune.io import check_out_dir, save_pruned
    from llmopt.compress.quant.calibration import command_calibration, describe_coverage
    from llmopt.data.mix import parse_mix
    from llmopt.dtypes import torch_dtype
    from llmopt.models.loading import load_model, load_tokenizer
    from llmopt.models.packed.metadata import compression_metadata

    config = prune_config(args)
    if config.needs_calibration:
        parse_mix(config.calib)  # a bad --calib fails before the model loads
    source = source_path(args.model)
    check_out_dir(args.out, source, args.overwrite)  # before minutes of calibration
    model = load_model(args.model, dtype=torch.float32)
    tokenizer = load_tokenizer(args.model)
    calib, coverage = command_calibration(tokenizer, config)
    start, cpu_start = time.perf_counter(), time.process_time()
    pruned = prune_model(model, config=config, calib_tokens=calib, progress=not args.json)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    float_dtype = None if args.float_dtype == "keep" else torch_dtype(args.float_dtype)
    out = save_pruned(
        pruned,
        args.out,
        tokenizer,
        source=source,
        float_dtype=float_dtype,
        overwrite=args.overwrite,
    )
    meta = json.loads((out / "llmopt_prune.json").read_text())
    report = compression_metadata(pruned).prune_report
    summary: dict[str, Any] = {
        "model": args.model,
        "method": config.method,
        "sparsity": str(config.sparsity),
        "pruned_fraction": round(report["pruned_fraction"], 6),
        "out": str(out),
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),
        "pruned_linear_bytes": meta["pruned_linear_bytes"],
        "pruned_linear_fp16_bytes": meta["pruned_linear_fp16_bytes"],
        "disk_bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
    }
    if coverage is not None:
        summary["calibration"] = coverage
    if args.json:
        print(dumps(summary, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"llmopt prune: {config.method} {config.sparsity}")
    table.add_column("item")
    table.add_column("value", justify="right")
    ratio = summary["pruned_linear_bytes"] / max(summary["pruned_linear_fp16_bytes"], 1)
    layout = "packed N:M" if config.sparsity.structured else "dense fp16 + 1-bit mask"
    for row in (
        ("output", str(out)),
        ("pruned weights", f"{summary['pruned_fraction']:.2%} of the block linears"),
        ("pruning time", f"{seconds:.1f} s wall, {cpu_seconds:.1f} s CPU"),
        (
            "pruned linears",
            f"{summary['pruned_linear_bytes'] / 2**20:.2f} MiB = {ratio:.3f}x fp16 ({layout})",
        ),
        ("size on disk", f"{summary['disk_bytes'] / 2**20:.2f} MiB"),
        *([("calibration tokens", describe_coverage(coverage))] if coverage else []),
    ):
        table.add_row(*row)
    Console().print(table)
    return 0
