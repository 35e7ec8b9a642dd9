"""The loss a training step minimises: next-token cross-entropy summed over the supervised
tokens (vocab-parallel under TP), or a custom `Objective` such as distillation. The executor
divides the sum by the global supervised-token count, so every objective is normalised alike."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from llmopt.parallel.pipeline.executor import IGNORE_INDEX, LossFn, cross_entropy_sum
from llmopt.parallel.tensor_parallel import vocab_parallel_cross_entropy


class Objective(Protocol):
    """A training objective other than next-token CE (e.g. distillation): `bind` gives the
    step's per-micro-batch token-loss *sum* from the step's own batch (the teacher needs the
    inputs); `metrics` returns what it measured this step, reduced over the DP group."""

    def bind(self, tokens: torch.Tensor, labels: torch.Tensor) -> LossFn: ...

    def metrics(self, dp_group: Any) -> dict[str, float]: ...


def token_loss_sum(tp_group: Any, vocab_start: int) -> LossFn:
    """Cross-entropy summed over the supervised tokens of a micro-batch; under TP the logits
    are this rank's vocabulary shard starting at `vocab_start`."""
    if tp_group.size == 1:
        return cross_entropy_sum

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # vocab-parallel CE returns the token mean; the executor wants the sum over the
        # supervised tokens (TP peers hold the same labels, so they select the same rows).
        keep = labels.reshape(-1) != IGNORE_INDEX
        if not bool(keep.any()):
            return logits.sum() * 0.0  # keeps the graph (and the TP collectives) alike
        rows = logits.reshape(-1, logits.shape[-1])[keep]
        return (
            vocab_parallel_cross_entropy(rows, labels.reshape(-1)[keep], tp_group, vocab_start)
            * (rows.shape[0])
        )

    return loss
