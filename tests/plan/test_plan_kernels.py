"""Issue 27 (second pass): the framework kernels the cost model prices, against hand counts —
attention kernel generations, torchtitan's op-level SAC, torchao Float8 casts, FP8 weight
all-gathers, bf16 Adam moments and Megatron-Core's named recompute modules — and how the
validator and the CLI choose them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from llmopt.errors import UsageError
from llmopt.models.presets import get_preset
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan import timing
from llmopt.plan.comm import collectives_for
from llmopt.plan.grid import to_grid
from llmopt.plan.hardware import get_cluster
from llmopt.plan.memory import memory_breakdown
from llmopt.plan.recompute import dropped_bytes
from llmopt.plan.timing import step_time
from llmopt.plan.workload import Workload

LLAMA = get_preset("llama-3-70b")
H100 = get_cluster("dgx-h100", 8)
PLAN = ParallelPlan(tp=8, pp=1, dp=8, sequence_parallel=True, micro_batch=1, num_microbatches=16)
WORK = Workload(seq_len=8192, global_batch=128)


def _t(work, plan=PLAN, model=LLAMA, cluster=H100):
    return {k: float(v[0]) for k, v in step_time(model, work, cluster, to_grid(plan)).items()}


def test_fa2_generation_runs_attention_at_its_own_efficiency():
    gpu = H100.gpu
    assert gpu.attention_efficiency_of("fa3") == 0.4 and gpu.attention_efficiency_of("fa2") == 0.28
    # the attention core of one layer, forward: QKᵀ and ·V, 2·s·(heads·head_dim)/t FLOPs each
    # per token, of which the causal half is computed
    tokens = 8192
    attn = 0.5 * tokens * 4 * 8192 * LLAMA.num_heads * LLAMA.head_dim / 8 / (989e12)
    extra = 3 * LLAMA.num_layers * 16 * attn * (1 / 0.28 - 1 / 0.4)  # fwd + bwd, 16 micro-batches
    t3 = _t(WORK)
    t2 = _t(dataclasses.replace(WORK, attention_kernel="fa2"))
    assert t2["compute"] - t3["compute"] == pytest.approx(extra, rel=1e-9)
    a100 = get_cluster("dgx-a100-80gb", 8).gpu  # FlashAttention-2 is Ampere's native kernel
    assert a100.attention_efficiency_of("fa2") == a100.attention_efficiency_of("fa3")
    with pytest.raises(UsageError, match="attention_kernel='fa4'"):
        Workload(attention_kernel="fa4")


def test_torchtitan_op_sac_recomputes_every_second_matmul():
    kv = LLAMA.num_kv_heads * LLAMA.head_dim
    h, f = LLAMA.hidden_size, LLAMA.intermediate_size
    # torchtitan's block runs wq, wk, wv, wo, w1, w3, w2: the 2nd, 4th and 6th are recomputed
    share = (h * kv + h * h + h * f) / (h * h + 2 * h * kv + h * h + 3 * h * f)
    _, _, weights = timing._linear_dims(LLAMA, np.array(kv * 1.0), np.array(1.0))
    assert float(timing._every_other_mm_share(weights)) == pytest.approx(share, rel=1e-12)
    sel = PLAN.replace(recompute="selective")
    base = _t(WORK, sel)["recompute"]
    titan = _t(dataclasses.replace(WORK, selective="every-other-mm"), sel)["recompute"]
    # GEMM weights per TP-8 rank: q and o, the three MLP matmuls split; one KV head per rank
    per_rank = (2 * h * LLAMA.q_size + 3 * h * f) / 8 + 2 * h * LLAMA.head_dim
    gemm = 16 * 80 * 8192 * 2 * per_rank / (989e12 * 0.55)  # 16 micro-batches x 80 layers
    assert titan > base and titan - base == pytest.approx(share * gemm, rel=1e-9)


def test_torchao_casts_are_memory_bound_passes_over_each_linears_input_and_output_grad():
    fp8 = dataclasses.replace(WORK, precision="fp8")
    te = _t(fp8)["compute"]
    ao = _t(dataclasses.replace(fp8, fp8_casts="torchao"))["compute"]
    kv = LLAMA.num_kv_heads * LLAMA.head_dim / 8
    h, q, f = LLAMA.hidden_size, LLAMA.q_size / 8, LLAMA.intermediate_size / 8
    elems = (3 * h + q + 2 * h + f) + (q + 2 * kv + h + 2 * f + h)
    want = 16 * 80 * 8192 * timing.TORCHAO_CAST_BYTES * elems / (3350e9 * 0.8)
    assert ao - te == pytest.approx(want, rel=1e-9)
    assert _t(dataclasses.replace(WORK, fp8_casts="torchao"))["compute"] == _t(WORK)["compute"]


def test_fp8_weight_all_gather_moves_one_byte_per_parameter():
    fsdp = PLAN.replace(zero_stage=3)
    fp8 = dataclasses.replace(WORK, precision="fp8")

    def gathered(work):
        rows = collectives_for(LLAMA, work, H100, fsdp, "last")
        return sum(r["calls"] * r["payload_bytes"] for r in rows if r["op"] == "all-gather"
                   and r["group"] == "dp")  # fmt: skip

    assert gathered(dataclasses.replace(fp8, fp8_param_gather=True)) == pytest.approx(
        gathered(fp8) / 2
    )
    assert gathered(dataclasses.replace(WORK, fp8_param_gather=True)) == gathered(WORK)  # bf16


def test_bf16_adam_moments_keep_8_bytes_of_optimizer_state_per_parameter():
    grid = to_grid(PLAN.replace(zero_stage=1))
    fp32 = memory_breakdown(LLAMA, WORK, H100, grid)["optimizer"][0]
    bf16 = memory_breakdown(LLAMA, dataclasses.replace(WORK, moments="bf16"), H100, grid)
    assert float(bf16["optimizer"][0]) == pytest.approx(fp32 * 8 / 12, rel=1e-12)
    with pytest.raises(UsageError, match="moments='fp16'"):
        Workload(moments="fp16")


def test_named_recompute_modules_drop_what_megatron_stops_keeping():
    qwen = get_preset("qwen3-235b-a22b")
    tokens, tp, sp = np.array([4096.0]), np.array([1]), np.array([False])
    m = qwen.moe
    moe_act = dropped_bytes(qwen, tokens, tp, sp, ("moe_act",))
    assert float(moe_act[0]) == pytest.approx(4096 * 2 * m.top_k * m.expert_ffn_hidden)
    norm = dropped_bytes(qwen, tokens, tp, sp, ("layernorm",))
    assert float(norm[0]) == pytest.approx(4096 * 2 * 2 * qwen.hidden_size)
    both = dropped_bytes(qwen, tokens, tp, sp, ("layernorm", "moe_act"))
    assert float(both[0]) == pytest.approx(float(norm[0] + moe_act[0]))
    plan = ParallelPlan(tp=1, pp=4, dp=16, ep=8, recompute="selective", num_microbatches=16)
    cluster = get_cluster("dgx-h100", 8)
    work = Workload(seq_len=4096, global_batch=256)
    plain = memory_breakdown(qwen, work, cluster, to_grid(plan))["activations"][0]
    named = memory_breakdown(
        qwen, dataclasses.replace(work, recompute_modules=("layernorm", "moe")), cluster,
        to_grid(plan),
    )["activations"][0]  # fmt: skip
    assert named < plain  # recomputing the whole MoE layer keeps less than the default set
    with pytest.raises(UsageError, match="recompute_modules attn"):
        Workload(recompute_modules=("attn",))


def test_validator_reads_the_kernels_and_modules_a_row_states():
    from llmopt.validate.run_rows import setup_row
    from llmopt.validate.software import attention_kernel, recompute_modules, software_years

    assert software_years({"source": "x", "locator": "25.11 NeMo Container, DGX-H100"}) == [2025]
    assert software_years({"source": "NeMo24.03.01 container", "locator": ""}) == [2024]
    row = {"framework": "nemo", "attention": ""}
    assert attention_kernel(row, [2024]) == "fa2" and attention_kernel(row, [2025]) == "fa3"
    assert attention_kernel({"framework": "torchtitan"}, [2025]) == "fa2"  # PyTorch SDPA
    assert recompute_modules(
        {"recompute": "selective (moe_act, layernorm)",
         "notes": "A2A_OVERLAP=1, activation offloading (expert_fc1, moe_act)"}
    ) == ("moe_act", "layernorm", "expert_fc1")  # fmt: skip
    assert recompute_modules({"recompute": "selective (op-level SAC)", "notes": ""}) == ()
    base = {
        "row_id": "1", "source": "s", "locator": "l", "model": "llama-3-8b", "layers": "",
        "hidden": "", "heads": "", "kv_heads": "", "ffn_hidden": "", "seq_len": "8192",
        "vocab": "", "gpu_type": "H100", "total_gpus": "8", "tp": "1", "pp": "1", "dp": "8",
        "cp": "1", "virtual_pp_stages": "1", "micro_batch": "not stated",
        "global_batch_seqs": "not stated", "recompute": "selective (per-op SAC)",
        "sequence_parallel": "no", "zero_fsdp": "FSDP2", "tflops_per_gpu_reported": "",
        "tflops_convention": "", "tokens_per_s_per_gpu_reported": "6150",
        "step_time_s_reported": "", "notes": "float8 all-gather", "framework": "torchtitan",
        "precision": "fp8 (torchao)",
    }  # fmt: skip
    s = setup_row(base)
    assert s.open_batch and s.work.selective == "every-other-mm"
    assert s.work.fp8_casts == "torchao" and s.work.fp8_param_gather
    from llmopt.validate.planner_runs import predict

    plan, chosen = predict(s)
    assert s.work.global_batch == 8 * plan.parallel.micro_batch  # dp x micro-batch, m = 1
    assert any("global batch = dp x micro_batch" in c for c in chosen)


def test_cli_takes_the_frameworks_kernels_and_the_recipes_moments():
    from llmopt.cli import build_parser
    from llmopt.plan.cli.inputs import build_workload

    parser = build_parser("plan")

    def work(*args, model="llama-3-70b"):
        return build_workload(parser.parse_args(["plan", *args]), model)

    titan = work("--framework", "torchtitan", "--precision", "fp8")
    assert (titan.attention_kernel, titan.selective, titan.fp8_casts) == (
        "fa2",
        "every-other-mm",
        "torchao",
    )
    assert titan.fp8_param_gather
    assert work("--framework", "nemo").attention_kernel == "fa3"
    assert work("--framework", "nemo", model="deepseek-v3").moments == "bf16"
    assert work("--framework", "megatron", model="deepseek-v3").moments == "fp32"
    assert work("--moments", "bf16").moments == "bf16"
