"""Evaluation on several texts at once: the models load once, each text is scored in turn.

A compressed model can hold its perplexity on its calibration text and lose it elsewhere, so
one number on one text says little about deployment. This module tokenises a list of text
specs (`corpus:NAME` or UTF-8 files; `llmopt.data.corpus`) and runs the single-text
evaluations (`perplexity`, `kl_divergence`, the gates) on each token list, keyed by the spec
as given, so every per-text result is exactly what a run on that text alone gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmopt.errors import LlmoptError
from llmopt.eval.gate import GateReport, GateThresholds, apply_gates
from llmopt.eval.kl import KLResult, kl_divergence
from llmopt.eval.perplexity import PerplexityResult, perplexity

# progress(text label, tokens done, tokens in all), called after each window
TextProgress = Callable[[str, int, int], None]


class TextSpecError(LlmoptError, ValueError):
    """A list of text specs that cannot be evaluated (empty, a duplicate, a too-short text)."""


def check_text_specs(specs: Sequence[str], what: str = "text") -> None:
    """Refuse no text, and the same text twice: the same spec, or the same file by two paths
    (`a.txt` and `./a.txt`), which would report one text as two. `what` names the texts in
    the message (the CLI passes its flag)."""
    if not specs:
        raise TextSpecError("no text given: name at least one file or corpus:NAME")
    seen: dict[str, str] = {}
    for spec in specs:
        key = spec if spec.startswith("corpus:") else str(Path(spec).resolve())
        if key in seen:
            first = seen[key]
            detail = "given twice" if first == spec else f"is the same file as {first}"
            raise TextSpecError(f"{what} {spec} {detail}; name each text once")
        seen[key] = spec


def load_tokens(tokenizer, text_spec: str, max_tokens: int | None) -> list[int]:
    """Token ids of a text, tokenising only about as much text as `max_tokens` needs."""
    from llmopt.data.corpus import load_text

    if max_tokens is not None and max_tokens < 2:
        raise TextSpecError(f"--max-tokens {max_tokens} must be >= 2")
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


def load_texts(
    tokenizer, specs: Sequence[str], max_tokens: int | None, what: str = "text"
) -> dict[str, list[int]]:
    """Token ids of each text (the first `max_tokens` of each), in the order given; a text
    too short to score is refused here, before any model runs."""
    check_text_specs(specs, what)
    texts = {}
    for spec in specs:
        ids = load_tokens(tokenizer, spec, max_tokens)
        if len(ids) < 2:
            raise TextSpecError(f"{what} {spec} has {len(ids)} token(s); scoring needs at least 2")
        texts[spec] = ids
    return texts


def _labelled(progress: TextProgress | None, label: str) -> Callable[[int, int], None] | None:
    if progress is None:
        return None
    return lambda done, total: progress(label, done, total)


def perplexity_texts(
    model,
    texts: Mapping[str, Sequence[int]],
    *,
    ctx: int = 1024,
    stride: int | None = None,
    progress: TextProgress | None = None,
) -> dict[str, PerplexityResult]:
    """`perplexity` of `model` on each token list (stride defaults to ctx // 2)."""
    stride = stride or max(1, ctx // 2)
    return {
        label: perplexity(model, ids, ctx=ctx, stride=stride, progress=_labelled(progress, label))
        for label, ids in texts.items()
    }


def kl_texts(
    model,
    ref_model,
    texts: Mapping[str, Sequence[int]],
    *,
    ctx: int = 512,
    stride: int | None = None,
    progress: TextProgress | None = None,
) -> dict[str, KLResult]:
    """`kl_divergence` of `model` from `ref_model` on each token list."""
    stride = stride or max(1, ctx // 2)
    return {
        label: kl_divergence(
            model, ref_model, ids, ctx=ctx, stride=stride, progress=_labelled(progress, label)
        )
        for label, ids in texts.items()
    }


@dataclass(frozen=True)
class TextsGateReport:
    """The gates judged on every text; passes only when every text passes."""

    reports: Mapping[str, GateReport]  # text label -> its report, in the order evaluated

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.reports.values())

    @property
    def failed(self) -> tuple[str, ...]:
        """Labels of the texts on which some gate failed."""
        return tuple(label for label, r in self.reports.items() if not r.passed)

    def reason(self) -> str:
        """One line. A single text reads as `GateReport.reason`; several name each text (the
        failed ones, each with its failed gates and values, or all of them when all pass)."""
        if len(self.reports) == 1:
            return next(iter(self.reports.values())).reason()
        n = len(self.reports)
        if self.passed:
            per_text = [f"{label}: {_gates(r, failed=False)}" for label, r in self.reports.items()]
            return f"all gates passed on {n} texts: " + " | ".join(per_text)
        per_text = [f"{label}: {_gates(self.reports[label], True)}" for label in self.failed]
        return f"gate failed on {len(self.failed)} of {n} texts: " + " | ".join(per_text)


def _gates(report: GateReport, failed: bool) -> str:
    return "; ".join(g.describe() for g in (report.failed if failed else report.gates))


def gate_texts(
    model,
    ref_model,
    texts: Mapping[str, Sequence[int]],
    thresholds: GateThresholds,
    *,
    ctx: int = 512,
    stride: int | None = None,
    progress: TextProgress | None = None,
) -> TextsGateReport:
    """The gates of `thresholds` on each text's KL statistics (every text is evaluated, so
    the report names every failing one)."""
    results = kl_texts(model, ref_model, texts, ctx=ctx, stride=stride, progress=progress)
    return TextsGateReport({label: apply_gates(r, thresholds) for label, r in results.items()})
