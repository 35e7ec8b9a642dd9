"""Pruning: magnitude, Wanda and SparseGPT, unstructured or N:M, and packed N:M storage.

from llmopt.compress.prune import prune_model, save_pruned, load_pruned
pruned = prune_model(model, "sparsegpt", "2:4", calib_tokens=calib)
save_pruned(pruned, "out/smollm2-2of4", tokenizer)
model = load_pruned("out/smollm2-2of4")
"""

from llmopt.compress.prune.apply import prune_model
from llmopt.compress.prune.io import save_pruned
from llmopt.models.packed.sparse.config import METHODS, PruneConfig, PruneConfigError, Sparsity
from llmopt.models.packed.sparse.directory import PruneFileError, load_pruned
from llmopt.models.packed.sparse.format import PackedNM, SparseLinear, pack_nm

__all__ = [
    "METHODS",
    "PackedNM",
    "PruneConfig",
    "PruneConfigError",
    "PruneFileError",
    "Sparsity",
    "SparseLinear",
    "load_pruned",
    "pack_nm",
    "prune_model",
    "save_pruned",
]
