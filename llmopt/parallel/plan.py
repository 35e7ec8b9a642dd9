"""ParallelPlan: how one training job is mapped onto ranks — the one object the planner ranks,
the trainer runs, the engine applies and the exporters translate.

It is pure data (no torch), so `llmopt plan` can build and print plans without importing the
engine. One name per concept everywhere (planner, engine, trainer, CLI flags, TOML/JSON):

    tp, pp, dp, cp, ep          parallel degrees (Megatron rank order: tp, cp, ep, dp, pp)
    expert_tp                   TP degree of the routed experts: 1 or tp (0: tp, Megatron's
                                default)
    layers_per_stage            layers of each of the pp*v model chunks, in stage order (empty:
                                even, or the split the two flags below give)
    account_for_embedding       Megatron's --account-for-embedding-in-pipeline-split: the
                                embedding counts as one layer of the first chunk
    account_for_loss            ... and the output layer + loss as one layer of the last chunk
    sequence_parallel           Megatron-style SP over the TP group (needs tp > 1)
    zero_stage                  0 (DDP), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)
    micro_batch                 sequences per forward/backward on one DP rank
    num_microbatches            micro-batches per optimizer step on one DP rank
    schedule                    gpipe | 1f1b | interleaved
    virtual_stages              model chunks per pipeline rank (interleaved only)
    recompute                   none | selective | full
    precision                   fp32 | bf16 | fp8
    fp8_recipe                  current | delayed (only read when precision == fp8)
    reduce_dtype                fp32 | bf16: dtype of the data-parallel gradient reduction

A run config (what `llmopt plan --emit` writes and `llmopt train --config` reads) is a TOML
or JSON document whose `[parallel]` table is exactly `ParallelPlan.to_dict()`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmopt.errors import LlmoptError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

Schedule = Literal["gpipe", "1f1b", "interleaved"]
Recompute = Literal["none", "selective", "full"]
Precision = Literal["fp32", "bf16", "fp8"]

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp8")
FP8_RECIPES: tuple[str, ...] = ("current", "delayed")
REDUCE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
DEGREES: tuple[str, ...] = ("tp", "pp", "dp", "cp", "ep")


class PlanError(LlmoptError, ValueError):
    """A parallel plan that cannot describe a run; the message names the field and the fix."""


def _positive_int(name: str, value: Any) -> None:
    # numpy integers are accepted (the planner's vectorised grid hands them out); bools are not.
    if isinstance(value, bool) or not hasattr(value, "__index__") or value <= 0:
        raise PlanError(f"{name}={value!r} must be a positive integer")


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise PlanError(f"{name}={value!r} is not valid; choose one of {', '.join(valid)}")


@dataclass(frozen=True)
class ParallelPlan:
    """One mapping of a training job onto tp·pp·dp·cp·ep ranks, validated on construction."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    micro_batch: int = 1
    num_microbatches: int = 1
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    recompute: Recompute = "none"
    precision: Precision = "bf16"
    fp8_recipe: str = "current"
    reduce_dtype: str = "fp32"
    expert_tp: int = 0
    layers_per_stage: tuple[int, ...] = ()
    account_for_embedding: bool = False
    account_for_loss: bool = False

    def __post_init__(self) -> None:
        for name in (*DEGREES, "micro_batch", "num_microbatches", "virtual_stages"):
            _positive_int(name, getattr(self, name))
            object.__setattr__(self, name, int(getattr(self, name)))
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"sequence_parallel={self.sequence_parallel!r} must be true or false")
        if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"zero_stage={self.zero_stage!r} is not a ZeRO stage; choose 0-3")
        object.__setattr__(self, "zero_stage", int(self.zero_stage))
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("recompute", self.recompute, RECOMPUTES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        _choice("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        if self.schedule == "interleaved" and (self.pp < 2 or self.virtual_stages < 2):
            raise PlanError(
                "schedule=interleaved needs pp>=2 and virtual_stages>=2 "
                f"(got pp={self.pp}, virtual_stages={self.virtual_stages})"
            )
        if self.schedule != "interleaved" and self.virtual_stages != 1:
            raise PlanError(
                f"virtual_stages={self.virtual_stages} needs schedule=interleaved "
                f"(got schedule={self.schedule})"
            )
        if (self.dp * self.cp) % self.ep:
            raise PlanError(
                f"ep={self.ep} must divide dp*cp={self.dp * self.cp} "
                "(experts are laid over the data-parallel ranks)"
            )
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("sequence_parallel=true needs tp>1 (it splits activations over TP)")
        for name in ("account_for_embedding", "account_for_loss"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name}={getattr(self, name)!r} must be true or false")
        if self.layers_per_stage is None:  # an unset value read from JSON
            object.__setattr__(self, "layers_per_stage", ())
        if isinstance(self.layers_per_stage, list) and not self.layers_per_stage:
            object.__setattr__(self, "layers_per_stage", ())  # TOML/JSON give a list
        if self.layers_per_stage:
            counts = self.layers_per_stage
            stages = self.pp * self.virtual_stages
            if not isinstance(counts, list | tuple) or len(counts) != stages:
                raise PlanError(
                    f"layers_per_stage={counts!r} must list the layers of each of the "
                    f"pp*virtual_stages={stages} model chunks"
                )
            if any(isinstance(c, bool) or not hasattr(c, "__index__") or c < 0 for c in counts):
                raise PlanError(f"layers_per_stage={list(counts)} must be non-negative integers")
            object.__setattr__(self, "layers_per_stage", tuple(int(c) for c in counts))
            if self.account_for_embedding or self.account_for_loss:
                raise PlanError(
                    "layers_per_stage gives the split itself; account_for_embedding/"
                    "account_for_loss only shape the default split"
                )
        if isinstance(self.expert_tp, bool) or not hasattr(self.expert_tp, "__index__"):
            raise PlanError(f"expert_tp={self.expert_tp!r} must be 0 (tp), 1 or tp={self.tp}")
        object.__setattr__(self, "expert_tp", int(self.expert_tp))
        if self.expert_tp not in (0, 1, self.tp):
            raise PlanError(f"expert_tp={self.expert_tp} must be 0 (tp), 1 or tp={self.tp}")

    def stage_split(self, num_layers: int) -> tuple[int, ...] | None:
        """Layers of each of the pp*v chunks (None: the engine's even default): the explicit
        split, or Megatron's split with the embedding and/or the loss counted as a layer
        (they must then divide evenly over the chunks, as Megatron asserts)."""
        if self.layers_per_stage:
            return self.layers_per_stage
        extra = int(self.account_for_embedding) + int(self.account_for_loss)
        if not extra:
            return None
        stages = self.pp * self.virtual_stages
        units = num_layers + extra
        if units % stages:
            raise PlanError(
                f"num_layers={num_layers} + {extra} (embedding/loss counted as layers) = "
                f"{units} does not divide over pp*virtual_stages={stages} chunks"
            )
        counts = [units // stages] * stages
        counts[0] -= int(self.account_for_embedding)
        counts[-1] -= int(self.account_for_loss)
        if min(counts) < 0:
            raise PlanError(f"the split {counts} leaves a chunk fewer than no layers")
        return tuple(counts)

    @property
    def resolved_expert_tp(self) -> int:
        """The experts' TP degree: expert_tp, or tp when unset (Megatron's default)."""
        return self.expert_tp or self.tp

    # ---- derived ----
    @property
    def world_size(self) -> int:
        """Ranks the plan occupies (experts are laid over the data-parallel ranks, so ep is
        not a factor of its own: it must divide dp·cp)."""
        return self.tp * self.pp * self.dp * self.cp

    def sequences_per_step(self) -> int:
        """Global batch in sequences: micro_batch × num_microbatches × dp."""
        return self.micro_batch * self.num_microbatches * self.dp

    def short(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        parts += [f"{n}={getattr(self, n)}" for n in ("cp", "ep") if getattr(self, n) > 1]
        if self.expert_tp and self.ep > 1:
            parts.append(f"expert_tp={self.expert_tp}")
        return ",".join(parts)

    def check_batch(self, global_batch: int) -> None:
        """Refuse a global batch this plan does not produce."""
        if self.sequences_per_step() != global_batch:
            raise PlanError(
                f"global_batch={global_batch} != micro_batch {self.micro_batch} x "
                f"num_microbatches {self.num_microbatches} x dp {self.dp} "
                f"= {self.sequences_per_step()}"
            )

    def replace(self, **changes: Any) -> ParallelPlan:
        return dataclasses.replace(self, **changes)

    # ---- serialisation ----
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layers_per_stage"] = list(self.layers_per_stage)  # as TOML and JSON read it back
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelPlan:
        if not isinstance(data, dict):
            raise PlanError(f"a parallel plan is a table of fields, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise PlanError(
                f"unknown parallel plan keys {unknown}; valid keys: {', '.join(cls.field_names())}"
            )
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_toml(self, table: str = "parallel") -> str:
        lines = [f"[{table}]"]
        for key, value in self.to_dict().items():
            lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_file(cls, path: str | Path, table: str = "parallel") -> ParallelPlan:
        """Read the `[parallel]` table of a TOML or JSON run config."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"plan file not found: {path}")
        text = path.read_text(encoding="utf-8")
        try:
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"{path} is not valid {path.suffix[1:].upper()}: {exc}") from exc
        if table not in data:
            raise PlanError(f"{path} has no [{table}] table")
        return cls.from_dict(data[table])


def _toml_value(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise PlanError(f"{value!r} cannot be written to TOML")
        return repr(value)
    return json.dumps(str(value))
