"""The MoE block (llmopt.models.experts) and latent attention (llmopt.models.mla):
transformers parity for Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 (fp32 logits to 1e-5,
group-limited biased sigmoid routing and MLA's decoupled interleaved RoPE included), the HF
round trip, the grouped GEMM against the per-expert path, the router (group-limited, biased,
capacity) against references, and the auxiliary losses' gradients against the explicit loss."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from llmopt.models import ConfigError, ModelConfig, build_model
from llmopt.models.experts import MoE
from llmopt.models.experts.router import Router, capacity, within_capacity
from llmopt.models.loading import load_model, save_pretrained
from llmopt.models.moe import MoEConfig, MoEConfigError
from tests.model_parity import check_parity, save_tiny_hf

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
# decisive routing: large router logits, so a wrong top-k or weight convention shows
BOOST = {"gate.weight": 30.0}


def _hf_config(arch: str):
    import transformers as tf

    if arch == "mixtral":
        return tf.MixtralConfig(
            **COMMON, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
            architectures=["MixtralForCausalLM"],
        )  # fmt: skip
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **COMMON, intermediate_size=56, moe_intermediate_size=24,
            shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2,
            mlp_only_layers=[0], architectures=["Qwen2MoeForCausalLM"],
        )  # fmt: skip
    if arch == "deepseek_v3":  # MLA (q through a low-rank bottleneck), 8 experts in 4 groups
        return tf.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, intermediate_size=48, moe_intermediate_size=16,
            n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
            architectures=["DeepseekV3ForCausalLM"],
        )  # fmt: skip
    return tf.Qwen3MoeConfig(
        **COMMON, head_dim=16, intermediate_size=56, moe_intermediate_size=24, num_experts=6,
        num_experts_per_tok=3, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip


ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module", params=ARCHS)
def hf_moe(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    ref = save_tiny_hf(_hf_config(request.param), directory, boost=BOOST)
    biases = [b for n, b in ref.named_buffers() if n.endswith("e_score_correction_bias")]
    if biases:  # DeepSeek's balancing bias: non-zero, so a wrong choice rule shows
        with torch.no_grad():
            for b in biases:
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(7)) * 0.2)
        ref.save_pretrained(directory)
    return request.param, ref, directory


def _ids(batch=2, seq=20, seed=3):
    return torch.randint(
        0, COMMON["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


def test_logits_match_transformers_to_1e5(hf_moe):
    arch, ref, directory = hf_moe
    ours = load_model(directory)
    assert ours.config.architecture == arch and ours.config.moe is not None
    ids = _ids()
    with torch.no_grad():
        expected = ref(ids).logits
    got = ours(ids)  # with grad: training forwards count their routing
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # the routing is decisive and varied: most experts of the last block get tokens
    routed = ours.layers[2].mlp.take_stats()["routed"]
    assert (routed > 0).sum() >= min(5, len(routed))
    assert routed.sum() == ids.numel() * ours.config.moe.top_k
    if arch == "deepseek_v3":
        attn = ours.layers[0].self_attn
        assert (attn.num_kv_heads, attn.head_dim, attn.v_head_dim) == (4, 24, 12)
        assert ours.kv_layout() == (4, 24, 12)


def test_greedy_decoding_matches_transformers(hf_moe):
    _, ref, directory = hf_moe
    check_parity(ref, directory, COMMON["vocab_size"], generate=False)


def test_save_pretrained_round_trips_through_transformers(hf_moe, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    arch, _, directory = hf_moe
    ours = load_model(directory)
    save_pretrained(ours, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    original = set(safe_open(str(directory / "model.safetensors"), "pt").keys())
    assert names == original  # HF's own names (Mixtral: block_sparse_moe.experts.N.w1)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _ids(seed=5)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), back(ids).logits, atol=1e-5, rtol=1e-5)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_hf_config(saved).moe == ours.config.moe


def test_config_round_trips_through_to_dict(hf_moe):
    _, _, directory = hf_moe
    cfg = load_model(directory).config
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def _moe_config(**routing) -> ModelConfig:
    moe = MoEConfig(num_experts=8, top_k=2, expert_ffn_hidden=24, **routing)
    return ModelConfig(
        name="tiny-moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2, max_seq_len=64, architecture="mixtral", moe=moe,
    )  # fmt: skip


def _block(**routing) -> MoE:
    torch.manual_seed(0)
    model = build_model(_moe_config(**routing), seed=1)
    block = model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.mul_(20)
    return block


def test_grouped_gemm_equals_the_per_expert_path():
    block = _block(shared_experts=0)
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    grouped = block(x)
    grouped.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    x_grad, x.grad = x.grad.clone(), None
    block.zero_grad()
    # a forward hook on one expert linear forces the per-expert path
    hook = block.experts["0"].up_proj.register_forward_hook(lambda m, a, o: None)
    looped = block(x)
    looped.square().sum().backward()
    hook.remove()
    torch.testing.assert_close(looped, grouped, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad, x_grad, atol=1e-6, rtol=1e-5)
    for n, p in block.named_parameters():
        assert p.grad is not None, n  # every expert gets a gradient, used or not
        torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=1e-5)


def test_group_limited_biased_router_matches_transformers_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    ref = DeepseekV3TopkRouter(hf)
    moe = MoEConfig(
        16, 4, 8, score="sigmoid", num_groups=4, topk_groups=2, route_scale=2.5, expert_bias=True
    )
    ours = Router(32, moe)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 32, generator=gen))
        ours.weight.copy_(ref.weight)
        bias = torch.randn(16, generator=gen) * 0.3
        ref.e_score_correction_bias.copy_(bias)
        ours.e_score_correction_bias.copy_(bias)
    x = torch.randn(50, 32, generator=gen)
    _, ref_w, ref_ids = ref(x)
    r = ours(x)
    order_ref, order = ref_ids.sort(-1), r.ids.sort(-1)
    assert torch.equal(order.values, order_ref.values)  # the same experts per token
    torch.testing.assert_close(
        r.weights.gather(1, order.indices), ref_w.gather(1, order_ref.indices)
    )
    # chosen experts lie in at most topk_groups groups per token
    assert ((r.ids // 4).unique(dim=-1, sorted=True).shape[-1]) <= 4
    for row in r.ids // 4:
        assert len(set(row.tolist())) <= 2


def test_capacity_keeps_each_experts_best_assignments():
    assert capacity(10, 2, 4, 1.0) == 5 and capacity(10, 2, 4, 1.25) == 7
    assert capacity(3, 2, 4, 100.0) == 3
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    kept = within_capacity(ids, weights, num_experts=4, factor=1.0)  # capacity 2
    # expert 0 has four assignments (0.6, 0.9, 0.5, 0.3): keeps 0.9 and 0.6
    assert kept.tolist() == [[True, True], [True, True], [False, True], [True, False]]


def test_dropped_assignments_contribute_nothing_and_are_counted():
    block = _block(capacity_factor=0.5)
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(2))
    out = block(x)
    stats = block.take_stats()
    cap = capacity(16, 2, 8, 0.5)
    assert stats["dropped"] == int((stats["routed"] - cap).clamp_min(0).sum()) > 0
    # reference: the same routing with dropped weights zeroed, through every expert densely
    r = block.gate(x[0])
    weights = torch.where(r.kept, r.weights, 0.0)
    dense = torch.stack([block.experts[str(e)](x[0]) for e in range(8)], dim=1)  # [N, E, H]
    expected = (dense.gather(1, r.ids[..., None].expand(-1, -1, 32)) * weights[..., None]).sum(1)
    torch.testing.assert_close(out[0], expected, atol=1e-6, rtol=1e-5)


def _explicit_aux(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """The Switch load-balancing and z-losses written out, for one forward."""
    m = block.moe
    logits = F.linear(x.reshape(-1, 32), block.gate.weight)
    probs = logits.softmax(-1)
    ids = probs.topk(m.top_k, dim=-1).indices
    f = torch.bincount(ids.reshape(-1), minlength=m.num_experts).float() / ids.numel()
    balance = m.num_experts * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    return m.aux_loss_coef * balance + m.z_loss_coef * z


def test_aux_losses_enter_backward_as_the_explicit_loss():
    block = _block(aux_loss_coef=0.05, z_loss_coef=1e-3)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    block(x).sum().backward()  # the losses ride on the output's backward
    injected = {n: p.grad.clone() for n, p in block.named_parameters()}
    stats = block.take_stats()
    block.zero_grad()
    with torch.no_grad():
        block.aux_scale = 0.0  # nothing injected: the explicit loss instead
    (block(x).sum() + _explicit_aux(block, x)).backward()
    for n, p in block.named_parameters():
        torch.testing.assert_close(injected[n], p.grad, atol=1e-6, rtol=1e-5)
    assert injected["gate.weight"].abs().sum() > 0
    assert stats["aux_loss"] > 0 and stats["z_loss"] > 0 and stats["forwards"] == 1


def test_aux_scale_scales_only_the_losses_gradient():
    block = _block(aux_loss_coef=0.1)
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(6))
    grads = []
    for scale in (1.0, 0.5, 0.0):
        block.zero_grad()
        block.aux_scale = scale
        block(x).sum().backward()
        grads.append(block.gate.weight.grad.clone())
    aux_part = grads[0] - grads[2]
    torch.testing.assert_close(grads[1] - grads[2], 0.5 * aux_part, atol=1e-7, rtol=1e-4)


def test_balancing_bias_moves_against_the_load():
    block = _block(expert_bias=True, bias_update_rate=0.01)
    load = torch.tensor([10, 0, 5, 5, 5, 5, 5, 5])
    block.update_bias(load)
    bias = block.gate.e_score_correction_bias
    assert bias[0] == pytest.approx(-0.01) and bias[1] == pytest.approx(0.01) and bias[2] == 0


def test_recomputed_forward_is_not_counted_twice():
    from llmopt.parallel.recompute import apply_activation_checkpointing

    torch.manual_seed(0)
    model = build_model(_moe_config(aux_loss_coef=0.01), seed=1)
    apply_activation_checkpointing(model, "full")
    model(torch.randint(0, 64, (1, 8))).sum().backward()
    stats = model.layers[0].mlp.take_stats()
    assert stats["forwards"] == 1 and stats["routed"].sum() == 8 * 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
        ({"mlp_only_layers": [2]}, "llmopt builds MoE blocks for the last layers only"),
        ({"decoder_sparse_step": 2}, "llmopt builds MoE blocks for the last layers only"),
    ],
)
def test_unsupported_moe_keys_are_refused(change, message):
    hf = _hf_config("qwen3_moe").to_dict()
    hf.update(change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(hf)


def test_bad_routing_settings_are_refused_with_the_value():
    with pytest.raises(MoEConfigError, match="score='relu'"):
        MoEConfig(8, 2, 16, score="relu")
    with pytest.raises(MoEConfigError, match="num_groups=3 does not divide num_experts=8"):
        MoEConfig(8, 2, 16, num_groups=3)
    with pytest.raises(MoEConfigError, match="capacity_factor=0"):
        MoEConfig(8, 2, 16, capacity_factor=0)
    with pytest.raises(MoEConfigError, match="needs expert_bias=true"):
        MoEConfig(8, 2, 16, bias_update_rate=1e-3)
    cfg = _moe_config()
    with pytest.raises(ConfigError, match="architecture 'llama' has no MoE block"):
        build_model(dataclasses.replace(cfg, architecture="llama"))
