"""What to prune and how: the sparsity target ("0.5" unstructured, "2:4" N:M) and the method's
options, parsed and validated once so a bad value fails before minutes of calibration.

N:M means N weights are *kept* in every group of M consecutive weights along a row's input
dimension (the layout 2:4 tensor cores and `torch.sparse.to_sparse_semi_structured` need).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llmopt.config_files import FLOAT, STR, check_fields, dataclass_schema
from llmopt.errors import LlmoptError

METHODS = ("magnitude", "wanda", "sparsegpt")


class PruneConfigError(LlmoptError, ValueError):
    """A sparsity target, method or option that cannot be used."""


@dataclass(frozen=True)
class Sparsity:
    """Either an unstructured fraction (n = m = 0) or an N:M pattern (fraction = 1 - n/m)."""

    fraction: float
    n: int = 0
    m: int = 0

    def __post_init__(self) -> None:
        if self.m:
            if not 1 <= self.n < self.m:
                raise PruneConfigError(
                    f"N:M sparsity {self.n}:{self.m} needs 1 <= N < M (N weights kept of M)"
                )
            if self.m > 256:
                raise PruneConfigError(f"N:M sparsity {self.n}:{self.m}: M must be <= 256")
        elif not (math.isfinite(self.fraction) and 0.0 < self.fraction < 1.0):
            raise PruneConfigError(
                f"sparsity {self.fraction!r} must be a fraction strictly between 0 and 1 "
                "(e.g. 0.5) or an N:M pattern (e.g. 2:4)"
            )

    @classmethod
    def nm(cls, n: int, m: int) -> Sparsity:
        if not (isinstance(n, int) and isinstance(m, int)) or not 1 <= n < m:
            raise PruneConfigError(f"N:M sparsity {n}:{m} needs integers with 1 <= N < M")
        return cls(1.0 - n / m, n, m)

    @classmethod
    def parse(cls, text: str | float) -> Sparsity:
        """'0.5' -> 50% unstructured; '2:4' -> 2 of every 4 kept. Anything else is refused."""
        if isinstance(text, float | int) and not isinstance(text, bool):
            return cls(float(text))
        raw = str(text).strip()
        if ":" in raw:
            left, _, right = raw.partition(":")
            if not (left.isdigit() and right.isdigit()):
                raise PruneConfigError(
                    f"malformed N:M sparsity {raw!r}: expected two integers like 2:4 or 4:8"
                )
            return cls.nm(int(left), int(right))
        try:
            value = float(raw)
        except ValueError:
            raise PruneConfigError(
                f"sparsity {raw!r} is neither a fraction in (0, 1) such as 0.5 nor an N:M "
                "pattern such as 2:4"
            ) from None
        return cls(value)

    @property
    def structured(self) -> bool:
        return self.m > 0

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.structured else f"{self.fraction:g}"

    def to_dict(self) -> dict[str, float | int]:
        return {"fraction": self.fraction, "n": self.n, "m": self.m}

    @classmethod
    def from_dict(cls, data: dict) -> Sparsity:
        if data.get("m"):
            return cls.nm(int(data["n"]), int(data["m"]))
        return cls(float(data["fraction"]))


def check_nm_shape(in_features: int, m: int) -> None:
    if in_features % m:
        raise PruneConfigError(
            f"N:M sparsity with M={m} needs the input width to be a multiple of {m}; "
            f"a layer has {in_features} inputs"
        )


def check_method(method: str) -> str:
    if method not in METHODS:
        raise PruneConfigError(
            f"unknown pruning method {method!r}; choose from {', '.join(METHODS)}"
        )
    return method


@dataclass(frozen=True)
class PruneConfig:
    """A pruning run. Calibration (Wanda, SparseGPT) uses `calib_tokens` tokens of `calib` in
    windows of `calib_seq_len`; `damp` (fraction of the mean Hessian diagonal added to it) and
    `block_size` (columns per lazy update) are SparseGPT's."""

    method: str = "sparsegpt"
    sparsity: Sparsity = field(default_factory=lambda: Sparsity(0.5))
    calib: str = "mix:default"  # llmopt.data.mix: Bible-only loses out of domain (issue 19)
    calib_tokens: int = 8192
    calib_seq_len: int = 512
    calib_seed: int = 0
    damp: float = 0.01
    block_size: int = 128

    def __post_init__(self) -> None:
        check_method(self.method)
        if not isinstance(self.sparsity, Sparsity):
            object.__setattr__(self, "sparsity", Sparsity.parse(self.sparsity))
        if not (math.isfinite(self.damp) and 0.0 <= self.damp <= 1.0):
            raise PruneConfigError(f"damp={self.damp!r} must be a finite fraction in [0, 1]")
        if self.block_size < 1:
            raise PruneConfigError(f"block_size={self.block_size} must be >= 1")
        if self.calib_seq_len < 2:
            raise PruneConfigError(f"calib_seq_len={self.calib_seq_len} must be >= 2")
        if self.calib_tokens < self.calib_seq_len:
            raise PruneConfigError(
                f"calib_tokens={self.calib_tokens} must be at least one window of "
                f"calib_seq_len={self.calib_seq_len} tokens"
            )

    @property
    def needs_calibration(self) -> bool:
        return self.method != "magnitude"

    @property
    def calib_samples(self) -> int:
        """Whole windows of calib_seq_len covering calib_tokens (rounded down)."""
        return self.calib_tokens // self.calib_seq_len

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "sparsity": str(self.sparsity),
            "calib": self.calib,
            "calib_tokens": self.calib_tokens,
            "calib_seq_len": self.calib_seq_len,
            "calib_seed": self.calib_seed,
            "damp": self.damp,
            "block_size": self.block_size,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PruneConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise PruneConfigError(f"unknown pruning options {unknown}; known: {sorted(known)}")
        values = dict(data)
        schema = {**dataclass_schema(cls), "sparsity": (STR, FLOAT)}  # "2:4" or 0.5
        check_fields("pruning config", values, schema, error=PruneConfigError)
        values["sparsity"] = Sparsity.parse(values.get("sparsity", "0.5"))
        return cls(**values)
