"""`llmopt quantize`: quantize a model's weights and write a directory `load_model` reads."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from llmopt import cli_args
from llmopt.jsonout import dumps

if TYPE_CHECKING:
    from llmopt.models.packed.quant.config import QuantConfig

FORMATS = ("llmopt", "autoawq", "gptq", "compressed-tensors", "gguf")
GGUF_DEFAULT = "q4_0"  # --gguf-type of --format gguf
# the flags that make the QuantConfig (`quant_config`); a recipe's quantize stage takes the
# same keys with the same defaults (`llmopt.recipe.options`)
CONFIG_FLAGS = (
    "--method", "--bits", "--group-size", "--sym", "--calib", "--calib-samples",
    "--calib-seq-len", "--calib-seed", "--clip-tokens", "--duo-scaling", "--act-order",
    "--range-grid", "--lm-head",
)  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    from llmopt.models.packed.quant.config import METHODS, QuantConfig
    from llmopt.models.packed.quant.format import VALID_BITS

    p = subparsers.add_parser(
        "quantize",
        help="quantize weights (RTN, AWQ, GPTQ) to packed INT4/INT8",
        description="Quantize a model's linear layers and write a quantized directory that "
        "`llmopt generate/eval --model DIR` loads (or AutoAWQ's GEMM layout).",
    )
    p.add_argument("--model", default="smollm2-135m", help="model name, .gguf or HF directory")
    p.add_argument(
        "--method",
        default="awq",
        choices=METHODS,
        help="rtn: round to nearest; awq: activation-aware scales; gptq: Hessian-based rounding",
    )
    p.add_argument("--bits", type=int, default=4, help=f"one of {list(VALID_BITS)}")
    p.add_argument("--group-size", type=int, default=128, help="32, 64, 128 or -1 (per channel)")
    p.add_argument(
        "--sym",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="symmetric grid (zero point fixed); default: symmetric for --format gptq and "
        "compressed-tensors (what vLLM's Marlin kernels run), asymmetric otherwise",
    )
    p.add_argument(
        "--calib",
        default="mix:default",
        help="calibration sources (AWQ, GPTQ): SOURCE[=WEIGHT],... with SOURCE corpus:NAME or "
        "a text file; mix:default is web-bible=3, py-docs, stdlib-docs, stdlib-comments=1 each",
    )
    p.add_argument("--calib-samples", type=int, default=16, help="calibration sequences")
    p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--calib-seed", type=int, default=0, help="seed of the calibration draw")
    p.add_argument(
        "--clip-tokens",
        type=int,
        default=None,
        help="AWQ: score the clipping search on this many random calibration tokens "
        "(default: all of them)",
    )
    p.add_argument(
        "--duo-scaling",
        action="store_true",
        help="AWQ: scales from activations and weights, x^a / w^(1-a), as AutoAWQ",
    )
    p.add_argument(
        "--act-order",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GPTQ: visit columns by decreasing Hessian diagonal (default on)",
    )
    p.add_argument(
        "--range-grid",
        type=int,
        default=QuantConfig.gptq_range_grid,
        help="GPTQ: search each group's range in 1/N steps for the least Hessian-weighted "
        "rounding error (0: min/max; default %(default)s)",
    )
    p.add_argument(
        "--lm-head", dest="quantize_head", action="store_true", help="also quantize the LM head"
    )
    p.add_argument(
        "--format",
        default="llmopt",
        choices=FORMATS,
        help="output layout (gguf: the quantized weights dequantised into --gguf-type)",
    )
    p.add_argument(
        "--gguf-type",
        default=None,
        help=f"GGUF weight type for --format gguf only (f16, q8_0, ...; default {GGUF_DEFAULT})",
    )
    cli_args.add_dtype(
        p,
        "--float-dtype",
        default="keep",
        choices=("keep", "float16", "bfloat16"),
        help="dtype of the unquantized tensors on disk (keep: exact round trip; float16 halves "
        "the embedding's bytes)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="output directory (a .gguf file for --format gguf); not the source's. An earlier "
        "quantize output of the same format there is replaced once the new one is complete",
    )
    cli_args.add_overwrite(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run, check=check_args)


def _check_export_options(args: argparse.Namespace) -> None:
    """Refuse options the chosen export cannot hold before any calibration runs."""
    from llmopt.export.output import ExportError, choice

    if args.format == "gguf":
        from llmopt.export.gguf import GGUF_TYPES

        choice(args.gguf_type or GGUF_DEFAULT, GGUF_TYPES, "gguf type")
    if args.format == "gptq":
        from llmopt.export.gptq import GPTQ_BITS

        if args.bits not in GPTQ_BITS:
            raise ExportError(f"GPTQ export holds bits {GPTQ_BITS}; got --bits {args.bits}")


def _export(qmodel, args: argparse.Namespace, tokenizer):
    """The `llmopt.export` writers for the formats that live there."""
    if args.format == "gptq":
        from llmopt.export.gptq import export_gptq

        return export_gptq(qmodel, args.out, tokenizer, source=args.model, overwrite=args.overwrite)
    if args.format == "compressed-tensors":
        from llmopt.export.compressed_tensors import export_compressed_tensors

        return export_compressed_tensors(
            qmodel, args.out, tokenizer, source=args.model, overwrite=args.overwrite
        )
    from llmopt.export.gguf import export_gguf

    qtype = args.gguf_type or GGUF_DEFAULT
    return export_gguf(qmodel, args.out, tokenizer, qtype=qtype, source=args.model)


def default_sym(fmt: str) -> bool:
    """The grid `--sym` defaults to: symmetric where the consumers' fast kernels need it."""
    from llmopt.export.gptq import SYMMETRIC_FORMATS

    return fmt in SYMMETRIC_FORMATS


