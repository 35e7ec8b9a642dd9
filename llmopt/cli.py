"""`llmopt` command line: a thin dispatcher over the Python API.

Each subcommand lives next to the API it drives (`llmopt/<area>/cli.py`) and exposes
`register(subparsers)`. Only the chosen subcommand's module is imported, so `llmopt plan` does
not pay for importing the training engine.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with `register(subparsers)`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("llmopt.infer.cli", "generate text with a model (KV cache, sampling, --draft)"),
    "eval": ("llmopt.eval.cli", "perplexity and KL-divergence evaluation on real text"),
    "plan": ("llmopt.plan.cli", "choose and explain the parallel mapping of a model on a cluster"),
    "train": ("llmopt.train.cli", "distributed training (TP/SP/PP/DP/ZeRO) launched by torchrun"),
    "quantize": ("llmopt.compress.cli", "quantize weights (RTN, AWQ, GPTQ) to packed INT4/INT8"),
    "prune": ("llmopt.compress.prune.cli", "prune weights (magnitude, Wanda, SparseGPT; 0.5, 2:4)"),
    "distill": ("llmopt.compress.distill.cli", "distil a teacher into a smaller student (KD)"),
    "compress": ("llmopt.compress.recipe", "chain prune/distil/quantize from a recipe TOML"),
    "serve": ("llmopt.serve.cli", "OpenAI-compatible server with continuous batching"),
    "bench": ("llmopt.serve.bench_cli", "load-test an OpenAI-compatible server (bench serve)"),
    "profile": ("llmopt.profile.cli", "profile generation: trace, op table, launches, roofline"),
    "report": ("llmopt.report.cli", "one self-contained HTML page of optimization results"),
    "export": ("llmopt.export.cli", "export a model as GGUF, ONNX (KV cache) or HF safetensors"),
}


class CliError(Exception):
    """An error to print as one line (no traceback) with exit status 2."""


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmopt",
        description="Plan, apply and measure LLM training and inference optimizations.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def build_parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmopt")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    module = importlib.import_module(COMMANDS[command][0])
    module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        if not argv or argv[0] in ("-h", "--help"):
            parser.print_help()
            return 0 if argv else 2
        parser.error(f"unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}")
    args = build_parser(argv[0]).parse_args(argv)
    try:
        result = args.func(args)
    except (CliError, FileNotFoundError, ValueError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"llmopt {argv[0]}: error: {message}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
