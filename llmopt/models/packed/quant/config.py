"""What to quantize and how: one validated dataclass shared by the API, CLI and files."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmopt.config_files import check_fields, dataclass_schema
from llmopt.errors import LlmoptError
from llmopt.models.packed.quant.format import check_bits_group
from llmopt.models.packed.quant.linear import BACKENDS

METHODS = ("rtn", "awq", "gptq")
GPTQ_GROUPS = ("lazy", "static")  # llmopt.compress.quant.gptq


class QuantConfigError(LlmoptError, ValueError):
    """A quantization setting out of range (the message names the field and what is valid)."""


@dataclass(frozen=True)
class QuantConfig:
    """A quantization recipe.

    Calibration sizes default small on purpose: AWQ and GPTQ must finish on a 2-core CPU for
    SmolLM2-135M in minutes. `awq_search_samples` of the calibration sequences score the
    α grid (the activation statistics use all of them); the clipping search scores
    `awq_clip_tokens` random tokens, or all of them (None). `modules` narrows the
    architecture's block linears (its `ModelSpec`) by block-relative name or last name
    component; empty means all of them.
    """

    method: str = "rtn"
    bits: int = 4
    group_size: int = 128
    sym: bool = False
    modules: tuple[str, ...] = ()
    quantize_lm_head: bool = False
    backend: str = "auto"
    # calibration (AWQ, GPTQ)
    calib: str = "mix:default"  # llmopt.data.mix; one source fails out of domain (issue 19)
    calib_samples: int = 16
    calib_seq_len: int = 512
    calib_seed: int = 0
    # AWQ
    awq_grid: int = 20
    awq_search_samples: int = 4
    awq_duo_scaling: bool = False  # s = x^α / w^(1-α), as AutoAWQ
    awq_clip: bool = True
    awq_clip_grid: int = 20
    awq_max_shrink: float = 0.5
    awq_clip_tokens: int | None = None  # None: every calibration token (issue 19)
    # GPTQ
    gptq_damp: float = 0.01
    gptq_block_size: int = 128
    gptq_act_order: bool = True  # measured better at W4 and W3 (docs/benchmarks/quant.md)
    gptq_true_sequential: bool = True
    gptq_groups: str = "static"  # with act-order: "static" (original weight) or "lazy"
    # each group's range shrunk in 1/grid steps for the least H_jj-weighted rounding error
    # (0: min/max); what made GPTQ hold in and out of domain (docs/benchmarks/quant.md)
    gptq_range_grid: int = 50
    gptq_max_shrink: float = 0.35  # 3 seeds: KL 0.243 vs 0.247 at 0.2 (issue 19)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantConfigError(f"method={self.method!r}; valid choices: {', '.join(METHODS)}")
        check_bits_group(self.bits, self.group_size)
        if self.backend not in BACKENDS:
            raise QuantConfigError(
                f"backend={self.backend!r}; valid choices: {', '.join(BACKENDS)}"
            )
        object.__setattr__(self, "modules", tuple(self.modules))
        bad = [m for m in self.modules if not isinstance(m, str) or not m]
        if bad:
            raise QuantConfigError(f"modules={list(self.modules)}: entries must be non-empty names")
        for name in ("calib_samples", "calib_seq_len", "awq_grid", "awq_search_samples"):
            if getattr(self, name) < 1:
                raise QuantConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.awq_clip_grid < 1:
            raise QuantConfigError(f"awq_clip_grid={self.awq_clip_grid} must be >= 1")
        if self.awq_clip_tokens is not None and self.awq_clip_tokens < 1:
            raise QuantConfigError(
                f"awq_clip_tokens={self.awq_clip_tokens} must be >= 1 or None (all)"
            )
        if not 0.0 <= self.awq_max_shrink < 1.0:
            raise QuantConfigError(f"awq_max_shrink={self.awq_max_shrink} must be in [0, 1)")
        if not 0.0 < self.gptq_damp < 1.0:
            raise QuantConfigError(f"gptq_damp={self.gptq_damp} must be in (0, 1)")
        if self.gptq_groups not in GPTQ_GROUPS:
            raise QuantConfigError(
                f"gptq_groups={self.gptq_groups!r}; valid choices: {', '.join(GPTQ_GROUPS)}"
            )
        if self.gptq_range_grid < 0:
            raise QuantConfigError(
                f"gptq_range_grid={self.gptq_range_grid} must be >= 0 (0 = min/max)"
            )
        if not 0.0 <= self.gptq_max_shrink < 1.0:
            raise QuantConfigError(f"gptq_max_shrink={self.gptq_max_shrink} must be in [0, 1)")
        if self.gptq_block_size < 1:
            raise QuantConfigError(f"gptq_block_size={self.gptq_block_size} must be >= 1")

    @property
    def needs_calibration(self) -> bool:
        return self.method in ("awq", "gptq")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["modules"] = list(self.modules)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise QuantConfigError(
                f"unknown quantization keys {sorted(unknown)}; valid: {sorted(known)}"
            )
        check_fields("quantization config", data, dataclass_schema(cls))  # as read from a file
        return cls(**data)

    def replace(self, **changes: Any) -> QuantConfig:
        return dataclasses.replace(self, **changes)
