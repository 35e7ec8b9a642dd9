"""`llmopt eval ppl|kl|gate`: perplexity, KL divergence and accuracy gates on real text.

A thin layer over `llmopt.eval.perplexity`, `llmopt.eval.kl` and `llmopt.eval.gate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from contextlib import contextmanager

from llmopt import cli_args, jsonout
from llmopt.infer.cli import add_model_arguments, check_model_args, torch_dtype


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="perplexity and KL-divergence evaluation on real text",
        description="Evaluate a model on text: `ppl` (sliding-window perplexity, HF convention) "
        "or `kl` (KL divergence from a reference model, llama.cpp's statistics).",
    )
    sub = parser.add_subparsers(dest="metric", metavar="METRIC", required=True)
    ppl = sub.add_parser(
        "ppl",
        help="sliding-window perplexity",
        description="Windows of --ctx tokens every --stride tokens; each token after the first "
        "is scored once, with at least ctx - stride tokens of context (HF's convention).",
    )
    _common(ppl, default_ctx=1024)
    ppl.set_defaults(func=run_ppl, check=check_args)
    kl = sub.add_parser(
        "kl",
        help="KL divergence of --model from --ref",
        description="Per-token KL(ref || model) over the same windows as `ppl`: mean, median, "
        "p99, top-1 agreement and RMS change of the next token's probability (Δp).",
    )
    _common(kl, default_ctx=512)
    kl.add_argument("--ref", required=True, help="reference model (same tokenizer)")
    kl.add_argument("--ref-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    kl.set_defaults(func=run_kl, check=check_args)
    gate = sub.add_parser(
        "gate",
        help="pass/fail --model against --ref on KL, perplexity increase and top-1",
        description="Accuracy gates before deployment: exits 1 with a one-line reason naming each "
        "failed gate and its value, 0 when all pass (statistics as in `kl`).",
    )
    _common(gate, default_ctx=512)
    gate.add_argument("--ref", required=True, help="reference model (same tokenizer)")
    gate.add_argument("--ref-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    gate.add_argument("--max-kl", type=_number, default=None, help="max mean KL in nats")
    gate.add_argument(
        "--max-ppl-increase",
        type=_percent,
        default=None,
        help="max perplexity increase over --ref in percent (5 or 5%%)",
    )
    gate.add_argument(
        "--min-top1",
        type=_fraction,
        default=None,
        help="min top-1 agreement, a fraction (0.9) or a percent (90%%)",
    )
    gate.set_defaults(func=run_gate, check=check_args)


def _common(parser: argparse.ArgumentParser, default_ctx: int) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--text",
        default="corpus:web-bible",
        help="UTF-8 text file or corpus:NAME (default corpus:web-bible, the World English Bible)",
    )
    parser.add_argument("--ctx", type=int, default=default_ctx, help="window length in tokens")
    parser.add_argument("--stride", type=int, default=None, help="window step (default ctx/2)")
    parser.add_argument("--max-tokens", type=int, default=None, help="evaluate the first N tokens")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def check_args(args: argparse.Namespace) -> None:
    """What `eval` can refuse before loading: `--stride 0` is not "the default stride"."""
    check_model_args(args)
    cli_args.text(args, "text")
    if not args.text.startswith("corpus:"):  # before the tokenizer and model load
        cli_args.text_file(args, "text")
    cli_args.text(args, "ref")
    cli_args.integer(args, "ctx", 2)
    cli_args.integer(args, "stride", 1, args.ctx)
    cli_args.integer(args, "max_tokens", 2)
    cli_args.number(args, "max_kl", 0.0)
    cli_args.number(args, "max_ppl_increase", 0.0)
    cli_args.number(args, "min_top1", 0.0, 1.0)


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be finite")
    return value


def _percent(text: str) -> float:
    return _number(text.strip().removesuffix("%"))


def _fraction(text: str) -> float:
    text = text.strip()
    return _percent(text) / 100.0 if text.endswith("%") else _number(text)


def load_tokens(tokenizer, text_spec: str, max_tokens: int | None) -> list[int]:
    """Token ids of a text, tokenising only about as much text as `max_tokens` needs."""
    from llmopt.data.corpus import load_text

    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"--max-tokens {max_tokens} must be >= 2")
    max_chars = None if max_tokens is None else max_tokens * 16
    while True:
        text = load_text(text_spec, max_chars=max_chars)
        ids = tokenizer.encode(text, add_bos=tokenizer.add_bos)
        if (
            max_tokens is None
            or len(ids) >= max_tokens
            or max_chars is None
            or len(text) < max_chars
        ):
            return ids if max_tokens is None else ids[:max_tokens]
        max_chars *= 4


@contextmanager
def _progress(enabled: bool, label: str):
    """A rich progress bar on stderr, or a no-op callback."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn(label),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tokens"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _setup(args: argparse.Namespace):
    import torch

    from llmopt.models.loading import load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    tokens = load_tokens(tokenizer, args.text, args.max_tokens)
    model = load_model(args.model, dtype=torch_dtype(args.dtype))
    stride = args.stride or max(1, args.ctx // 2)
    return tokenizer, tokens, model, stride


def run_ppl(args: argparse.Namespace) -> int:
    from llmopt.eval.perplexity import perplexity

    _, tokens, model, stride = _setup(args)
    with _progress(not args.json and sys.stderr.isatty(), "perplexity") as progress:
        result = perplexity(model, tokens, ctx=args.ctx, stride=stride, progress=progress)
    summary = {
        "model": args.model,
        "text": args.text,
        "dtype": args.dtype,
        "ctx": args.ctx,
        "stride": stride,
        **dataclasses.asdict(result),
    }
    if args.json:
        print(jsonout.dumps(summary, indent=2))
    else:
        print(
            f"perplexity {result.ppl:.4f} (nll {result.nll:.4f} nats/token) over "
            f"{result.tokens_scored} tokens, ctx {args.ctx}, stride {stride}, "
            f"{result.tokens_per_s:.0f} tokens/s"
        )
    return 0


def _setup_pair(args: argparse.Namespace):
    from llmopt.models.loading import load_model, load_tokenizer

    tokenizer, tokens, model, stride = _setup(args)
    ref_tokenizer = load_tokenizer(args.ref)
    if ref_tokenizer.vocab_size != tokenizer.vocab_size:
        raise ValueError(
            f"--ref {args.ref} has a {ref_tokenizer.vocab_size}-token vocabulary, --model "
            f"{args.model} {tokenizer.vocab_size}; KL needs the same tokenizer"
        )
    ref = load_model(args.ref, dtype=torch_dtype(args.ref_dtype))
    return tokens, model, ref, stride


def run_gate(args: argparse.Namespace) -> int:
    from llmopt.eval.gate import GateThresholds, run_gates

    thresholds = GateThresholds(
        max_kl=args.max_kl, max_ppl_increase_pct=args.max_ppl_increase, min_top1=args.min_top1
    )
    tokens, model, ref, stride = _setup_pair(args)
    with _progress(not args.json and sys.stderr.isatty(), "accuracy gates") as progress:
        report = run_gates(
            model, ref, tokens, thresholds, ctx=args.ctx, stride=stride, progress=progress
        )
    if args.json:
        summary = {"model": args.model, "ref": args.ref, "text": args.text, "ctx": args.ctx}
        print(jsonout.dumps({**summary, "stride": stride, **report.to_dict()}, indent=2))
    if not report.passed:
        print(f"llmopt eval gate: {report.reason()}", file=sys.stderr)
    elif not args.json:
        print(f"llmopt eval gate: {report.reason()}")
    return 0 if report.passed else 1


def run_kl(args: argparse.Namespace) -> int:
    from llmopt.eval.kl import kl_divergence

    tokens, model, ref, stride = _setup_pair(args)
    with _progress(not args.json and sys.stderr.isatty(), "KL divergence") as progress:
        result = kl_divergence(model, ref, tokens, ctx=args.ctx, stride=stride, progress=progress)
    summary = {
        "model": args.model,
        "ref": args.ref,
        "text": args.text,
        "ctx": args.ctx,
        "stride": stride,
        **dataclasses.asdict(result),
    }
    if args.json:
        print(jsonout.dumps(summary, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KL({args.ref} || {args.model}) over {result.tokens} tokens")
    table.add_column("statistic")
    table.add_column("value", justify="right")
    for name, value in [
        ("mean KL (nats)", f"{result.mean:.6f}"),
        ("median KL", f"{result.median:.6f}"),
        ("p99 KL", f"{result.p99:.6f}"),
        ("top-1 agreement", f"{100 * result.top1_agreement:.2f}%"),
        ("RMS Δp", f"{100 * result.rms_delta_p:.3f}%"),
        ("ppl (model)", f"{result.ppl:.4f}"),
        ("ppl (ref)", f"{result.ref_ppl:.4f}"),
    ]:
        table.add_row(name, value)
    Console().print(table)
    return 0
