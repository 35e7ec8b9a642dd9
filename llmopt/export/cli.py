"""`llmopt export`: write a model in the layout another runtime loads (GGUF, ONNX, HF)."""

from __future__ import annotations

import argparse
import sys
import time

from llmopt import cli_args, jsonout
from llmopt.export.output import ExportError

FORMATS = ("gguf", "onnx", "hf")


def register(subparsers: argparse._SubParsersAction) -> None:
    from llmopt.export.gguf import GGUF_TYPES

    p = subparsers.add_parser(
        "export",
        help="export a model for llama.cpp (GGUF), onnxruntime/TensorRT (ONNX) or transformers",
        description="Export a model (packaged name, .gguf, HF or quantized directory) to GGUF, "
        "ONNX with KV-cache inputs, or a HF safetensors directory. Quantized linears are "
        "dequantised (use `llmopt quantize --format` for packed-integer layouts).",
    )
    p.add_argument("--model", required=True, help="model name, .gguf file or directory")
    p.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="gguf: llama.cpp; onnx: onnxruntime/TensorRT with KV-cache inputs; hf: transformers",
    )
    p.add_argument("--out", required=True, help="output file (gguf) or directory (onnx, hf)")
    p.add_argument("--gguf-type", default="f16", choices=GGUF_TYPES, help="GGUF weight type")
    cli_args.add_dtype(p, help="dtype of the ONNX/HF weights", choices=("float32", "float16"))
    cli_args.add_overwrite(p)
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="HF: largest safetensors file (bytes or e.g. 500MB, 5GB); larger models are sharded "
        "with model.safetensors.index.json (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run, check=check_args)


def check_args(args: argparse.Namespace) -> None:
    """What `export` can refuse before loading the model (the output path: `llmopt.cli`)."""
    if args.format != "gguf" and args.gguf_type != "f16":
        raise ExportError(f"--gguf-type applies to --format gguf only, not {args.format}")
    if args.format != "hf" and args.max_shard_size != "5GB":
        raise ExportError(f"--max-shard-size applies to --format hf only, not {args.format}")
    if args.format == "gguf":
        cli_args.output_file(args, "out", b"GGUF", "a GGUF file")
    else:
        cli_args.output_dir(args, f"export:{args.format}")


def progress(quiet: bool):
    """Step messages on stderr (long exports show what they are doing); none with --json."""

    def say(message: str) -> None:
        if not quiet:
            print(f"llmopt export: {message}", file=sys.stderr, flush=True)

    return say


def run(args: argparse.Namespace) -> int:
    import torch

    from llmopt.models.loading import load_model, load_tokenizer

    check_args(args)
    say = progress(args.json)
    say(f"loading {args.model}")
    model = load_model(args.model, dtype=torch.float32)
    tokenizer = load_tokenizer(args.model)
    common = {"tokenizer": tokenizer, "source": args.model}
    what = {"gguf": f"GGUF {args.gguf_type}", "onnx": f"ONNX {args.dtype} (tracing the model)"}
    say(f"writing {what.get(args.format, 'HF ' + args.dtype)} to {args.out}")
    start = time.perf_counter()
    if args.format == "gguf":
        from llmopt.export.gguf import export_gguf

        out = export_gguf(model, args.out, qtype=args.gguf_type, **common)
    elif args.format == "onnx":
        from llmopt.export.onnx import export_onnx

        out = export_onnx(model, args.out, dtype=args.dtype, overwrite=args.overwrite, **common)
    else:
        from llmopt.export.hf import export_hf

        out = export_hf(
            model,
            args.out,
            dtype=args.dtype,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            **common,
        )
    say(f"done in {time.perf_counter() - start:.1f} s")
    files = [out] if out.is_file() else sorted(f for f in out.iterdir() if f.is_file())
    summary = {
        "model": args.model,
        "format": args.format,
        "out": str(out),
        "bytes": sum(f.stat().st_size for f in files),
        "files": [f.name for f in files],
    }
    if args.json:
        print(jsonout.dumps(summary, indent=2))
    else:
        print(f"wrote {args.format} export of {args.model} to {out} ({summary['bytes']} bytes)")
    return 0
