"""The recipe's stages: each reads the previous stage's model and writes its own directory
with the compress package's own functions (prune, quantize, distil), from the stage's config
object (`llmopt.recipe.config`)."""

from __future__ import annotations

from pathlib import Path

import torch

from llmopt.artifacts import atomic_write_text
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.sparse.config import PruneConfig
from llmopt.recipe.config import DistillStage, RecipeError


def _calib(tokenizer, config: PruneConfig | QuantConfig) -> torch.Tensor | None:
    """The calibration windows the command would draw for `config` (None: it needs none)."""
    from llmopt.compress.quant.calibration import config_calibration

    drawn = config_calibration(tokenizer, config)
    return None if drawn is None else drawn.tokens


def prune_stage(
    config: PruneConfig, source: str, out: Path, tokenizer, overwrite: bool = False
) -> Path:
    from llmopt.compress.prune import prune_model, save_pruned
    from llmopt.models.loading import load_model

    calib = _calib(tokenizer, config)
    pruned = prune_model(load_model(source), config=config, calib_tokens=calib)
    return save_pruned(pruned, out, tokenizer, source=None, overwrite=overwrite)


def quantize_stage(
    config: QuantConfig, source: str, out: Path, tokenizer, overwrite: bool = False
) -> Path:
    from llmopt.compress.prune import load_pruned
    from llmopt.compress.quant import quantize_model, save_quantized
    from llmopt.models.loading import load_model
    from llmopt.models.packed.metadata import set_compression_metadata

    if (Path(source) / "llmopt_prune.json").is_file():
        model = load_pruned(source, packed=False)  # dense weights with their zeros
        set_compression_metadata(model, None)  # the INT4 format stores the zeros densely
    else:
        model = load_model(source)
    calib = _calib(tokenizer, config)
    quantized = quantize_model(model, config=config, calib_tokens=calib)
    return save_quantized(quantized, out, tokenizer, overwrite=overwrite)


def distill_stage(
    stage: DistillStage, teacher: str, source: str, out: Path, rerun: bool = False
) -> Path:
    """`rerun`: `out` is this recipe's own earlier distil stage, started afresh."""
    from llmopt.compress.distill.run import DistillSettings, distill
    from llmopt.data.corpus import load_text
    from llmopt.train.config import TrainConfig

    text = load_text(stage.text)
    skip = stage.skip_chars if stage.skip_chars is not None else len(text) // 2
    part = text[skip : skip + stage.max_chars]  # after the evaluation text
    out.mkdir(parents=True, exist_ok=True)
    text_file = out / "train_text.txt"
    atomic_write_text(text_file, part)
    student = source if stage.student == "previous" else stage.student
    settings = DistillSettings(teacher, student, stage.temperature, stage.alpha)
    train = TrainConfig(
        corpus=str(text_file),
        seq_len=stage.seq_len,
        global_batch=stage.global_batch,
        micro_batch=stage.micro_batch,
        steps=stage.steps,
        lr=stage.lr,
        min_lr=stage.min_lr,
        warmup_steps=stage.warmup_steps,
        out_dir=str(out),
        overwrite=rerun,
        progress=False,
    )
    summary = distill(settings, train, nproc=stage.nproc)
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
    from llmopt.models.packed.metadata import compression_metadata

    masked = load_pruned(pruned_source, packed=False)
    trained = load_model(model_dir)
    with torch.no_grad():
        state = trained.state_dict()
        for name, keep in compression_metadata(masked).prune_masks.items():
            state[f"{name}.weight"] = state[f"{name}.weight"] * keep.to(torch.float32)
        masked.load_state_dict(state, strict=False)
    return save_pruned(masked, out, load_tokenizer(model_dir), source=None)