def check_args(args: argparse.Namespace) -> None:
    """Counts named by their flags and the output, before anything loads."""
    cli_args.integer(args, "calib_samples", 1)
    cli_args.integer(args, "calib_seq_len", 1)
    cli_args.integer(args, "range_grid", 0)
    cli_args.integer(args, "clip_tokens", 1)
    if args.gguf_type is not None and args.format != "gguf":
        raise cli_args.ArgumentError(
            f"--gguf-type {args.gguf_type} applies to --format gguf only, not --format "
            f"{args.format}; drop it or add --format gguf"
        )
    if args.format == "gguf":
        cli_args.output_file(args, "out", b"GGUF", "a GGUF file")
    else:
        cli_args.output_dir(args, f"quantize:{args.format}")


def quant_config(args: argparse.Namespace) -> QuantConfig:
    """The QuantConfig the flags (CONFIG_FLAGS, and --format for the grid) describe."""
    from llmopt.models.packed.quant.config import QuantConfig

    return QuantConfig(
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        sym=default_sym(args.format) if args.sym is None else args.sym,
        calib=args.calib,
        calib_samples=args.calib_samples,
        calib_seq_len=args.calib_seq_len,
        calib_seed=args.calib_seed,
        awq_clip_tokens=args.clip_tokens,
        awq_duo_scaling=args.duo_scaling,
        gptq_act_order=args.act_order,
        gptq_range_grid=args.range_grid,
        quantize_lm_head=args.quantize_head,
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from llmopt.artifacts import check_distinct
    from llmopt.compress.prune.cli import source_path
    from llmopt.compress.quant.apply import model_nbytes, quantize_model
    from llmopt.compress.quant.calibration import command_calibration
    from llmopt.data.mix import parse_mix
    from llmopt.models.loading import load_model, load_tokenizer
    from llmopt.models.packed.metadata import compression_metadata

    config = quant_config(args)
    if config.needs_calibration:
        parse_mix(config.calib)  # a bad --calib fails before the model loads
    check_distinct(args.out, source_path(args.model))  # never overwrite the source weights
    model = load_model(args.model, dtype=torch.float32)
    if args.format == "autoawq":
        from llmopt.compress.quant.autoawq import check_autoawq_compatible

        check_autoawq_compatible(model, args.bits, args.group_size)
    _check_export_options(args)
    tokenizer = load_tokenizer(args.model)
    calib, coverage = command_calibration(tokenizer, config)
    start, cpu_start = time.perf_counter(), time.process_time()
    qmodel = quantize_model(model, config=config, calib_tokens=calib, progress=not args.json)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if args.format == "autoawq":
        from llmopt.compress.quant.autoawq import export_autoawq

        out = export_autoawq(qmodel, args.out, tokenizer, overwrite=args.overwrite)
    elif args.format in ("gptq", "compressed-tensors", "gguf"):
        out = _export(qmodel, args, tokenizer)
    else:
        from llmopt.compress.quant.io import save_quantized
        from llmopt.dtypes import torch_dtype

        float_dtype = None if args.float_dtype == "keep" else torch_dtype(args.float_dtype)
        out = save_quantized(
            qmodel, args.out, tokenizer, float_dtype=float_dtype, overwrite=args.overwrite
        )
    sizes = model_nbytes(qmodel)
    summary: dict[str, Any] = {
        "model": args.model,
        "method": config.method,
        "bits": config.bits,
        "group_size": config.group_size,
        "format": args.format,
        "out": str(out),
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),
        "disk_bytes": out.stat().st_size
        if out.is_file()
        else sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
        **sizes,
    }
    if coverage is not None:
        summary["calibration"] = coverage
    if config.method == "awq":
        alphas = [
            g["alpha"]
            for layer in compression_metadata(qmodel).quant_report["layers"]
            for g in layer["groups"]
        ]
        summary["awq_mean_alpha"] = round(sum(alphas) / len(alphas), 3)
    if args.json:
        print(dumps(summary, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    from llmopt.compress.quant.calibration import describe_coverage

    table = Table(
        title=f"llmopt quantize: {config.method.upper()} W{config.bits} g{config.group_size}"
    )
    table.add_column("item")
    table.add_column("value", justify="right")
    ratio = sizes["quant_linear_fp16_bytes"] / max(sizes["quant_linear_bytes"], 1)
    rows = [
        ("output", f"{out} ({args.format})"),
        ("quantization time", f"{seconds:.1f} s wall, {cpu_seconds:.1f} s CPU"),
        (
            "quantized linears",
            f"{sizes['quant_linear_bytes'] / 2**20:.2f} MiB ({ratio:.2f}x < fp16)",
        ),
        ("other tensors", f"{sizes['other_bytes'] / 2**20:.2f} MiB"),
        ("size on disk", f"{summary['disk_bytes'] / 2**20:.2f} MiB"),
    ]
    if coverage is not None:
        rows.append(("calibration tokens", describe_coverage(coverage)))
    if "awq_mean_alpha" in summary:
        rows.append(("AWQ mean α", f"{summary['awq_mean_alpha']}"))
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return 0
