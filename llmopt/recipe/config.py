"""A compression recipe read and checked: its stages, their keys and types, the evaluation
settings and the output directory, all refused (naming the stage and key) before any stage runs.
The recipe format is described in `llmopt.recipe.cli`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.artifacts import OutputPathError
from llmopt.config_files import FLOAT, INT, LIST, STR, TABLE, check_fields
from llmopt.errors import LlmoptError

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
_CALIB = {"calib": STR, "calib_tokens": INT, "calib_seq_len": INT}
# each stage kind's keys and their types (a recipe is read with the typed readers' rules)
STAGE_SCHEMAS: dict[str, dict[str, Any]] = {
    "prune": {"method": STR, "sparsity": (STR, FLOAT), **_CALIB},
    "quantize": {"method": STR, "bits": INT, "group_size": INT, **_CALIB},
    "distill": {
        "student": STR,
        "steps": INT,
        "seq_len": INT,
        "global_batch": INT,
        "micro_batch": INT,
        "lr": FLOAT,
        "min_lr": FLOAT,
        "warmup_steps": INT,
        "temperature": FLOAT,
        "alpha": FLOAT,
        "text": STR,
        "skip_chars": INT,
        "max_chars": INT,
        "nproc": INT,
    },  # fmt: skip
    "fuse": {},
}
STAGE_KEYS = {kind: set(schema) for kind, schema in STAGE_SCHEMAS.items()}
EVAL_SCHEMA = {"text": STR, "max_tokens": INT, "ctx": INT, "decode_tokens": INT, "decode": STR}
TOP_SCHEMA = {"model": STR, "out": STR, "eval": TABLE, "stage": LIST}
KIND = "compress"  # llmopt.output_dir: the recipe's output directory


class RecipeError(LlmoptError, ValueError):
    """A recipe that cannot run; the message names the stage, the key and what is valid."""


@dataclass
class Recipe:
    model: str
    out: Path
    stages: list[dict[str, Any]]
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
        for i, stage in enumerate(stages, 1):
            kind = stage.get("kind")
            if kind not in KINDS:
                raise RecipeError(f"stage {i}: kind={kind!r} is not one of {', '.join(KINDS)}")
            extra = sorted(set(stage) - STAGE_KEYS[kind] - {"kind"})
            if extra:
                valid = ", ".join(sorted(STAGE_KEYS[kind])) or "none"
                raise RecipeError(f"stage {i} ({kind}): unknown key {extra[0]!r}; valid: {valid}")
            check_fields(
                f"{where} stage {i} ({kind})",
                stage,
                STAGE_SCHEMAS[kind],
                unknown="keep",
                error=RecipeError,
            )
            _check_stage(i, stage)
        recipe = cls(str(data["model"]), Path(out), [dict(s) for s in stages], ev, overwrite)
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


def _check_stage(i: int, stage: dict[str, Any]) -> None:
    """Refuse bad values before the first stage spends minutes (sparsity, N:M, T, alpha)."""
    try:
        if stage["kind"] == "prune":
            from llmopt.compress.prune import PruneConfig, Sparsity

            PruneConfig(
                method=stage.get("method", "sparsegpt"),
                sparsity=Sparsity.parse(str(stage.get("sparsity", "2:4"))),
            )
        elif stage["kind"] == "distill":
            from llmopt.compress.distill.objective import check_kd_settings

            check_kd_settings(stage.get("temperature", 1.0), stage.get("alpha", 0.9))
    except ValueError as exc:
        raise RecipeError(f"stage {i} ({stage['kind']}): {exc}") from exc
