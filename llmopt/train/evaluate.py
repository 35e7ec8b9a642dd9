"""Held-out loss during training: the mean over supervised tokens of the eval rows.

Each DP rank evaluates its share of the rows with this rank's stage (pp=1) and the engine's
loss function (vocab-parallel under TP), and the (loss sum, token count) pair is summed over
DP (and CP: each context-parallel rank scores its share of the tokens), so the value is the
same on every rank and independent of the layout.
"""

from __future__ import annotations

import torch

from llmopt.errors import UsageError
from llmopt.parallel.engine import TrainingEngine
from llmopt.parallel.pipeline.executor import IGNORE_INDEX


@torch.no_grad()
def eval_loss(
    engine: TrainingEngine, inputs: torch.Tensor, labels: torch.Tensor, micro: int
) -> float:
    """Held-out loss of this rank's rows `inputs`/`labels` [n, T], summed over DP; collective."""
    if engine.grid.pp.size != 1:
        raise UsageError("eval loss needs pp=1 (the stage computing the loss holds everything)")
    if engine.dp.zero == 3:
        raise UsageError("eval loss with zero_stage=3 is not supported; use zero_stage<=2")
    stage = engine.stages[0]
    was_training = stage.training
    stage.eval()
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)
    try:
        engine.dp.prepare_forward()
        for start in range(0, inputs.shape[0], micro):
            x = inputs[start : start + micro].to(engine.device)
            y = labels[start : start + micro].to(engine.device)
            x, y = engine.local_sequences(x, y)  # context parallelism: this rank's share
            logits = stage(x, x.shape[1])
            total[0] += engine.executor.loss_fn(logits, y).double()
            total[1] += int((y != IGNORE_INDEX).sum())
    finally:
        stage.train(was_training)
    with engine.grid.counter.paused():
        engine.grid.dp_cp.all_reduce(total)
    return float(total[0] / total[1].clamp_min(1))
