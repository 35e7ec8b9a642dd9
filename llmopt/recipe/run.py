"""Run a recipe: every stage's model measured against the original (ppl, KL, top-1 agreement,
size on disk, batch-1 decode speed), each row written as soon as it is measured."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from llmopt.artifacts import atomic_write_json
from llmopt.eval.kl import kl_divergence
from llmopt.infer.generate import decode_path, generate
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.sparse.config import PruneConfig
from llmopt.recipe.config import DECODE, KIND, DistillStage, Recipe, stage_kind
from llmopt.recipe.stages import distill_stage, prune_stage, quantize_stage


def disk_bytes(directory: Path) -> int:
    """Bytes of the model files of a stage directory (no logs or checkpoints)."""
    if directory.is_file():
        return directory.stat().st_size
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def measure(model, original, tokens: torch.Tensor, prompt: list[int], ev, fast=None) -> dict:
    """ppl, KL(original ‖ model), top-1 agreement, decode tokens/s (batch 1, greedy)."""
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
        kind = stage_kind(stage)
        out = recipe.out / f"{i:02d}-{kind}"
        start = time.perf_counter()
        log(f"stage {i}: {kind} <- {source}")
        if isinstance(stage, PruneConfig):
            made = prune_stage(stage, source, out, tokenizer, recipe.overwrite)
        elif isinstance(stage, QuantConfig):
            made = quantize_stage(stage, source, out, tokenizer, recipe.overwrite)
        elif isinstance(stage, DistillStage):
            made = distill_stage(stage, recipe.model, source, out, out.name in ours)
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
