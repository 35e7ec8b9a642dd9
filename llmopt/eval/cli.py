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
from llmopt.dtypes import torch_dtype
from llmopt.errors import UsageError
from llmopt.infer.cli import add_model_arguments, check_model_args

DEFAULT_TEXT = "corpus:web-bible"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="perplexity and KL-divergence evaluation on real text",
        description="Evaluate a model on one or more texts (--text repeats; the model loads "
        "once): `ppl` (sliding-window perplexity, HF convention), `kl` (KL divergence from a "
        "reference model, llama.cpp's statistics) or `gate` (pass/fail on those statistics).",
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
    cli_args.add_dtype(kl, "--ref-dtype", help="dtype of the reference model")
    kl.set_defaults(func=run_kl, check=check_args)
    gate = sub.add_parser(
        "gate",
        help="pass/fail --model against --ref on KL, perplexity increase and top-1",
        description="Accuracy gates before deployment: exits 1 with a one-line reason naming each "
        "failed gate and its value (and its text, with several --text), 0 when all pass on every "
        "text (statistics as in `kl`).",
    )
    _common(gate, default_ctx=512)
    gate.add_argument("--ref", required=True, help="reference model (same tokenizer)")
    cli_args.add_dtype(gate, "--ref-dtype", help="dtype of the reference model")
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
        action="append",
        default=None,
        help="UTF-8 text file or corpus:NAME, repeatable: each text is evaluated and reported "
        f"(default {DEFAULT_TEXT}, the World English Bible)",
    )
    parser.add_argument("--ctx", type=int, default=default_ctx, help="window length in tokens")
    parser.add_argument("--stride", type=int, default=None, help="window step (default ctx/2)")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="evaluate the first N tokens of each text"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def check_args(args: argparse.Namespace) -> None:
    """What `eval` can refuse before loading: `--stride 0` is not "the default stride", a
    missing file or an unknown corpus among the texts, the same text twice."""
    from llmopt.data.corpus import CORPORA
    from llmopt.eval.multi_text import check_text_specs

    check_model_args(args)
    args.text = text_specs(args)
    for spec in args.text:  # each text checked as the single --text always was
        one = argparse.Namespace(text=spec)
        cli_args.text(one, "text")
        if not spec.startswith("corpus:"):
            cli_args.text_file(one, "text")
        elif spec.removeprefix("corpus:") not in CORPORA:
            raise cli_args.ArgumentError(
                f"--text {spec}: unknown corpus; known corpora: {', '.join(CORPORA)}"
            )
    check_text_specs(args.text, "--text")
    cli_args.text(args, "ref")
    cli_args.integer(args, "ctx", 2)
    cli_args.integer(args, "stride", 1, args.ctx)
    cli_args.integer(args, "max_tokens", 2)
    cli_args.number(args, "max_kl", 0.0)
    cli_args.number(args, "max_ppl_increase", 0.0)
    cli_args.number(args, "min_top1", 0.0, 1.0)


def text_specs(args: argparse.Namespace) -> list[str]:
    """The --text values in order (the default when none was given; a lone string as one)."""
    texts = getattr(args, "text", None)
    if texts is None:
        return [DEFAULT_TEXT]
    return [texts] if isinstance(texts, str) else list(texts)


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


