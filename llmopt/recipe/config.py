"""A recipe read and checked: a list of stages, each the config object of the command it
stands for, plus the evaluation settings and the output directory, all refused (naming the
stage and key) before any stage runs. The recipe format is described in `llmopt.recipe.cli`.

A prune stage is the `PruneConfig` and a quantize stage the `QuantConfig` that `llmopt prune`
/ `llmopt quantize` build from the same keys, with the same defaults (`llmopt.recipe.options`);
a distill stage is a `DistillStage` (a short recovery distillation of the previous model), a
fuse stage a `FuseStage`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.artifacts import OutputPathError
from llmopt.config_files import INT, LIST, STR, TABLE, check_fields, dataclass_schema
from llmopt.errors import LlmoptError
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.sparse.config import PruneConfig

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

KINDS = ("prune", "distill", "quantize", "fuse")
EVAL_KEYS = {
    "text": "corpus:web-bible",
    "max_tokens": 2048,
    "ctx": 256,
    "decode_tokens": 32,
    "decode": "auto",  # auto (generate's choice), fast (fused C++) or eager
}
DECODE = {"auto": None, "fast": True, "eager": False}


@dataclass(frozen=True)
class DistillStage:
    """Recover the previous stage's model by distilling the original into it
    (`llmopt.compress.distill`) on `max_chars` of `text` after `skip_chars` (None: after the
    first half, which evaluation reads). The defaults are a short recovery run, not
    `llmopt distill`'s training of a new student."""

    student: str = "previous"  # or a student spec (init:teacher-layers=..., config:...)
    steps: int = 40
    seq_len: int = 128
    global_batch: int = 2
    micro_batch: int = 2
    lr: float = 1e-4
    min_lr: float = 1e-5
    warmup_steps: int = 4
    temperature: float = 1.0
    alpha: float = 0.9
    text: str = "corpus:web-bible"
    skip_chars: int | None = None
    max_chars: int = 400_000
    nproc: int = 1

    def __post_init__(self) -> None:
        from llmopt.compress.distill.objective import check_kd_settings

        check_kd_settings(self.temperature, self.alpha)


@dataclass(frozen=True)
class FuseStage:
    """Measure the previous model on the fused C++ decode path; writes nothing."""


Stage = PruneConfig | QuantConfig | DistillStage | FuseStage
KIND_OF: dict[type, str] = {
    PruneConfig: "prune",
    QuantConfig: "quantize",
    DistillStage: "distill",
    FuseStage: "fuse",
}


def stage_kind(stage: Stage) -> str:
    return KIND_OF[type(stage)]


def stage_schema(kind: str) -> dict[str, tuple[str, ...]]:
    """Each stage kind's keys and their types (a recipe is read with the typed readers' rules)."""
    if kind in ("prune", "quantize"):
        from llmopt.recipe.options import stage_options

        return stage_options(kind).schema()
    return dataclass_schema(DistillStage) if kind == "distill" else {}


EVAL_SCHEMA = {"text": STR, "max_tokens": INT, "ctx": INT, "decode_tokens": INT, "decode": STR}
TOP_SCHEMA = {"model": STR, "out": STR, "eval": TABLE, "stage": LIST}
KIND = "compress"  # llmopt.output_dir: the recipe's output directory


class RecipeError(LlmoptError, ValueError):
    """A recipe that cannot run; the message names the stage, the key and what is valid."""


