"""Loss masking: the loss is the mean over *supervised* tokens of the whole global batch.

Labels set to IGNORE_INDEX (prompt tokens, padding) carry no loss; micro-batches and DP ranks
hold unequal numbers of supervised tokens, so a mean of per-micro-batch (or per-rank) means
would differ from the reference. Checked against one plain process on the full batch:
the loss and the reduced gradients, for DP (ZeRO-1, two micro-batches per rank) and for TP
(vocab-parallel cross-entropy).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmopt.models import ModelConfig, build_model
from llmopt.parallel.engine import parallelize
from llmopt.parallel.grid import ParallelDims, RankGrid
from llmopt.parallel.pipeline.executor import IGNORE_INDEX
from llmopt.parallel.plan import ParallelPlan
from tests.dist_helpers import run_distributed

CFG = ModelConfig(
    name="tiny",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=32,
)
BATCH, SEQ = 4, 12


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=gen)
    tokens, labels = data[:, :-1], data[:, 1:].clone()
    # Very unequal supervision per row: 11, 2, 0 and 6 supervised tokens.
    labels[0, :1] = IGNORE_INDEX
    labels[1, :10] = IGNORE_INDEX
    labels[2, :] = IGNORE_INDEX
    labels[3, 3:9] = IGNORE_INDEX
    return tokens, labels


def _reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = build_model(CFG, seed=0)
    tokens, labels = _batch()
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, tp: int, zero: int) -> tuple[float, dict[str, float]]:
    """(global loss, relative gradient error per parameter vs the reference), on each rank."""
    grid = RankGrid.create(ParallelDims(world, tp=tp))
    dp = grid.dp.size
    plan = ParallelPlan(
        tp=tp, dp=dp, zero_stage=zero, micro_batch=1, num_microbatches=BATCH // dp, precision="fp32"
    )
    engine = parallelize(build_model(CFG, seed=0), grid, plan)
    tokens, labels = _batch()
    rows = slice(grid.dp.rank * (BATCH // dp), (grid.dp.rank + 1) * (BATCH // dp))
    result = engine.forward_backward(tokens[rows], labels[rows])
    grads = engine.full_grads()
    _, ref_grads = _reference()
    errors = {n: float((grads[n] - r).norm() / r.norm()) for n, r in ref_grads.items()}
    return engine.global_loss(result), errors


@pytest.mark.parametrize("tp,zero", [(1, 1), (2, 0)], ids=["dp2-zero1-2microbatches", "tp2"])
@pytest.mark.dist
def test_loss_is_the_global_mean_over_supervised_tokens(tp, zero):
    ref_loss, _ = _reference()
    tokens, labels = _batch()
    assert (labels != IGNORE_INDEX).sum(1).tolist() == [11, 2, 0, 6]
    # A mean of per-micro-batch means (the bug this guards against) is far from the reference.
    per_row = F.cross_entropy(
        build_model(CFG, seed=0)(tokens).flatten(0, 1), labels.flatten(), reduction="none"
    ).view(BATCH, SEQ)
    counts = (labels != IGNORE_INDEX).sum(1)
    means = [float(per_row[i].sum() / counts[i]) for i in range(BATCH) if counts[i]]
    assert abs(sum(means) / len(means) - ref_loss) > 1e-3
    for loss, errors in run_distributed(_worker, 2, tp, zero, timeout_s=180):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert max(errors.values()) < 1e-5, errors


def test_prompt_tokens_carry_no_loss():
    """Changing the labels of ignored positions (or the logits there) changes nothing."""
    model = build_model(CFG, seed=0)
    grid = RankGrid.create(ParallelDims(1))
    engine = parallelize(
        model, grid, ParallelPlan(micro_batch=2, num_microbatches=2, precision="fp32")
    )
    tokens, labels = _batch()
    first = engine.global_loss(engine.forward_backward(tokens, labels))
    grads = engine.full_grads()
    engine.zero_grad()
    ref_loss, ref_grads = _reference()
    assert first == pytest.approx(ref_loss, rel=1e-6)
    # Every ignored position is a prompt token: replacing its *input* after the last
    # supervised position of the row cannot matter, nor can an all-ignored row's tokens.
    changed = tokens.clone()
    changed[2] = (changed[2] + 7) % CFG.vocab_size
    second = engine.global_loss(engine.forward_backward(changed, labels))
    assert second == pytest.approx(first, rel=1e-6)
    for name, g in engine.full_grads().items():
        torch.testing.assert_close(g, grads[name], rtol=1e-5, atol=1e-7)
    assert set(grads) == set(ref_grads)
