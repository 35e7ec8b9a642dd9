"""Weighted mixes of text sources: `corpus:a=0.5,corpus:b=0.25,notes.txt=0.25`.

A calibration set drawn from one source teaches AWQ and GPTQ that source's activation
statistics only; a mix of kinds of English (narrative, technical prose, API docs, code
comments) keeps them valid out of domain (docs/benchmarks/quant.md, issue 19).

Syntax: comma-separated `SOURCE[=WEIGHT]`, SOURCE a `corpus:NAME` or a UTF-8 file path,
WEIGHT a positive finite number (missing: 1). Weights are normalised. `mix:default` names
`DEFAULT_MIX`. Evaluation-only corpora (`corpus.EVAL_ONLY`) are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmopt.data.corpus import EVAL_ONLY, CorpusError

# prose carries half the weight and the three kinds of technical text the other half: with
# equal shares GPTQ lost 3-6% in domain, with these 0-2%, keeping its out-of-domain gains
# (docs/benchmarks/quant.md); 16 windows split 7 / 3 / 3 / 3
DEFAULT_MIX = "corpus:web-bible=3,corpus:py-docs=1,corpus:stdlib-docs=1,corpus:stdlib-comments=1"
NAMED_MIXES = {"mix:default": DEFAULT_MIX}


class MixError(CorpusError):
    """A `--calib` mix that cannot be parsed or used."""


@dataclass(frozen=True)
class MixPart:
    source: str
    weight: float  # normalised: the parts of a mix sum to 1


def parse_mix(text: str) -> tuple[MixPart, ...]:
    """Parse and validate a mix; one-line errors name the bad part and the syntax."""
    text = NAMED_MIXES.get(text.strip(), text)
    if not text.strip():
        raise MixError("empty --calib; give SOURCE[=WEIGHT],... e.g. " + DEFAULT_MIX)
    raw: list[tuple[str, float]] = []
    for part in text.split(","):
        part = part.strip()
        source, sep, weight_text = part.rpartition("=")
        if not sep:
            source, weight = part, 1.0
        else:
            try:
                weight = float(weight_text)
            except ValueError:
                raise MixError(
                    f"--calib part {part!r}: weight {weight_text!r} is not a number "
                    "(syntax SOURCE[=WEIGHT],...)"
                ) from None
        if not source:
            raise MixError(f"--calib part {part!r} names no source (syntax SOURCE[=WEIGHT],...)")
        if not math.isfinite(weight) or weight <= 0:
            raise MixError(f"--calib part {part!r}: weight must be a positive finite number")
        name = source.removeprefix("corpus:")
        if source.startswith("corpus:") and name in EVAL_ONLY:
            raise MixError(
                f"--calib part {part!r}: corpus {name!r} is reserved for out-of-domain "
                f"evaluation ({', '.join(sorted(EVAL_ONLY))})"
            )
        if source in (s for s, _ in raw):
            raise MixError(f"--calib names {source!r} twice")
        raw.append((source, weight))
    total = sum(w for _, w in raw)
    return tuple(MixPart(s, w / total) for s, w in raw)


def allocate(parts: tuple[MixPart, ...], n_samples: int) -> list[int]:
    """Samples per part, proportional to weight (largest remainder), at least 1 each."""
    if n_samples < len(parts):
        raise MixError(
            f"{n_samples} calibration samples cannot cover {len(parts)} sources; "
            f"use at least {len(parts)} samples or fewer sources"
        )
    spare = n_samples - len(parts)
    exact = [p.weight * spare for p in parts]
    counts = [1 + math.floor(e) for e in exact]
    by_remainder = sorted(range(len(parts)), key=lambda i: (-(exact[i] % 1), i))
    for i in by_remainder[: n_samples - sum(counts)]:
        counts[i] += 1
    return counts


def format_mix(parts: tuple[MixPart, ...]) -> str:
    """The canonical text of a parsed mix (what reports and saved configs record)."""
    return ",".join(f"{p.source}={p.weight:.4g}" for p in parts)
