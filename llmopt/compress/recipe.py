"""`llmopt compress --recipe recipe.toml`: chain prune / distil / quantize / fuse stages and
measure every intermediate against the original model.

    model = "smollm2-135m"
    out = "runs/order/prune-distil-quant"
    [eval]                      # held-out text: evaluation reads the corpus from its start
    text = "corpus:web-bible"
    max_tokens = 2048
    [[stage]]
    kind = "prune"              # method, sparsity, calib, calib_tokens, calib_seq_len
    sparsity = "2:4"
    [[stage]]
    kind = "distill"            # student ("previous" or init:...), steps, seq_len, ... (recover)
    steps = 40
    [[stage]]
    kind = "quantize"           # method, bits, group_size
    bits = 4

Each stage reads the previous stage's model and writes `<out>/NN-kind/`; its metrics (ppl,
KL and top-1 agreement vs the original, size on disk, batch-1 decode speed) go to
`<out>/NN-kind.metrics.json`, and all rows to `<out>/recipe_metrics.json`. A distil stage
after a prune stage keeps the sparsity: the masks are applied again to the trained weights
and the result is saved as a pruned directory. `fuse` writes nothing and measures the
previous model on the fused C++ decode path (`llmopt.infer.fast`), the others measure it on
whichever path `generate` picks.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmopt import cli_args
from llmopt.artifacts import OutputPathError, atomic_write_json, atomic_write_text
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


def disk_bytes(directory: Path) -> int:
    """Bytes of the model files of a stage directory (no logs or checkpoints)."""
    if directory.is_file():
        return directory.stat().st_size
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def measure(model, original, tokens: torch.Tensor, prompt: list[int], ev, fast=None) -> dict:
    """ppl, KL(original ‖ model), top-1 agreement, decode tokens/s (batch 1, greedy)."""
    from llmopt.eval.kl import kl_divergence
    from llmopt.infer.generate import decode_path, generate

    kl = kl_divergence(model, original, tokens, ctx=int(ev["ctx"]))
    stamps: list[float] = []
    generate(model, prompt, max_new_tokens=4, fast=fast)  # warm-up (and builds the kernels)
    generate(
        model,
        prompt,
        max_new_tokens=int(ev["decode_tokens"]),
        fast=fast,
        on_token=lambda _: stamps.append(time.perf_counter()),
    )
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return {
        "ppl": kl.ppl,
        "kl_vs_original": kl.mean,
        "top1_vs_original": kl.top1_agreement,
        "eval_tokens": kl.tokens,
        "decode_tokens_per_s": rate,
        "decode_path": decode_path(model, fast)[0],
    }


def _calib(tokenizer, stage: dict, seq_len_default: int = 256):
    from llmopt.compress.quant.calibration import calibration_tokens

    seq = int(stage.get("calib_seq_len", seq_len_default))
    n = max(1, int(stage.get("calib_tokens", 16 * seq)) // seq)
    return calibration_tokens(tokenizer, stage.get("calib", "mix:default"), n, seq)


def _prune(stage: dict, source: str, out: Path, tokenizer, overwrite: bool = False) -> Path:
    from llmopt.compress.prune import PruneConfig, Sparsity, prune_model, save_pruned
    from llmopt.models.loading import load_model

    config = PruneConfig(
        method=stage.get("method", "sparsegpt"),
        sparsity=Sparsity.parse(str(stage.get("sparsity", "2:4"))),
    )
    calib = _calib(tokenizer, stage) if config.needs_calibration else None
    pruned = prune_model(load_model(source), config=config, calib_tokens=calib)
    return save_pruned(pruned, out, tokenizer, source=None, overwrite=overwrite)


def _quantize(stage: dict, source: str, out: Path, tokenizer, overwrite: bool = False) -> Path:
    from llmopt.compress.prune import load_pruned
    from llmopt.compress.quant import quantize_model, save_quantized
    from llmopt.models.loading import load_model

    method = stage.get("method", "rtn")
    if (Path(source) / "llmopt_prune.json").is_file():
        model = load_pruned(source, packed=False)  # dense weights with their zeros
        for name in ("prune_config", "prune_masks", "prune_report"):
            delattr(model, name)  # the INT4 format stores the zeros densely
    else:
        model = load_model(source)
    calib = _calib(tokenizer, stage) if method in ("awq", "gptq") else None
    bits, group = int(stage.get("bits", 4)), int(stage.get("group_size", 64))
    quantized = quantize_model(model, method, bits, group, calib_tokens=calib)
    return save_quantized(quantized, out, tokenizer, overwrite=overwrite)


def _distill(stage: dict, teacher: str, source: str, out: Path, rerun: bool = False) -> Path:
    """`rerun`: `out` is this recipe's own earlier distil stage, started afresh."""
    from llmopt.compress.distill.run import DistillSettings, distill
    from llmopt.data.corpus import load_text
    from llmopt.train.config import TrainConfig

    text = load_text(stage.get("text", "corpus:web-bible"))
    skip = int(stage.get("skip_chars", len(text) // 2))  # after the evaluation text
    part = text[skip : skip + int(stage.get("max_chars", 400_000))]
    out.mkdir(parents=True, exist_ok=True)
    text_file = out / "train_text.txt"
    atomic_write_text(text_file, part)
    student = stage.get("student", "previous")
    settings = DistillSettings(
        teacher,
        source if student == "previous" else student,
        float(stage.get("temperature", 1.0)),
        float(stage.get("alpha", 0.9)),
    )
    train = TrainConfig(
        corpus=str(text_file),
        seq_len=int(stage.get("seq_len", 128)),
        global_batch=int(stage.get("global_batch", 2)),
        micro_batch=int(stage.get("micro_batch", 2)),
        steps=int(stage.get("steps", 40)),
        lr=float(stage.get("lr", 1e-4)),
        min_lr=float(stage.get("min_lr", 1e-5)),
        warmup_steps=int(stage.get("warmup_steps", 4)),
        out_dir=str(out),
        overwrite=rerun,
        progress=False,
    )
    summary = distill(settings, train, nproc=int(stage.get("nproc", 1)))
    if summary.get("returncode"):
        raise RecipeError(f"distill stage failed (exit {summary['returncode']})")
    model_dir = out / "model"
    if (Path(source) / "llmopt_prune.json").is_file():
        model_dir = _keep_sparsity(model_dir, source, out / "pruned")
    return model_dir


def _keep_sparsity(model_dir: Path, pruned_source: str, out: Path) -> Path:
    """The trained weights with the pruned source's masks applied again, saved pruned."""
    from llmopt.compress.prune import load_pruned, save_pruned
    from llmopt.models.loading import load_model, load_tokenizer

    masked = load_pruned(pruned_source, packed=False)
    trained = load_model(model_dir)
    with torch.no_grad():
        state = trained.state_dict()
        for name, keep in masked.prune_masks.items():
            state[f"{name}.weight"] = state[f"{name}.weight"] * keep.to(torch.float32)
        masked.load_state_dict(state, strict=False)
    return save_pruned(masked, out, load_tokenizer(model_dir), source=None)


def run_recipe(recipe: Recipe, log=print, original_row: dict | None = None) -> list[dict[str, Any]]:
    """Run every stage; returns the metric rows (the original model first). `original_row`:
    the original's row measured already (several recipes on one model measure it once)."""
    from llmopt.data.corpus import load_text
    from llmopt.models.loading import load_model, load_tokenizer, resolve_spec

    ev = recipe.eval
    tokenizer = load_tokenizer(recipe.model)
    ids = tokenizer.encode(load_text(ev["text"], max_chars=20 * int(ev["max_tokens"])))
    tokens = torch.tensor(ids[: int(ev["max_tokens"])], dtype=torch.long)
    prompt = ids[:32]
    from llmopt.output_dir import read_record, record_in_place

    original = load_model(recipe.model)
    recipe.check_out()  # again: the directory may have changed since the recipe was read
    earlier = read_record(recipe.out) if recipe.out.is_dir() else None
    ours = set(earlier["files"]) if earlier and earlier.get("kind") == KIND else set()
    recipe.out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    rows = [dict(original_row) if original_row else {"stage": "original", "model": recipe.model}]
    if not original_row:
        rows[0].update(measure(original, original, tokens, prompt, ev, DECODE[ev["decode"]]))
        rows[0]["disk_bytes"] = disk_bytes(resolve_spec(recipe.model)[1])
    source, chain = recipe.model, []
    for i, stage in enumerate(recipe.stages, 1):
        kind = stage["kind"]
        out = recipe.out / f"{i:02d}-{kind}"
        start = time.perf_counter()
        log(f"stage {i}: {kind} <- {source}")
        if kind == "prune":
            made = _prune(stage, source, out, tokenizer, recipe.overwrite)
        elif kind == "quantize":
            made = _quantize(stage, source, out, tokenizer, recipe.overwrite)
        elif kind == "distill":
            made = _distill(stage, recipe.model, source, out, out.name in ours)
        else:
            made = Path(source)
        if kind != "fuse":
            written.append(out.name)
            record_in_place(recipe.out, KIND, written)  # each stage's output counts as ours
        chain.append(kind)
        model = load_model(made)
        row = {"stage": "+".join(chain), "model": str(made), "seconds": 0.0}
        fast = True if kind == "fuse" else DECODE[ev["decode"]]
        row.update(measure(model, original, tokens, prompt, ev, fast))
        row["disk_bytes"] = disk_bytes(resolve_spec(str(made))[1])
        row["seconds"] = time.perf_counter() - start
        atomic_write_json(recipe.out / f"{i:02d}-{kind}.metrics.json", row)
        written.append(f"{i:02d}-{kind}.metrics.json")
        record_in_place(recipe.out, KIND, written)
        rows.append(row)
        source = str(made)
    atomic_write_json(recipe.out / "recipe_metrics.json", {"model": recipe.model, "rows": rows})
    record_in_place(recipe.out, KIND, [*written, "recipe_metrics.json"])
    return rows


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compress", help="chain prune/distil/quantize from a recipe TOML", description=__doc__
    )
    p.add_argument("--recipe", required=True, help="recipe TOML (see llmopt compress -h)")
    p.add_argument("--out", default=None, help="output directory (overrides the recipe's)")
    cli_args.add_overwrite(p)
    p.add_argument("--json", action="store_true", help="print the metric rows as JSON")
    p.set_defaults(func=handle, check=check_args)


def check_args(args: argparse.Namespace) -> None:
    """The recipe (types, stages, values) and its output directory, before any stage runs."""
    Recipe.from_toml(args.recipe, args.out, args.overwrite)


def handle(args: argparse.Namespace) -> int:
    recipe = Recipe.from_toml(args.recipe, args.out, args.overwrite)
    rows = run_recipe(recipe, log=(lambda _: None) if args.json else print)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'stage':<28}{'ppl':>9}{'KL':>9}{'top-1':>8}{'MiB':>9}{'tok/s':>9}")
    for r in rows:
        print(
            f"{r['stage']:<28}{r['ppl']:>9.2f}{r['kl_vs_original']:>9.4f}"
            f"{r['top1_vs_original']:>8.3f}{r['disk_bytes'] / 2**20:>9.1f}"
            f"{r['decode_tokens_per_s']:>9.1f}"
        )
    return 0
