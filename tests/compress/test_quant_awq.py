"""AWQ: exact scale folding, and the seed's mechanism on a model with salient input channels."""

import copy

import pytest
import torch

from llmopt.compress.quant.apply import quantize_model
from llmopt.compress.quant.awq import _apply_scale, scaling_groups
from llmopt.models import ModelConfig, build_model, spec_for
from llmopt.models.packed.metadata import compression_metadata

SALIENT = [5, 77]


def outlier_model():
    """A small MHA model whose MLP inputs carry 40x activation outliers in two channels."""
    cfg = ModelConfig(
        name="outliers",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        max_seq_len=128,
    )
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        for block in model.layers:
            block.post_attention_layernorm.weight[SALIENT] = 40.0
            block.input_layernorm.weight[[9, 100]] = 40.0
    return model


def _tokens(seed, n, t=64):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def test_scale_folding_keeps_the_model_equivalent():
    model = outlier_model()
    block = copy.deepcopy(model.layers[0])
    x = torch.randn(2, 16, 128)
    cos, sin = model.rotary(0, 16, x.dtype)
    with torch.no_grad():
        ref = block(x, cos, sin)
        selected = {n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
        groups = scaling_groups(block, spec_for(model), selected, cos, sin)
        # MHA + SwiGLU: all four fold points exist
        assert [g.prev_name for g in groups] == [
            "input_layernorm",
            "self_attn.v_proj",
            "post_attention_layernorm",
            "mlp.up_proj",
        ]
        gen = torch.Generator().manual_seed(0)
        for g in groups:
            width = block.get_submodule(g.names[0]).in_features
            _apply_scale(g, block, torch.rand(width, generator=gen) * 4 + 0.25)
        out = block(x, cos, sin)
    # fp32 re-association of scaled products only
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _mlp_channel_errors(qmodel, fp_model, h):
    """Per input channel, sum_t x_c^2 * ||dW_eff[:, c]||^2 of gate_proj, and the MLP output MSE.

    For AWQ the norm weight absorbed 1/s, so the effective weight seen by the fp input is
    Q(W s) / s with s = fp_norm / awq_norm. (gate_proj, not up_proj: AWQ also rescales up's
    rows against down_proj, so up's weights are not comparable one to one.)
    """
    fp_block, q_block = fp_model.layers[0], qmodel.layers[0]
    x = fp_block.post_attention_layernorm(h).reshape(-1, h.shape[-1])
    s = fp_block.post_attention_layernorm.weight / q_block.post_attention_layernorm.weight
    contrib = torch.zeros(h.shape[-1])
    w = fp_block.mlp.gate_proj.weight
    w_eff = q_block.mlp.gate_proj.dequantize() / s
    contrib += x.pow(2).sum(0) * (w_eff - w).pow(2).sum(0)
    out_fp = fp_block.mlp(fp_block.post_attention_layernorm(h))
    out_q = q_block.mlp(q_block.post_attention_layernorm(h))
    return contrib, (out_q - out_fp).pow(2).mean().item()


@pytest.fixture(scope="module")
def quantized_outliers():
    """(fp model, its state before quantizing, RTN copy, AWQ copy): built once per module."""
    model = outlier_model()
    before = copy.deepcopy(model.state_dict())
    rtn = quantize_model(model, "rtn", bits=4, group_size=32)
    awq = quantize_model(model, "awq", bits=4, group_size=32, calib_tokens=_tokens(1, 8))
    return model, before, rtn, awq


def test_awq_recovers_the_error_rtn_makes_on_salient_channels(quantized_outliers):
    model, _, rtn, awq = quantized_outliers
    captured = {}
    hook = model.layers[0].post_attention_layernorm.register_forward_pre_hook(
        lambda _m, a: captured.setdefault("h", a[0].detach())
    )
    with torch.no_grad():
        model(_tokens(2, 4))  # held-out tokens
        hook.remove()
        rtn_contrib, rtn_mse = _mlp_channel_errors(rtn, model, captured["h"])
        awq_contrib, awq_mse = _mlp_channel_errors(awq, model, captured["h"])
    rtn_share = rtn_contrib[SALIENT].sum() / rtn_contrib.sum()
    # 2 of 128 channels carry 1600x the squared activation: they dominate RTN's error
    assert rtn_share > 0.8, f"RTN salient share {rtn_share:.3f}"
    # AWQ removes most of the salient channels' error and most of the MLP output error
    assert awq_contrib[SALIENT].sum() < 0.2 * rtn_contrib[SALIENT].sum()
    assert awq_mse < 0.4 * rtn_mse, (awq_mse, rtn_mse)

    report = compression_metadata(awq).quant_report["layers"][0]["groups"]
    mlp_group = next(g for g in report if g["prev"] == "post_attention_layernorm")
    # the searched α is not 0 (0 would be plain RTN) and the largest scales sit on the outliers
    assert mlp_group["alpha"] > 0
    assert set(mlp_group["top_channels"][:2]) == set(SALIENT), mlp_group
    assert mlp_group["loss_awq"] < 0.5 * mlp_group["loss_rtn"], mlp_group
    scales = compression_metadata(awq).quant_report["scales"]["layers.0.post_attention_layernorm"]
    assert scales[SALIENT].min() > 3 * scales.median()  # 40x outliers, s = x^alpha
    print(
        f"\nRTN salient share {rtn_share:.3f}; MLP MSE RTN {rtn_mse:.3e} -> AWQ {awq_mse:.3e}; "
        f"alpha={mlp_group['alpha']}, s[salient]={scales[SALIENT].tolist()}, "
        f"median s={scales.median():.3f}"
    )


def test_awq_model_error_below_rtn_and_input_untouched(quantized_outliers):
    model, before, rtn, awq = quantized_outliers
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    ev = _tokens(3, 4)
    with torch.no_grad():
        ref = model(ev)
        e_awq = (awq(ev) - ref).pow(2).mean()
        e_rtn = (rtn(ev) - ref).pow(2).mean()
    assert e_awq < 0.5 * e_rtn, (e_awq, e_rtn)


def test_awq_requires_calibration_tokens(tiny_model):
    with pytest.raises(ValueError, match="method 'awq' needs calibration tokens"):
        quantize_model(tiny_model, "awq")


def test_weight_mean_is_each_channels_share_of_its_group_max():
    from llmopt.compress.quant.awq import _weight_mean

    w1 = torch.tensor([[1.0, -2.0, 4.0], [3.0, 0.0, -6.0]])
    w2 = torch.tensor([[0.5, 0.5, -1.0]])
    # groups of 2 over 3 inputs: columns {0, 1} and {2} (padded)
    expected = torch.tensor([(0.5 + 1.0 + 1.0) / 3, (1.0 + 0.0 + 1.0) / 3, (1.0 + 1.0 + 1.0) / 3])
    assert torch.allclose(_weight_mean([w1, w2], 2), expected)


def test_duo_scaling_searches_other_scales_and_never_loses_to_rtn_on_its_sample():
    model = outlier_model()
    calib = _tokens(1, 8)
    plain = quantize_model(model, "awq", bits=4, group_size=32, calib_tokens=calib)
    duo = quantize_model(
        model, "awq", bits=4, group_size=32, calib_tokens=calib, awq_duo_scaling=True
    )
    plain_groups = [
        g for layer in compression_metadata(plain).quant_report["layers"] for g in layer["groups"]
    ]
    duo_groups = [
        g for layer in compression_metadata(duo).quant_report["layers"] for g in layer["groups"]
    ]
    assert len(duo_groups) == len(plain_groups) > 0
    for g in duo_groups:
        assert g["loss_awq"] <= g["loss_rtn"]
    # the same α grid, a different objective: the first block's losses differ
    first_plain, first_duo = plain_groups[0], duo_groups[0]
    assert first_duo["loss_awq"] != first_plain["loss_awq"]
    ev = _tokens(3, 4)
    with torch.no_grad():
        ref = model(ev)
        e_duo = (duo(ev) - ref).pow(2).mean()
        e_rtn = (quantize_model(model, "rtn", bits=4, group_size=32)(ev) - ref).pow(2).mean()
    assert e_duo < 0.5 * e_rtn, (e_duo, e_rtn)


def _direct_clip_errors(w, x, max_abs, group_size):
    """Each (row, group)'s partial-output MSE over the tokens, computed the long way."""
    from llmopt.models.packed.quant.format import fake_quantize

    q = fake_quantize(w, 4, group_size, False, max_abs=max_abs)
    errs = []
    for g0 in range(0, w.shape[1], group_size):
        cols = slice(g0, g0 + group_size)
        errs.append(((x[:, cols] @ (q - w)[:, cols].t()) ** 2).mean(0))
    return torch.stack(errs, dim=1)  # [out, G]


def test_clip_search_on_the_gram_matrix_equals_the_direct_search():
    from llmopt.compress.quant.awq import search_clip
    from llmopt.models.packed.quant.config import QuantConfig

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 80, generator=gen)
    x = torch.randn(300, 80, generator=gen) * torch.linspace(0.1, 5, 80)
    config = QuantConfig(method="awq", group_size=32, awq_clip_grid=10, awq_max_shrink=0.5)
    best_max, before, after = search_clip(w, x, config)
    org_max = torch.nn.functional.pad(w.abs(), (0, 16)).reshape(24, 3, 32).amax(-1)
    direct = torch.stack(
        [_direct_clip_errors(w, x, org_max * (1 - i / 10), 32) for i in range(6)]
    )  # [steps, out, G]
    choice = direct.argmin(0)
    assert torch.allclose(best_max, org_max * (1 - choice / 10))
    assert before == pytest.approx(direct[0].sum(1).mean().item(), rel=1e-4)
    assert after == pytest.approx(direct.amin(0).sum(1).mean().item(), rel=1e-4)
    assert (choice > 0).any() and after < before  # clipping pays on this data


def test_clip_tokens_default_to_all_and_refuse_zero():
    from llmopt.models.packed.quant.config import QuantConfig

    assert QuantConfig().awq_clip_tokens is None
    with pytest.raises(ValueError, match=r"awq_clip_tokens=0 must be >= 1 or None \(all\)"):
        QuantConfig(awq_clip_tokens=0)
