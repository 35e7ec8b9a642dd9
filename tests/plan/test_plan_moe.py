"""MoE in the planner: HF MoE configs planned as MoE (never dense), experts sharded over EP."""

from __future__ import annotations

import json

import pytest

from llmopt.models.config import ConfigError, ModelConfig
from llmopt.models.moe import MoEConfigError, parameter_counts
from llmopt.models.moe_hf import planner_config_from_hf
from llmopt.models.presets import get_preset
from llmopt.parallel.plan import ParallelPlan
from llmopt.plan.hardware import get_cluster
from llmopt.plan.search import estimate, search
from llmopt.plan.workload import Workload

MIXTRAL = {  # mistralai/Mixtral-8x7B-v0.1 config.json (shape keys)
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6,
}  # fmt: skip
CLUSTER = get_cluster("dgx-h100", 8)
WORK = Workload(seq_len=4096, global_batch=256)


def _plan(**kw) -> ParallelPlan:
    base = dict(tp=1, pp=1, dp=64, micro_batch=1, num_microbatches=4, zero_stage=1)
    return ParallelPlan(**{**base, **kw})


def test_mixtral_config_json_is_planned_as_moe(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL))
    model = planner_config_from_hf(path)
    assert model.moe is not None and (model.moe.num_experts, model.moe.top_k) == (8, 2)
    counts = parameter_counts(model)
    # 46.7B total, 12.9B active (Mistral's announcement: 46.7B / 12.9B)
    assert counts["total"] == pytest.approx(46.7e9, rel=0.005)
    assert counts["active"] == pytest.approx(12.9e9, rel=0.005)
    assert model.num_parameters() == counts["total"]
    # the trainer's reader builds the same experts (never a dense 7B)
    assert ModelConfig.from_hf_config(MIXTRAL).moe == model.moe


def test_expert_memory_is_sharded_by_ep():
    model = planner_config_from_hf(MIXTRAL)
    ep1 = estimate(model, WORK, CLUSTER, _plan(ep=1))
    ep8 = estimate(model, WORK, CLUSTER, _plan(ep=8))
    h, f, L = 4096, 14336, 32
    experts = L * 8 * 3 * h * f  # all routed-expert weights
    # ZeRO-1: bf16 weights (2 B) and fp32 grads (4 B) per held parameter; ep=8 holds 1/8
    held = (ep1.memory_bytes["params"] - ep8.memory_bytes["params"]) / 2
    assert held == pytest.approx(experts * (1 - 1 / 8), rel=1e-9)
    grads = (ep1.memory_bytes["grads"] - ep8.memory_bytes["grads"]) / 4
    assert grads == pytest.approx(experts * (1 - 1 / 8), rel=1e-9)
    # optimizer states: experts sharded over edp = 64/8 ranks instead of 64: same bytes
    assert ep8.memory_bytes["optimizer"] == pytest.approx(ep1.memory_bytes["optimizer"], rel=1e-9)
    assert ep8.step_time_s["ep_comm_exposed"] > 0 == ep1.step_time_s["ep_comm_exposed"]
    assert ep8.to_dict()["etp"] == 1 and ep8.parallel.ep == 8


