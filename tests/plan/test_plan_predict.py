"""`llmopt.plan.predict`: the bytes one exact run moves, in the engine counter's keys, checked
against counts worked out by hand for a small model."""

from __future__ import annotations

import pytest

from llmopt.models.config import ModelConfig
from llmopt.parallel.plan import ParallelPlan, PlanError
from llmopt.plan.predict import predicted_activation_bytes, predicted_comm

# h=64, 8 heads of 8 (q 64), 4 KV heads (kv 32), SwiGLU f=128, V=128, 4 layers, untied.
MODEL = ModelConfig(name="tiny", vocab_size=128, hidden_size=64, intermediate_size=128,
                    num_layers=4, num_heads=8, num_kv_heads=4, max_seq_len=64)  # fmt: skip
SEQ, MB = 16, 2
ACT = MB * SEQ * 64 * 2  # one bf16 activation [mb, s, h]: 4096 bytes
LAYER = 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q, o, k, v, MLP, 2 norms: 36992


def test_tensor_parallel_counts_by_hand():
    plan = ParallelPlan(tp=2, num_microbatches=3, micro_batch=MB)
    got = predicted_comm(MODEL, SEQ, 6, plan, "first")
    # per layer 2 all-reduces forward + 2 backward, 4 layers, 3 micro-batches; embedding forward
    # and output-layer backward once per micro-batch; cross-entropy: 3 fp32 [mb, s] reductions.
    calls = 4 * 4 * 3 + 3 + 3 + 3 * 3
    nbytes = (4 * 4 * 3 + 3 + 3) * ACT + 3 * 3 * MB * SEQ * 4
    assert got == {"tp": {"all_reduce": {"calls": calls, "bytes": nbytes}}}
    assert predicted_comm(MODEL, SEQ, 6, plan, "last") == got  # pp=1: one stage is both


def test_pipeline_and_zero1_counts_by_hand():
    plan = ParallelPlan(pp=2, dp=2, zero_stage=1, micro_batch=MB, num_microbatches=2)
    first = predicted_comm(MODEL, SEQ, 8, plan, "first")
    params = 2 * LAYER + 128 * 64  # two blocks and the embedding
    assert first == {
        "pp": {"send": {"calls": 2, "bytes": 2 * ACT}, "recv": {"calls": 2, "bytes": 2 * ACT}},
        "dp": {
            "reduce_scatter": {"calls": 1, "bytes": 4 * params},  # fp32 gradients
            "all_gather": {"calls": 1, "bytes": 2 * params},  # bf16 weights
        },
    }
    last = predicted_comm(MODEL, SEQ, 8, plan, "last")
    params_last = 2 * LAYER + 64 + 128 * 64  # blocks, final norm, output layer
    assert last["dp"]["reduce_scatter"] == {"calls": 1, "bytes": 4 * params_last}
    bf16 = predicted_comm(MODEL, SEQ, 8, plan.replace(reduce_dtype="bf16"), "last")
    assert bf16["dp"]["reduce_scatter"]["bytes"] == 2 * params_last


def test_full_recompute_keeps_block_inputs_only():
    plan = ParallelPlan(recompute="full", micro_batch=MB, num_microbatches=3)
    rope = 2 * 2 * SEQ * 8  # cos and sin [s, head_dim] in bf16
    # 1F1B with pp=1 holds one micro-batch: 4 block inputs and one RoPE pair
    assert predicted_activation_bytes(MODEL, SEQ, 6, plan) == 4 * ACT + rope


def test_bad_inputs_are_refused():
    plan = ParallelPlan(tp=2, num_microbatches=3, micro_batch=MB)
    with pytest.raises(PlanError, match="global_batch=8 != micro_batch 2 x num_microbatches 3"):
        predicted_comm(MODEL, SEQ, 8, plan)
    with pytest.raises(ValueError, match="stage='middle'; choose 'first' or 'last'"):
        predicted_comm(MODEL, SEQ, 6, plan, "middle")
    with pytest.raises(ValueError, match="precision='fp32': the planner prices bf16 or fp8"):
        predicted_comm(MODEL, SEQ, 6, plan.replace(precision="fp32"))
