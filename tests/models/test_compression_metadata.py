"""The typed compression metadata: one reader/writer, validated, carried through a deep copy."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from llmopt.models.packed.metadata import (
    CompressionMetadata,
    CompressionMetadataError,
    compression_metadata,
    set_compression_metadata,
)
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.sparse.config import PruneConfig


def test_uncompressed_model_reads_empty_metadata():
    meta = compression_metadata(nn.Linear(2, 2))
    assert meta == CompressionMetadata() and not meta.quantized and not meta.pruned


def test_written_metadata_reads_back_and_survives_deepcopy():
    model = nn.Linear(4, 4)
    keep = {"x": torch.ones(4, 4, dtype=torch.bool)}
    meta = CompressionMetadata(prune_config=PruneConfig(), prune_masks=keep)
    set_compression_metadata(model, meta)
    assert compression_metadata(model) is meta and compression_metadata(model).pruned
    copied = compression_metadata(copy.deepcopy(model))
    assert copied.prune_config == meta.prune_config
    assert torch.equal(copied.prune_masks["x"], keep["x"])
    set_compression_metadata(model, None)
    assert not compression_metadata(model).pruned
    assert "_llmopt_compression" not in dict(model.named_modules())  # not a submodule


@pytest.mark.parametrize(
    "kwargs",
    [
        {"quant_config": {"bits": 4}},
        {"quant_report": {"seconds": 1.0}},
        {"prune_masks": {"x": torch.ones(2, dtype=torch.bool)}},
        {"prune_config": PruneConfig(), "prune_masks": {"x": torch.ones(2)}},
    ],
)
def test_inconsistent_metadata_is_refused(kwargs):
    with pytest.raises(CompressionMetadataError):
        CompressionMetadata(**kwargs)


def test_writer_refuses_other_objects():
    with pytest.raises(CompressionMetadataError):
        set_compression_metadata(nn.Linear(2, 2), QuantConfig())  # type: ignore[arg-type]
