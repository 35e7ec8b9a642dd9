"""What compression did to a model, as one typed object instead of loose module attributes.

`quantize_model`, `prune_model` and the quant/prune directory loaders record their results
here; export, training (QLoRA), inference, the recipe and the CLIs read them back through
`compression_metadata`. One reader and one writer, so a model carries either a validated
`CompressionMetadata` or none (which reads as the empty, uncompressed metadata).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.sparse.config import PruneConfig

# the one attribute the metadata rides on (private: read it with `compression_metadata`)
_ATTRIBUTE = "_llmopt_compression"


class CompressionMetadataError(LlmoptError, ValueError):
    """Metadata whose parts do not fit together (e.g. prune masks without a prune config)."""


@dataclass(frozen=True)
class CompressionMetadata:
    """The quantization and pruning a model went through and what they reported.

    `quant_report` / `prune_report` are the algorithms' JSON-able reports (seconds, per-layer
    losses, AWQ scales, ...); `prune_masks` maps a full linear name to its bool keep-mask so a
    kept weight is identifiable even when its value is 0.
    """

    quant_config: QuantConfig | None = None
    quant_report: dict[str, Any] = field(default_factory=dict)
    prune_config: PruneConfig | None = None
    prune_masks: dict[str, torch.Tensor] = field(default_factory=dict)
    prune_report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.quant_config is not None and not isinstance(self.quant_config, QuantConfig):
            raise CompressionMetadataError(
                f"quant_config must be a QuantConfig, got {type(self.quant_config).__name__}"
            )
        if self.prune_config is not None and not isinstance(self.prune_config, PruneConfig):
            raise CompressionMetadataError(
                f"prune_config must be a PruneConfig, got {type(self.prune_config).__name__}"
            )
        for name in ("quant_report", "prune_report", "prune_masks"):
            if not isinstance(getattr(self, name), dict):
                raise CompressionMetadataError(f"{name} must be a dict")
        if self.quant_report and self.quant_config is None:
            raise CompressionMetadataError("a quant_report needs the quant_config it reports on")
        if (self.prune_masks or self.prune_report) and self.prune_config is None:
            raise CompressionMetadataError("prune masks/report need the prune_config they follow")
        for name, keep in self.prune_masks.items():
            if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
                raise CompressionMetadataError(f"prune_masks[{name!r}] must be a bool tensor")

    @property
    def quantized(self) -> bool:
        return self.quant_config is not None

    @property
    def pruned(self) -> bool:
        return self.prune_config is not None

    def replace(self, **changes: Any) -> CompressionMetadata:
        return dataclasses.replace(self, **changes)


def compression_metadata(model: nn.Module) -> CompressionMetadata:
    """The compression `model` went through (the empty metadata for an uncompressed model)."""
    meta = model.__dict__.get(_ATTRIBUTE)
    return meta if meta is not None else CompressionMetadata()


def set_compression_metadata(model: nn.Module, meta: CompressionMetadata | None) -> None:
    """Record `meta` on `model` (None forgets it: the model reads as uncompressed again)."""
    if meta is None:
        model.__dict__.pop(_ATTRIBUTE, None)
        return
    if not isinstance(meta, CompressionMetadata):
        raise CompressionMetadataError(f"expected CompressionMetadata, got {type(meta).__name__}")
    model.__dict__[_ATTRIBUTE] = meta