@dataclass
class Recipe:
    model: str
    out: Path
    stages: list[Stage]
    eval: dict[str, Any] = field(default_factory=lambda: dict(EVAL_KEYS))
    overwrite: bool = False  # write into an --out holding other files (only ours replaced)

    @classmethod
    def from_toml(cls, path: str | Path, out: str | None = None, overwrite: bool = False) -> Recipe:
        path = Path(path)
        if not path.is_file():
            raise RecipeError(f"recipe {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise RecipeError(f"recipe {path}: {exc}") from exc
        return cls.from_dict(data, out, overwrite, where=f"recipe {path}")

    @classmethod
    def from_dict(
        cls,
        data: dict[str, Any],
        out: str | None = None,
        overwrite: bool = False,
        where: str = "recipe",
    ) -> Recipe:
        unknown = sorted(set(data) - set(TOP_SCHEMA))
        if unknown:
            raise RecipeError(f"unknown recipe key {unknown[0]!r}; valid: model, out, eval, stage")
        if isinstance(data.get("stage"), dict):
            raise RecipeError(
                f"{where}: stage is one table; write each stage as a [[stage]] table (an array "
                'of tables) with kind = "prune", "distill", "quantize" or "fuse"'
            )
        check_fields(where, data, TOP_SCHEMA, error=RecipeError)
        if "eval" in data:
            check_fields(f"{where} [eval]", data["eval"], EVAL_SCHEMA, error=RecipeError)
        for i, stage in enumerate(data.get("stage", []), 1):
            if not isinstance(stage, dict):
                raise RecipeError(
                    f"{where}: stage {i} is {stage!r}, not a table; write each stage as a "
                    '[[stage]] table with kind = "prune", "distill", "quantize" or "fuse"'
                )
        if not data.get("model"):
            raise RecipeError('the recipe needs model = "NAME or PATH"')
        out = out or data.get("out")
        if not out:
            raise RecipeError('the recipe needs out = "DIR" (or --out DIR)')
        ev = dict(EVAL_KEYS)
        bad = sorted(set(data.get("eval", {})) - set(EVAL_KEYS))
        if bad:
            raise RecipeError(f"unknown [eval] key {bad[0]!r}; valid: {', '.join(EVAL_KEYS)}")
        ev.update(data.get("eval", {}))
        if ev["decode"] not in DECODE:
            raise RecipeError(f"[eval] decode={ev['decode']!r}: choose auto, fast or eager")
        stages = data.get("stage", [])
        if not stages:
            raise RecipeError("the recipe has no [[stage]]; add prune, distill, quantize or fuse")
        typed = [_read_stage(i, stage, where) for i, stage in enumerate(stages, 1)]
        recipe = cls(str(data["model"]), Path(out), typed, ev, overwrite)
        recipe.check_out()
        return recipe

    def check_out(self) -> None:
        from llmopt.compress.distill.run import check_out
        from llmopt.compress.prune.cli import source_path

        try:
            source = source_path(self.model)
        except (KeyError, FileNotFoundError, ValueError):
            source = Path(self.model)
        from llmopt.output_dir import check_output_dir

        try:
            check_out(self.out, source)
            check_output_dir(self.out, KIND, overwrite=self.overwrite)
        except (OutputPathError, ValueError) as exc:
            raise RecipeError(str(exc)) from exc


def _read_stage(i: int, stage: dict[str, Any], where: str) -> Stage:
    """Stage `i` as its config object; bad keys, types and values refused before any stage
    runs (sparsity, N:M, bits, T, alpha), naming the stage and the key."""
    from llmopt.recipe.options import RENAMED, stage_options

    kind = stage.get("kind")
    if kind not in KINDS:
        raise RecipeError(f"stage {i}: kind={kind!r} is not one of {', '.join(KINDS)}")
    schema = stage_schema(kind)
    keys = {k: v for k, v in stage.items() if k != "kind"}
    for old, new in RENAMED.get(kind, {}).items():
        if old in keys:
            raise RecipeError(f"stage {i} ({kind}): key {old!r} is now called {new}")
    extra = sorted(set(keys) - set(schema))
    if extra:
        valid = ", ".join(sorted(schema)) or "none"
        raise RecipeError(f"stage {i} ({kind}): unknown key {extra[0]!r}; valid: {valid}")
    check_fields(f"{where} stage {i} ({kind})", keys, schema, error=RecipeError)
    try:
        if kind in ("prune", "quantize"):
            return stage_options(kind).config(keys)
        if kind == "distill":
            return DistillStage(**keys)
        return FuseStage()
    except ValueError as exc:
        raise RecipeError(f"stage {i} ({kind}): {exc}") from exc