@contextmanager
def _progress(enabled: bool, metric: str):
    """A rich progress bar on stderr fed `(text label, done, total)`, or a no-op (None)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tokens"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(metric, total=None)

        def update(label: str, done: int, total: int) -> None:
            bar.update(task, description=f"{metric} {label}", completed=done, total=total)

        yield update


def _setup(args: argparse.Namespace, with_ref: bool = False):
    """Tokenizers, then every text's tokens, then the model(s): a bad text or a vocabulary
    mismatch is refused before any weights load."""
    import torch

    from llmopt.eval.multi_text import load_texts
    from llmopt.models.loading import load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    if with_ref:
        ref_tokenizer = load_tokenizer(args.ref)
        if ref_tokenizer.vocab_size != tokenizer.vocab_size:
            raise UsageError(
                f"--ref {args.ref} has a {ref_tokenizer.vocab_size}-token vocabulary, --model "
                f"{args.model} {tokenizer.vocab_size}; KL needs the same tokenizer"
            )
    texts = load_texts(tokenizer, text_specs(args), args.max_tokens, "--text")
    model = load_model(args.model, dtype=torch_dtype(args.dtype))
    ref = load_model(args.ref, dtype=torch_dtype(args.ref_dtype)) if with_ref else None
    stride = args.stride or max(1, args.ctx // 2)
    return texts, model, ref, stride


def _print_json(head: dict, per_text: list[dict]) -> None:
    """One text: its object as it always was; several: `head` (the model, the reference, the
    verdict) with the per-text objects, each as a run on that text alone prints it, as
    `results`."""
    payload = per_text[0] if len(per_text) == 1 else {**head, "results": per_text}
    print(jsonout.dumps(payload, indent=2))


def run_ppl(args: argparse.Namespace) -> int:
    from llmopt.eval.multi_text import perplexity_texts

    texts, model, _, stride = _setup(args)
    with _progress(not args.json and sys.stderr.isatty(), "perplexity") as progress:
        results = perplexity_texts(model, texts, ctx=args.ctx, stride=stride, progress=progress)
    if args.json:
        per_text = [
            {"model": args.model, "text": label, "dtype": args.dtype, "ctx": args.ctx}
            | {"stride": stride, **dataclasses.asdict(r)}
            for label, r in results.items()
        ]
        _print_json({"model": args.model}, per_text)
        return 0
    for label, r in results.items():
        print(
            f"{label}: perplexity {r.ppl:.4f} (nll {r.nll:.4f} nats/token) over "
            f"{r.tokens_scored} tokens, ctx {args.ctx}, stride {stride}, "
            f"{r.tokens_per_s:.0f} tokens/s"
        )
    return 0


def _pair_head(args: argparse.Namespace, text: str, stride: int) -> dict:
    return {"model": args.model, "ref": args.ref, "text": text, "ctx": args.ctx, "stride": stride}


def run_gate(args: argparse.Namespace) -> int:
    from llmopt.eval.gate import GateThresholds
    from llmopt.eval.multi_text import gate_texts

    thresholds = GateThresholds(
        max_kl=args.max_kl, max_ppl_increase_pct=args.max_ppl_increase, min_top1=args.min_top1
    )
    texts, model, ref, stride = _setup(args, with_ref=True)
    with _progress(not args.json and sys.stderr.isatty(), "accuracy gates") as progress:
        report = gate_texts(
            model, ref, texts, thresholds, ctx=args.ctx, stride=stride, progress=progress
        )
    if args.json:
        head = {"model": args.model, "ref": args.ref, "passed": report.passed}
        head["reason"] = report.reason()
        per_text = [
            {**_pair_head(args, label, stride), **r.to_dict()}
            for label, r in report.reports.items()
        ]
        _print_json(head, per_text)
    if not report.passed:
        print(f"llmopt eval gate: {report.reason()}", file=sys.stderr)
    elif not args.json:
        print(f"llmopt eval gate: {report.reason()}")
    return 0 if report.passed else 1


def run_kl(args: argparse.Namespace) -> int:
    from llmopt.eval.multi_text import kl_texts

    texts, model, ref, stride = _setup(args, with_ref=True)
    with _progress(not args.json and sys.stderr.isatty(), "KL divergence") as progress:
        results = kl_texts(model, ref, texts, ctx=args.ctx, stride=stride, progress=progress)
    if args.json:
        per_text = [
            {**_pair_head(args, label, stride), **dataclasses.asdict(r)}
            for label, r in results.items()
        ]
        _print_json({"model": args.model, "ref": args.ref}, per_text)
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KL({args.ref} || {args.model}), ctx {args.ctx}, stride {stride}")
    table.add_column("statistic")
    for label in results:
        table.add_column(label, justify="right", overflow="fold")  # a long path wraps, whole
    rows = [
        ("tokens", lambda r: f"{r.tokens}"),
        ("mean KL (nats)", lambda r: f"{r.mean:.6f}"),
        ("median KL", lambda r: f"{r.median:.6f}"),
        ("p99 KL", lambda r: f"{r.p99:.6f}"),
        ("top-1 agreement", lambda r: f"{100 * r.top1_agreement:.2f}%"),
        ("RMS Δp", lambda r: f"{100 * r.rms_delta_p:.3f}%"),
        ("ppl (model)", lambda r: f"{r.ppl:.4f}"),
        ("ppl (ref)", lambda r: f"{r.ref_ppl:.4f}"),
    ]
    for name, cell in rows:
        table.add_row(name, *(cell(r) for r in results.values()))
    Console().print(table)
    return 0
