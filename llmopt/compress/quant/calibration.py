"""Calibration batches: seeded token windows from a weighted mix of real text sources.

Each source contributes windows in proportion to its weight (`llmopt.data.mix`), drawn
from the second half of its text: evaluation (benchmarks, `eval ppl`) reads corpora from
their beginning, so a method is never scored on text it was calibrated on. The rows are
shuffled (seeded) so that any prefix of them (AWQ scores its α grid on the first few)
still mixes the sources. `CalibrationSet.coverage` says what was drawn, and warns when it
is narrow: one source calibrates for one domain only (issue 19).
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from llmopt.data.corpus import load_text
from llmopt.data.mix import DEFAULT_MIX, allocate, format_mix, parse_mix
from llmopt.errors import UsageError

CALIB_START_FRACTION = 0.5
MIN_CALIB_TOKENS = 4096
_CHARS_PER_WINDOW_TOKEN = 10  # ~4.5 chars/token in English: about 2x more windows than drawn


@dataclass(frozen=True)
class CalibrationSet:
    tokens: torch.Tensor  # [n_samples, seq_len] int64, rows shuffled across sources
    sources: list[dict[str, Any]]  # per source: source, weight, samples, tokens
    warnings: list[str] = field(default_factory=list)

    @property
    def coverage(self) -> dict[str, Any]:
        return {
            "tokens": int(self.tokens.numel()),
            "samples": int(self.tokens.shape[0]),
            "seq_len": int(self.tokens.shape[1]),
            "sources": self.sources,
            "warnings": self.warnings,
        }


def describe_coverage(coverage: dict[str, Any]) -> str:
    """`8192 (web-bible 2048, py-docs 2048, ...)`: what a CLI prints as calibration tokens."""
    drawn = ", ".join(
        f"{s['source'].removeprefix('corpus:')} {s['tokens']}" for s in coverage["sources"]
    )
    return f"{coverage['tokens']} ({drawn})"


def calibration_set(
    tokenizer,
    spec: str = DEFAULT_MIX,
    n_samples: int = 16,
    seq_len: int = 512,
    seed: int = 0,
) -> CalibrationSet:
    """Windows from every source of the mix `spec`, with the coverage they give."""
    if n_samples < 1 or seq_len < 2:
        raise UsageError(f"need n_samples >= 1 and seq_len >= 2; got {n_samples}, {seq_len}")
    parts = parse_mix(spec)
    counts = allocate(parts, n_samples)
    rows, sources = [], []
    for part, count in zip(parts, counts, strict=True):
        source_seed = seed + zlib.crc32(part.source.encode())  # independent of mix order
        rows.append(_source_windows(tokenizer, part.source, count, seq_len, source_seed))
        sources.append(
            {
                "source": part.source,
                "weight": round(part.weight, 4),
                "samples": count,
                "tokens": count * seq_len,
            }
        )
    tokens = torch.cat(rows)
    order = torch.randperm(tokens.shape[0], generator=torch.Generator().manual_seed(seed))
    warnings = []
    if len(parts) == 1:
        warnings.append(
            f"calibration draws from one source ({parts[0].source}): quality out of that "
            f"domain may fall below RTN; the default mix is {DEFAULT_MIX}"
        )
    if tokens.numel() < MIN_CALIB_TOKENS:
        warnings.append(
            f"calibration has {tokens.numel()} tokens (< {MIN_CALIB_TOKENS}): "
            "Hessians and activation statistics this small are noisy"
        )
    return CalibrationSet(tokens[order], sources, warnings)


def check_calibration_tokens(
    calib_tokens: torch.Tensor | None, method: str, error: type[Exception] = UsageError
) -> None:
    """Refuse missing or malformed calibration tokens for a method that needs them (AWQ, GPTQ,
    SparseGPT, Wanda), before any work."""
    if calib_tokens is None:
        raise error(
            f"method {method!r} needs calibration tokens: pass calib_tokens=[n, T] "
            "(llmopt.compress.quant.calibration.calibration_tokens builds them)"
        )
    if calib_tokens.dim() != 2 or calib_tokens.dtype != torch.long:
        raise error(
            f"calib_tokens must be a [n, T] int64 tensor, got {tuple(calib_tokens.shape)} "
            f"{calib_tokens.dtype}"
        )


def calibration_tokens(
    tokenizer,
    spec: str = DEFAULT_MIX,
    n_samples: int = 16,
    seq_len: int = 512,
    seed: int = 0,
) -> torch.Tensor:
    """[n_samples, seq_len] token ids of `calibration_set` (for callers needing ids only)."""
    return calibration_set(tokenizer, spec, n_samples, seq_len, seed).tokens


class CalibratedConfig(Protocol):
    """What `config_calibration` reads: a QuantConfig's or a PruneConfig's calibration."""

    calib: str
    calib_samples: int
    calib_seq_len: int
    calib_seed: int

    @property
    def needs_calibration(self) -> bool: ...


def config_calibration(tokenizer, config: CalibratedConfig) -> CalibrationSet | None:
    """The calibration set `config` asks for (None when its method needs none): what
    `llmopt quantize`, `llmopt prune` and a recipe's stages all draw."""
    if not config.needs_calibration:
        return None
    return calibration_set(
        tokenizer, config.calib, config.calib_samples, config.calib_seq_len, config.calib_seed
    )


def command_calibration(
    tokenizer, config: CalibratedConfig
) -> tuple[torch.Tensor | None, dict[str, Any] | None]:
    """(tokens, coverage) for a command's run, its narrow-coverage warnings on stderr."""
    drawn = config_calibration(tokenizer, config)
    if drawn is None:
        return None, None
    for warning in drawn.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return drawn.tokens, drawn.coverage


def _source_windows(tokenizer, source: str, n: int, seq_len: int, seed: int) -> torch.Tensor:
    text = load_text(source)
    start = int(len(text) * CALIB_START_FRACTION)
    # tokenize only what the windows need (tokenizing megabytes costs seconds)
    chars = n * seq_len * _CHARS_PER_WINDOW_TOKEN
    while True:
        ids = torch.tensor(tokenizer.encode(text[start : start + chars]), dtype=torch.long)
        if ids.numel() // seq_len >= n or start + chars >= len(text):
            try:
                return windows(ids, n, seq_len, seed)
            except ValueError as err:
                raise UsageError(f"calibration source {source}: {err}") from None
        chars *= 2


def windows(ids: torch.Tensor, n_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """n random (seeded) non-overlapping windows of seq_len from a 1-D id tensor."""
    slots = ids.numel() // seq_len
    if slots < n_samples:
        raise UsageError(
            f"calibration text has {ids.numel()} tokens: too few for {n_samples} x {seq_len}"
        )
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(slots, generator=gen)[:n_samples].sort().values
    return torch.stack([ids[i * seq_len : (i + 1) * seq_len] for i in chosen.tolist()])


__all__ = [
    "CalibrationSet",
    "calibration_set",
    "calibration_tokens",
    "command_calibration",
    "config_calibration",
    "format_mix",
    "windows",
]
