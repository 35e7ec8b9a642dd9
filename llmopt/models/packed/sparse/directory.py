"""Pruned model directories: `llmopt_prune.safetensors` + `llmopt_prune.json` (+ tokenizer files).

Pruned linears are stored by structure:
- N:M: `<module>.values` (fp16, the N kept of every M) + `<module>.indices` (bit-packed
  in-group positions) — 9/16 of dense fp16 for 2:4;
- unstructured: `<module>.weight` dense fp16 (zeros included: no smaller on disk, honestly) +
  `<module>.mask` (the keep-mask, 1 bit per weight), so kept weights equal to 0.0 survive.
Everything else keeps its dtype. `llmopt_prune.json` records the model and pruning configs,
every pruned module, and the SHA-256 of the weights; `load_pruned` checks them.
`llmopt.compress.prune.io.save_pruned` writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.config_files import INT, STR, check_fields
from llmopt.errors import LlmoptError
from llmopt.models.assemble import model_from_tensors
from llmopt.models.config import ModelConfig
from llmopt.models.packed.format import DirectoryFormat
from llmopt.models.packed.markers import read_marker, verify_weights
from llmopt.models.packed.metadata import CompressionMetadata, set_compression_metadata
from llmopt.models.packed.sparse.config import PruneConfig
from llmopt.models.packed.sparse.format import PackedNM, SparseLinear, unpack_bits

MARKER = "llmopt_prune.json"
WEIGHTS = (
    "llmopt_prune.safetensors"  # not model.safetensors: transformers must not take it for a model
)
FORMAT_NAME = "llmopt-prune"
FORMAT_VERSION = 1


class PruneFileError(LlmoptError, ValueError):
    """A pruned directory that is corrupted, incomplete or inconsistent, or a bad destination."""


# what `save_pruned` records per pruned linear (n, m for N:M)
MODULE_ENTRY = {"out_features": INT, "in_features": INT, "kind": STR, "n": INT, "m": INT}


def read_prune_meta(directory: str | Path) -> dict[str, Any]:
    return read_marker(
        directory,
        MARKER,
        FORMAT_NAME,
        FORMAT_VERSION,
        ("model_config", "prune_config", "modules", "weights_sha256"),
        PruneFileError,
        "a pruned model directory",
    )


def _take(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return state.pop(key)
    except KeyError:
        raise PruneFileError(f"{WEIGHTS} lacks tensor {key!r} that {MARKER} implies") from None


def load_pruned(
    directory: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    packed: bool = True,
) -> nn.Module:
    """Rebuild a model written by `save_pruned`. N:M linears become `SparseLinear` (packed) or,
    with packed=False, plain linears holding the dense weight; other tensors are cast to dtype."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    meta = read_prune_meta(directory)
    weights = directory / WEIGHTS
    verify_weights(weights, meta["weights_sha256"], MARKER, PruneFileError)
    try:
        model_config = ModelConfig.from_dict(meta["model_config"])
        prune_config = PruneConfig.from_dict(meta["prune_config"])
        state = load_file(str(weights))
    except (TypeError, ValueError, SafetensorError, OSError, RuntimeError) as exc:
        raise PruneFileError(f"{directory}: cannot read the pruned model: {exc}") from exc
    masks: dict[str, torch.Tensor] = {}
    sparse: dict[str, PackedNM] = {}
    for name, entry in meta["modules"].items():
        check_fields(
            f"{directory / MARKER}: modules[{name!r}]",
            entry,
            MODULE_ENTRY,
            required=("out_features", "in_features", "kind"),
            unknown="keep",
            error=PruneFileError,
        )
        rows, cols, kind = entry["out_features"], entry["in_features"], entry["kind"]
        if kind == "nm":
            pk = PackedNM(
                _take(state, f"{name}.values"),
                _take(state, f"{name}.indices"),
                int(entry["n"]),
                int(entry["m"]),
                cols,
            )
            if pk.values.shape != (rows, cols // pk.m * pk.n):
                raise PruneFileError(f"{name}.values has shape {tuple(pk.values.shape)}")
            weight = pk.dense(torch.float16)
            keep = torch.zeros(rows, cols // pk.m, pk.m, dtype=torch.bool)
            masks[name] = keep.scatter_(-1, pk.positions(), True).reshape(rows, cols)
            if packed:
                sparse[name] = pk
        elif kind == "masked":
            weight = _take(state, f"{name}.weight")
            keep = unpack_bits(_take(state, f"{name}.mask"), 1, cols).bool()
            if keep.shape != weight.shape or bool(weight[~keep].any()):
                raise PruneFileError(f"{name}: weight is non-zero where its mask prunes it")
            masks[name] = keep
        else:
            raise PruneFileError(f"{MARKER}: module {name!r} has unknown kind {kind!r}")
        state[f"{name}.weight"] = weight
    tensors = ((k, t.to(dtype) if t.is_floating_point() else t) for k, t in state.items())
    model = model_from_tensors(model_config, tensors, device=device, source=str(directory))
    for name, pk in sparse.items():
        lin = model.get_submodule(name)
        values = PackedNM(pk.values.to(device), pk.indices.to(device), pk.n, pk.m, pk.in_features)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, SparseLinear(values, lin.bias))
    set_compression_metadata(
        model,
        CompressionMetadata(
            prune_config=prune_config, prune_masks=masks, prune_report=meta.get("report", {})
        ),
    )
    return model.eval()


PRUNE_DIRECTORY = DirectoryFormat("prune", MARKER, load_pruned)
