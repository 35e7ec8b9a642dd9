"""`llmopt` command line: a thin dispatcher over the Python API.

Each subcommand lives next to the API it drives (`llmopt/<area>/cli.py`) and exposes
`register(subparsers)`. Only the chosen subcommand's module is imported, so `llmopt plan` does
not pay for importing the training engine.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, NoReturn

from llmopt.errors import LlmoptError

# name -> (module with `register(subparsers)`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("llmopt.infer.cli", "generate text with a model (KV cache, sampling, --draft)"),
    "eval": ("llmopt.eval.cli", "perplexity and KL-divergence evaluation on real text"),
    "plan": ("llmopt.plan.cli", "choose and explain the parallel mapping of a model on a cluster"),
    "train": ("llmopt.train.cli", "distributed training (TP/SP/PP/DP/ZeRO) launched by torchrun"),
    "quantize": ("llmopt.compress.cli", "quantize weights (RTN, AWQ, GPTQ) to packed INT4/INT8"),
    "prune": ("llmopt.compress.prune.cli", "prune weights (magnitude, Wanda, SparseGPT; 0.5, 2:4)"),
    "distill": ("llmopt.compress.distill.cli", "distil a teacher into a smaller student (KD)"),
    "compress": ("llmopt.recipe.cli", "chain prune/distil/quantize from a recipe TOML"),
    "serve": ("llmopt.serve.cli", "OpenAI-compatible server with continuous batching"),
    "bench": ("llmopt.serve.bench_cli", "load-test an OpenAI-compatible server (bench serve)"),
    "profile": ("llmopt.profile.cli", "profile generation: trace, op table, launches, roofline"),
    "report": ("llmopt.report.cli", "one self-contained HTML page of optimization results"),
    "export": ("llmopt.export.cli", "export a model as GGUF, ONNX (KV cache) or HF safetensors"),
    "merge": ("llmopt.train.merge_cli", "fold LoRA adapters into their base model"),
}


# output flags checked (parent writable, a file where a file goes) before any work is done
OUTPUTS: dict[str, tuple[tuple[str, str], ...]] = {
    "quantize": (("out", "dir"),),
    "prune": (("out", "dir"),),
    "profile": (("out", "dir"),),
    "report": (("out", "file"),),
    "export": (("out", "format"),),  # a file for --format gguf, else a directory
    "train": (("out_dir", "dir"),),
    "bench": (("out", "file"), ("plot", "file")),
    "plan": (("emit", "file"), ("plot", "file")),
}
EXIT_USAGE = 2  # bad input: one line on stderr naming the value, the file or the path
EXIT_BUG = 1  # an exception that is not an input error: a bug in llmopt, with its traceback
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), quietly
EXIT_PIPE_CLOSED = 0  # the reader stopped early (`llmopt plan --json | head`): not a failure


class CliError(LlmoptError):
    """An error to print as one line (no traceback) with exit status 2."""


# flags renamed to one vocabulary (vLLM's names, the model config's field names): the old name
# is refused with one line naming the new one, rather than argparse's "unrecognized arguments"
RENAMED_FLAGS: dict[str, dict[str, str]] = {
    "plan": {
        "--layers": "--num-layers",
        "--hidden": "--hidden-size",
        "--heads": "--num-heads",
        "--kv-heads": "--num-kv-heads",
        "--ffn": "--intermediate-size",
        "--vocab": "--vocab-size",
        "--mlp": "--activation",
        "--sp": "--sequence-parallel",
        "--zero": "--zero-stage",
        "--microbatches": "--num-microbatches",
    },
    "serve": {
        "--max-batched-tokens": "--max-num-batched-tokens",
        "--no-prefix-caching": "--no-enable-prefix-caching",
    },
}


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching: `--gpus 8` must not silently mean `--gpus-per-node`.
    Subparsers inherit the class, so every `llmopt` parser refuses abbreviations. The top
    parser of a command (`command` set) reports what its subcommand left over in one line
    named after the command (`llmopt serve: error: unrecognized arguments: --bogus`)."""

    command: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs["formatter_class"] = _showing_defaults(kwargs.get("formatter_class"))
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if self.command is None:
            super().error(message)
        self.exit(EXIT_USAGE, f"llmopt {self.command}: error: {message}\n")


