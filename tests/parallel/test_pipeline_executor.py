"""Pipeline executor on gloo: loss and gradient parity with one process, counted traffic.

Every rank builds the same seeded model and computes the single-process reference for the same
global batch itself (the model is tiny), then runs its own stages through the pipeline and
compares its own parameters' gradients. One launch per pp runs all schedule x m combinations.

Tolerance: 1e-5 relative (max |g - g_ref| / max |g_ref| per tensor, and for the loss). The
pipeline sums micro-batch gradients where the reference does one big matmul, so fp32 sums are
reordered; observed differences are ~1e-7.
"""

from __future__ import annotations

import pytest
import torch

from llmopt.models import ModelConfig, build_model
from llmopt.parallel.comm import CommCounter, Group
from llmopt.parallel.pipeline.executor import PipelineExecutor, cross_entropy_sum
from llmopt.parallel.pipeline.schedule import ScheduleError, build_schedule
from llmopt.parallel.pipeline.stage import split_model, stage_layout, stage_parameters
from tests.dist_helpers import run_distributed

RTOL = 1e-5
SEQ = 8


def tiny_pp_config(tie: bool = False) -> ModelConfig:
    return ModelConfig(
        name="tiny-pp",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=32,
        tie_embeddings=tie,
    )


def _batch(batch: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (batch, SEQ + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _parity_worker(rank: int, world: int, cases: list[tuple[str, int, int, bool]]):
    import torch.distributed as dist

    group = Group("pp", tuple(range(world)), rank, dist.group.WORLD, CommCounter())
    report = []
    for name, m, v, tie in cases:
        cfg = tiny_pp_config(tie)
        tokens, labels = _batch(2 * m, cfg.vocab_size, seed=m)
        ref = build_model(cfg, seed=1)
        logits = ref(tokens)
        ref_loss = cross_entropy_sum(logits, labels) / labels.numel()
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        if tie:
            ref_grads["lm_head.weight"] = ref.lm_head.weight.grad

        model = build_model(cfg, seed=1)
        schedule = build_schedule(name, world, m, v)
        stages = split_model(model, rank, world, v)
        group.counter.reset()
        executor = PipelineExecutor(stages, schedule, group, tied_embeddings=tie)
        result = executor.step(tokens, labels)

        holds_last = schedule.rank_of(schedule.num_stages - 1) == rank
        if holds_last:
            assert abs(result.loss - ref_loss.item()) <= RTOL * abs(ref_loss.item()), (
                name,
                m,
                v,
                result.loss,
                ref_loss.item(),
            )
        else:
            assert result.loss is None
        worst = 0.0
        params = stage_parameters(stages)
        assert params, "every rank holds parameters"
        for pname, param in params.items():
            err = _rel(param.grad, ref_grads[pname])
            assert err <= RTOL, f"{name} m={m} v={v} tie={tie}: grad {pname} rel err {err:.2e}"
            worst = max(worst, err)
        # Exact traffic: one activation per send of [2, SEQ, hidden] fp32, plus the tied grad.
        act_bytes = 2 * SEQ * cfg.hidden_size * 4
        n_send = sum(a.op.startswith("SEND") for a in schedule.actions[rank])
        n_recv = sum(a.op.startswith("RECV") for a in schedule.actions[rank])
        tied = cfg.vocab_size * cfg.hidden_size * 4 if tie and rank in (0, world - 1) else 0
        assert group.counter.bytes("pp", "send") == n_send * act_bytes + tied
        assert group.counter.bytes("pp", "recv") == n_recv * act_bytes + tied
        report.append((name, m, v, tie, worst))
    return report


def _cases(pp: int) -> list[tuple[str, int, int, bool]]:
    cases = [
        (name, m, v, False)
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
        for m in (pp, 2 * pp + 1)
    ]
    return cases + [("1f1b", pp, 1, True), ("interleaved", 2 * pp + 1, 2, True)]


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.dist
def test_pipeline_loss_and_gradients_match_single_process(pp):
    reports = run_distributed(_parity_worker, pp, _cases(pp), timeout_s=240)
    # Every rank checked every case (8 per pp); no silent skips.
    assert all(len(r) == len(_cases(pp)) for r in reports)


def test_stage_layout_balances_and_validates():
    assert stage_layout(8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    # 10 layers on 4 stages: the middle stages take the extra blocks.
    assert [len(r) for r in stage_layout(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in stage_layout(8, 2, 2)] == [2, 2, 2, 2]
    assert [len(r) for r in stage_layout(6, 2, 1, [1, 5])] == [1, 5]
    with pytest.raises(ScheduleError, match=r"num_layers=6 is not divisible by pp\*v=4"):
        stage_layout(6, 2, 2)
    with pytest.raises(ScheduleError, match=r"num_layers=2 is fewer than pp\*v=4"):
        stage_layout(2, 4)
    with pytest.raises(ScheduleError, match=r"layers_per_stage has 3 entries; need pp\*v=2"):
        stage_layout(6, 2, 1, [2, 2, 2])
    with pytest.raises(ScheduleError, match="must be non-negative and sum to num_layers=6"):
        stage_layout(6, 2, 1, [2, 3])


def test_split_model_shares_modules_and_keeps_names():
    model = build_model(tiny_pp_config(), seed=0)
    chunks = split_model(model, 1, 2, 2)  # stages 1 and 3 of 4
    assert [c.stage for c in chunks] == [1, 3]
    names = list(stage_parameters(chunks))
    assert names[0].startswith("layers.2.") and "lm_head.weight" in names
    assert "embed_tokens.weight" not in names
    assert chunks[1].lm_head is model.lm_head  # shared, not copied
    full = dict(model.named_parameters())
    assert all(stage_parameters(chunks)[n] is full[n] for n in names)


def test_single_stage_pipeline_is_plain_gradient_accumulation():
    cfg = tiny_pp_config()
    tokens, labels = _batch(6, cfg.vocab_size, seed=3)
    ref = build_model(cfg, seed=2)
    (cross_entropy_sum(ref(tokens), labels) / labels.numel()).backward()
    model = build_model(cfg, seed=2)
    group = Group("pp", (0,), 0, None, CommCounter())
    result = PipelineExecutor(split_model(model, 0, 1), build_schedule("1f1b", 1, 3), group).step(
        tokens, labels
    )
    ref_loss = cross_entropy_sum(ref(tokens), labels).item() / labels.numel()
    assert result.loss == pytest.approx(ref_loss, rel=RTOL)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert _rel(p.grad, q.grad) <= RTOL, name
    with pytest.raises(ValueError, match="batch size 6 is not divisible by num_microbatches=4"):
        PipelineExecutor(split_model(model, 0, 1), build_schedule("gpipe", 1, 4), group).step(
            tokens, labels
        )
