"""The recipe's stages: each reads the previous stage's model and writes its own directory
with the compress package's own functions (prune, quantize, distil)."""

from __future__ import annotations

from pathlib import Path

import torch

from llmopt.artifacts import atomic_write_text
from llmopt.recipe.config import RecipeError


def _calib(tokenizer, stage: dict, seq_len_default: int = 256):
    from llmopt.compress.quant.calibration import calibration_tokens

    seq = int(stage.get("calib_seq_len", seq_len_default))
    n = max(1, int(stage.get("calib_tokens", 16 * seq)) // seq)
    return calibration_tokens(tokenizer, stage.get("calib", "mix:default"), n, seq)


def prune_stage(stage: dict, source: str, out: Path, tokenizer, overwrite: bool = False) -> Path:
    from llmopt.compress.prune import PruneConfig, Sparsity, prune_model, save_pruned
    from llmopt.models.loading import load_model

    config = PruneConfig(
        method=stage.get("method", "sparsegpt"),
        sparsity=Sparsity.parse(str(stage.get("sparsity", "2:4"))),
    )
    calib = _calib(tokenizer, stage) if config.needs_calibration else None
    pruned = prune_model(load_model(source), config=config, calib_tokens=calib)
    return save_pruned(pruned, out, tokenizer, source=None, overwrite=overwrite)


def quantize_stage(stage: dict, source: str, out: Path, tokenizer, overwrite: bool = False) -> Path:
    from llmopt.compress.prune import load_pruned
    from llmopt.compress.quant import quantize_model, save_quantized
    from llmopt.models.loading import load_model
    from llmopt.models.packed.metadata import set_compression_metadata

    method = stage.get("method", "rtn")
    if (Path(source) / "llmopt_prune.json").is_file():
        model = load_pruned(source, packed=False)  # dense weights with their zeros
        set_compression_metadata(model, None)  # the INT4 format stores the zeros densely
    else:
        model = load_model(source)
    calib = _calib(tokenizer, stage) if method in ("awq", "gptq") else None
    bits, group = int(stage.get("bits", 4)), int(stage.get("group_size", 64))
    quantized = quantize_model(model, method, bits, group, calib_tokens=calib)
    return save_quantized(quantized, out, tokenizer, overwrite=overwrite)


def distill_stage(stage: dict, teacher: str, source: str, out: Path, rerun: bool = False) -> Path:
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
    from llmopt.models.packed.metadata import compression_metadata

    masked = load_pruned(pruned_source, packed=False)
    trained = load_model(model_dir)
    with torch.no_grad():
        state = trained.state_dict()
        for name, keep in compression_metadata(masked).prune_masks.items():
            state[f"{name}.weight"] = state[f"{name}.weight"] * keep.to(torch.float32)
        masked.load_state_dict(state, strict=False)
    return save_pruned(masked, out, load_tokenizer(model_dir), source=None)