class _DefaultsShown(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already says it or the
    default says nothing (None, False, a suppressed value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default in (None, False, argparse.SUPPRESS) or not action.option_strings
        if quiet or "default" in text.lower() or text == argparse.SUPPRESS:
            return text
        shown = action.default
        if isinstance(shown, (list, tuple)):
            shown = ",".join(str(v) for v in shown)
        return f"{text} (default: {str(shown).replace('%', '%%')})".strip()


def _showing_defaults(formatter: type | None) -> type:
    """`formatter` (argparse's plain one by default) with `_DefaultsShown`'s help strings: the
    one place every `llmopt` parser and subparser gets its shown defaults from."""
    base = formatter or argparse.HelpFormatter
    if issubclass(base, _DefaultsShown):
        return base
    return type(f"Defaults{base.__name__}", (_DefaultsShown, base), {})


def renamed_flag(command: str, argv: list[str]) -> str | None:
    """The one-line refusal of a flag `command` renamed, if argv uses one."""
    renamed = RENAMED_FLAGS.get(command, {})
    for token in argv:
        old = token.split("=", 1)[0]
        if old in renamed:
            return f"{old} was renamed {renamed[old]} (one flag vocabulary across commands)"
    return None


def _top_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="llmopt",
        description="Plan, apply and measure LLM training and inference optimizations.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def build_parser(command: str) -> argparse.ArgumentParser:
    parser = Parser(prog="llmopt")
    parser.command = command
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
    renamed = renamed_flag(argv[0], argv[1:])
    if renamed is not None:
        print(f"llmopt {argv[0]}: error: {renamed}", file=sys.stderr)
        return EXIT_USAGE
    try:
        args = build_parser(argv[0]).parse_args(argv)
        check_arguments(argv[0], args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the terminal echoed ^C on
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE_CLOSED
    except Exception as exc:
        return fail(argv[0], exc)


def check_arguments(command: str, args: argparse.Namespace) -> None:
    """The command's own argument checks and its outputs' writability, before any work."""
    from llmopt.config_files import check_output

    check = getattr(args, "check", None)
    if check is not None:
        check(args)
    for dest, kind in OUTPUTS.get(command, ()):
        value = getattr(args, dest, None)
        if value is None:  # not given (train: the config file's out_dir is checked by train)
            continue
        if kind == "format":
            kind = "file" if args.format == "gguf" else "dir"
        check_output(value, "--" + dest.replace("_", "-"), kind)


def error_message(exc: BaseException) -> str | None:
    """The one line to print for an input error, or None for a bug (shown as a traceback).

    Input errors are `LlmoptError`s (every error llmopt raises for bad input derives from it),
    the operating system's refusals about a path (a missing file, no permission, a full disk),
    and the errors of the libraries that parse a user's file for us (safetensors, jinja).
    A `ValueError`, `KeyError` or `TypeError` from anywhere else is a bug, not bad input."""
    if isinstance(exc, LlmoptError):
        return " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and not isinstance(exc, (BrokenPipeError, ConnectionError)):
        if exc.filename is not None and exc.strerror:
            return f"{exc.filename}: {exc.strerror}"
        if exc.strerror or str(exc):
            return " ".join((exc.strerror or str(exc)).split())
        return None
    if _is_library_input_error(exc):
        return " ".join(str(exc).split()) or type(exc).__name__
    return None


def fail(command: str, exc: BaseException) -> int:
    """Print `exc` as `llmopt COMMAND: error: ...` (input errors) or as a bug with its
    traceback; the exit status. The torchrun workers of train and distill use it too."""
    message = error_message(exc)
    if message is None:
        report_bug(command, exc)
        return EXIT_BUG
    print(f"llmopt {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def report_bug(command: str, exc: BaseException) -> None:
    """An exception no input check produced: the traceback, and where to report it."""
    import traceback

    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(
        f"llmopt {command}: internal error: {type(exc).__name__} is a bug in llmopt, not a "
        "problem with your input; please report it on the llmopt issue tracker with the "
        "command line and the traceback above",
        file=sys.stderr,
    )


def _is_library_input_error(exc: BaseException) -> bool:
    """safetensors' and jinja's errors are about the user's file or template, not our code."""
    kind = type(exc)
    module = kind.__module__ or ""
    return kind.__name__ == "SafetensorError" or module.startswith("jinja2")


def _silence_stdout() -> None:
    # point stdout at /dev/null so the interpreter's final flush does not fail again
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout replaced by an object without a descriptor
        pass


if __name__ == "__main__":
    sys.exit(main())