def test_relabelled_mixtral_is_not_planned_as_dense():
    relabelled = {**MIXTRAL, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    model = planner_config_from_hf(relabelled)
    assert model.moe is not None and model.moe.num_experts == 8
    assert model.num_parameters() > 40e9  # not a dense 7B
    with pytest.raises(ConfigError, match="mixture-of-experts keys .*num_local_experts"):
        ModelConfig.from_hf_config(relabelled)


def test_unknown_moe_layout_is_refused_with_one_line():
    odd = {**MIXTRAL, "moe_num_experts": 16}
    del odd["num_local_experts"]
    with pytest.raises(MoEConfigError) as exc:
        planner_config_from_hf(odd)
    msg = str(exc.value)
    assert "unknown mixture-of-experts layout" in msg and "moe_num_experts" in msg
    assert "\n" not in msg


def test_deepseek_and_qwen_layouts_match_their_presets():
    ds = {
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
        "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "vocab_size": 129280, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "num_nextn_predict_layers": 1,
    }  # fmt: skip
    model = planner_config_from_hf(ds)
    assert parameter_counts(model) == parameter_counts(get_preset("deepseek-v3"))
    # DeepSeek-V3 report: 671B total, 37B activated (main model, without the MTP module)
    main = parameter_counts(model.replace(moe=model.moe.__class__(256, 8, 2048, 58, 1)))
    assert main["total"] == pytest.approx(671e9, rel=0.01)
    assert main["active"] == pytest.approx(37.5e9, rel=0.02)
    qwen = {
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "head_dim": 128,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "vocab_size": 151936, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }  # fmt: skip
    counts = parameter_counts(planner_config_from_hf(qwen))
    assert counts == parameter_counts(get_preset("qwen3-30b-a3b"))
    assert counts["total"] == pytest.approx(30.5e9, rel=0.01)


def test_search_explores_ep_and_refuses_ep_on_dense_models():
    model = get_preset("mixtral-8x7b")
    result = search(model, WORK, CLUSTER, top_k=3)
    eps = set(result.evaluation.grid["ep"].tolist())
    assert {1, 2, 4, 8} <= eps and max(eps) == 8  # ep divides the 8 experts
    dense = estimate(get_preset("llama-3-8b"), WORK, CLUSTER, _plan(ep=8))
    assert any("need a MoE model" in r for r in dense.rejected)
    bad = estimate(model, WORK, CLUSTER, _plan(ep=16))
    assert any("ep=16 does not divide num_experts=8" in r for r in bad.rejected)


def test_small_experts_at_micro_batch_1_are_host_bound(monkeypatch):
    from llmopt.plan import experts

    model, cluster = get_preset("qwen3-30b-a3b"), get_cluster("dgx-b200", 1)
    work = Workload(seq_len=4096, global_batch=64, precision="fp8")
    plan = ParallelPlan(
        tp=1, pp=1, dp=8, ep=8, micro_batch=1, num_microbatches=8, zero_stage=1, precision="fp8"
    )
    bound = estimate(model, work, cluster, plan).step_time_s["moe_host_bound"]
    assert bound > 0  # 16 local experts x 14 FP8 kernels per micro-batch outrun the GPU work
    kernels = 128 / 8 * experts.KERNELS_PER_EXPERT["fp8"] + experts.KERNELS_PER_MOE_BLOCK
    monkeypatch.setattr(experts, "LAUNCH_S", 2 * experts.LAUNCH_S)
    doubled = estimate(model, work, cluster, plan).step_time_s["moe_host_bound"]
    # 8 micro-batches x 48 blocks x kernels, each launch LAUNCH_S longer
    assert doubled - bound == pytest.approx(8 * 48 * kernels * experts.LAUNCH_S / 2, rel=1e-9)
    monkeypatch.setattr(experts, "LAUNCH_S", 0.0)
    assert estimate(model, work, cluster, plan).step_time_s["moe_host_bound"] == 0
    dense = estimate(get_preset("llama-3-8b"), work, cluster, plan.replace(ep=1))
    assert "moe_host_bound" not in dense.step_time_s  # dense breakdowns carry no MoE parts


def test_the_engine_builds_moe_presets_as_moe():
    from llmopt.models.experts import MoE
    from llmopt.models.llama import Transformer

    small = dict(num_layers=1, hidden_size=64, intermediate_size=64, num_heads=4, num_kv_heads=2,
                 vocab_size=32)  # fmt: skip
    mixtral = Transformer(get_preset("mixtral-8x7b").replace(**small))
    assert isinstance(mixtral.layers[0].mlp, MoE) and len(mixtral.layers[0].mlp.experts) == 8
    with pytest.raises(ConfigError, match="gpt-oss-120b: architecture 'llama' has no MoE block"):
        Transformer(get_preset("gpt-oss-120b").replace(**small))
