"""Write pruned model directories (`llmopt_prune.safetensors` + `llmopt_prune.json` + tokenizer
files); `llmopt.models.packed.sparse.directory` describes the format and reads them back.

The directory is assembled under a temporary name beside its destination and renamed into
place, so no reader ever sees half of one, and it may not be the source model's directory or
inside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.artifacts import OutputPathError, atomic_write, atomic_write_json, sha256_file
from llmopt.models.packed.metadata import compression_metadata
from llmopt.models.packed.sparse.directory import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MARKER,
    WEIGHTS,
    PruneFileError,
)
from llmopt.models.packed.sparse.format import (
    SparseLinear,
    check_fp16_range,
    pack_bits,
    pack_nm,
)
from llmopt.models.spec import spec_for
from llmopt.output_dir import check_output_dir, output_directory

KIND = "prune"  # llmopt.output_dir


def check_out_dir(
    out: str | Path, source: str | Path | None = None, overwrite: bool = False
) -> Path:
    """Refuse a destination equal to or inside the source, or an existing directory that is
    not an earlier prune output (unless `overwrite`: `llmopt.output_dir`)."""
    out = Path(out).expanduser().resolve()
    if source is not None:
        src = Path(source).expanduser().resolve()
        if out == src or src in out.parents or out in src.parents:
            raise PruneFileError(
                f"--out {out} is the source model {src} or inside it, or contains it; choose "
                "a directory outside the source"
            )
    try:
        check_output_dir(out, KIND, overwrite=overwrite)
    except OutputPathError as exc:
        raise PruneFileError(str(exc)) from exc
    return out


def _pruned_state(
    model: nn.Module, float_dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any], int, int]:
    """(tensors to save, module entries, stored bytes of pruned linears, their fp16 bytes)."""
    meta = compression_metadata(model)
    config = meta.prune_config
    assert config is not None  # save_pruned refused an unpruned model
    masks = meta.prune_masks
    sparsity = config.sparsity
    modules: dict[str, Any] = {}
    state: dict[str, torch.Tensor] = {}
    stored = dense16 = 0
    targets = set(masks) | {n for n, m in model.named_modules() if isinstance(m, SparseLinear)}
    for name in sorted(targets):
        lin = model.get_submodule(name)
        entry = {"in_features": lin.in_features, "out_features": lin.out_features}
        entry["bias"] = lin.bias is not None
        if isinstance(lin, SparseLinear) or sparsity.structured:
            packed = lin.packed() if isinstance(lin, SparseLinear) else None
            if packed is None:
                packed = pack_nm(lin.weight.data.cpu(), masks[name], sparsity.n, sparsity.m)
            state[f"{name}.values"], state[f"{name}.indices"] = packed.values, packed.indices
            entry.update(kind="nm", n=packed.n, m=packed.m)
            stored += packed.nbytes()
        else:
            weight = lin.weight.detach().cpu()
            check_fp16_range(weight)
            state[f"{name}.weight"] = weight.to(torch.float16).contiguous()
            state[f"{name}.mask"] = pack_bits(masks[name].to(torch.uint8), 1)
            entry.update(kind="masked")
            stored += weight.numel() * 2 + state[f"{name}.mask"].numel()
        if lin.bias is not None:
            state[f"{name}.bias"] = lin.bias.detach().cpu().contiguous()
        dense16 += 2 * lin.in_features * lin.out_features
        modules[name] = entry
    tied_head = f"{spec_for(model).head}.weight" if model.config.tie_embeddings else None
    for key, tensor in model.state_dict().items():
        module = key.rpartition(".")[0]
        if module in modules or key == tied_head:
            continue
        if float_dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(float_dtype)
        state[key] = tensor.detach().cpu().contiguous()
    return state, modules, stored, dense16


def save_pruned(
    model: nn.Module,
    directory: str | Path,
    tokenizer: Any = None,
    *,
    source: str | Path | None = None,
    float_dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a model from `prune_model` (or `load_pruned`) so `load_pruned(directory)` restores
    it. `source`: the model's own file or directory, which `directory` may not be or be inside.
    `float_dtype` optionally stores the unpruned tensors (embedding, norms) smaller; by default
    they keep their dtype (the pruned linears are fp16 either way)."""
    from safetensors.torch import save_file

    pruning = compression_metadata(model)
    if pruning.prune_config is None:
        raise PruneFileError("model has no prune_config: prune it with prune_model first")
    out = check_out_dir(directory, source, overwrite)
    state, modules, stored, dense16 = _pruned_state(model, float_dtype)
    try:
        with output_directory(out, KIND, overwrite=overwrite) as staging:
            weights = staging / WEIGHTS
            atomic_write(weights, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
            if tokenizer is not None:
                tokenizer.save(staging)
            report = pruning.prune_report
            meta = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "model_config": model.config.to_dict(),
                "prune_config": pruning.prune_config.to_dict(),
                "modules": modules,
                "weights_sha256": sha256_file(weights),
                "pruned_linear_bytes": stored,
                "pruned_linear_fp16_bytes": dense16,
                "float_dtype": str(float_dtype) if float_dtype is not None else "keep",
                "report": {k: v for k, v in report.items() if k != "layers"},
            }
            atomic_write_json(staging / MARKER, meta, indent=2)  # last: marks it complete
    except OutputPathError as exc:
        raise PruneFileError(str(exc)) from exc
    return out
