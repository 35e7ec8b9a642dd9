"""GPTQ: reduces to RTN with an identity Hessian, beats RTN on correlated inputs, sequential."""

import pytest
import torch

from llmopt.compress.quant.apply import quantize_model
from llmopt.compress.quant.gptq import collect_hessians, gptq_solve
from llmopt.models.packed.metadata import compression_metadata
from llmopt.models.packed.quant.format import pack_weight
from tests.compress.test_quant_awq import _tokens, outlier_model


def _correlated_inputs(n=2048, dim=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=gen) / dim**0.5
    scale = torch.linspace(0.2, 3.0, dim)  # uneven channel energy, like real activations
    return (torch.randn(n, dim, generator=gen) @ mix) * scale


@pytest.mark.parametrize("group_size", [32, -1])
def test_identity_hessian_reduces_to_rtn(group_size):
    torch.manual_seed(0)
    w = torch.randn(24, 96)
    # H = I: no column interacts with another, so no error is propagated
    packed, _ = gptq_solve(w, torch.eye(96), bits=4, group_size=group_size)
    rtn = pack_weight(w, 4, group_size)
    assert torch.equal(packed.codes(), rtn.codes())
    assert torch.equal(packed.scales, rtn.scales) and torch.equal(packed.zeros, rtn.zeros)


@pytest.mark.parametrize(
    "bits,group_size,act_order", [(4, 32, False), (3, 32, False), (4, -1, False), (4, 32, True)]
)
def test_gptq_beats_rtn_on_correlated_inputs(bits, group_size, act_order):
    torch.manual_seed(0)
    x = _correlated_inputs()
    w = torch.randn(48, 96) * 0.05
    h = 2 * x.t() @ x / x.shape[0]
    packed, loss = gptq_solve(w, h, bits, group_size, act_order=act_order, block_size=32)
    rtn = pack_weight(w, bits, group_size)
    err_gptq = (x @ (packed.dequantize() - w).t()).pow(2).mean()
    err_rtn = (x @ (rtn.dequantize() - w).t()).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
    assert loss > 0


def test_lazy_block_size_does_not_change_the_result():
    x = _correlated_inputs(dim=64)
    w = torch.randn(16, 64) * 0.05
    h = 2 * x.t() @ x / x.shape[0]
    a, _ = gptq_solve(w, h, 4, 32, block_size=32)
    b, _ = gptq_solve(w, h, 4, 32, block_size=64)
    # lazy batching only regroups the same updates; fp32 re-association can flip a rounding
    # tie in at most a handful of the 1024 codes
    assert (a.codes() != b.codes()).sum() <= 8


@pytest.mark.parametrize("groups", ["lazy", "static"])
def test_act_order_block_size_does_not_change_the_result(groups):
    # lazy groups read not-yet-updated later columns through the pending block update;
    # block_size=1 applies every update at once, so both must pick the same parameters
    x = _correlated_inputs(dim=96)
    w = torch.randn(16, 96) * 0.05
    h = 2 * x.t() @ x / x.shape[0]
    a, _ = gptq_solve(w, h, 4, 32, act_order=True, groups=groups, block_size=1)
    b, _ = gptq_solve(w, h, 4, 32, act_order=True, groups=groups, block_size=64)
    torch.testing.assert_close(a.scales.float(), b.scales.float(), rtol=2e-3, atol=0)
    assert (a.codes() != b.codes()).sum() <= 8


def test_lazy_groups_take_params_from_the_updated_weights():
    x = _correlated_inputs(dim=96)
    w = torch.randn(16, 96) * 0.05
    h = 2 * x.t() @ x / x.shape[0]
    static, _ = gptq_solve(w, h, 4, 32, act_order=True, groups="static")
    lazy, _ = gptq_solve(w, h, 4, 32, act_order=True, groups="lazy")
    # static params are the original weight's min/max; lazy ones are not (feedback moved it)
    assert torch.equal(static.scales, pack_weight(w, 4, 32).scales)
    assert not torch.equal(lazy.scales, static.scales)
    err = {k: (x @ (p.dequantize() - w).t()).pow(2).mean() for k, p in [("s", static), ("l", lazy)]}
    assert err["l"] < err["s"], err


def test_range_search_never_increases_the_weighted_rounding_error():
    # H diagonal: GPTQ is RTN with the searched range, so the H-weighted error per
    # (row, group) can only fall, and it must fall somewhere
    torch.manual_seed(0)
    w = torch.randn(32, 96)
    hd = torch.linspace(0.1, 4.0, 96)
    plain, _ = gptq_solve(w, torch.diag(hd), 4, 32)
    searched, _ = gptq_solve(w, torch.diag(hd), 4, 32, range_grid=50)

    def per_group(p):
        return (((p.dequantize() - w) ** 2) * hd).reshape(32, 3, 32).sum(-1)

    assert torch.all(per_group(searched) <= per_group(plain) + 1e-6)
    assert per_group(searched).sum() < 0.97 * per_group(plain).sum()


def test_unknown_group_mode_is_refused():
    with pytest.raises(ValueError, match="groups='dynamic'; valid choices: lazy, static"):
        gptq_solve(torch.randn(4, 32), torch.eye(32), 4, 32, act_order=True, groups="dynamic")


def test_collect_hessians_stops_at_the_requested_layers():
    model = outlier_model()
    block = model.layers[0]
    calls = []
    block.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    x = torch.randn(2, 16, 128)
    cos, sin = model.rotary(0, 16, x.dtype)
    hs = collect_hessians(block, ["self_attn.q_proj", "self_attn.v_proj"], x, cos, sin)
    assert calls == []  # the MLP never ran: the forward stopped once qkv inputs were seen
    xn = block.input_layernorm(x).reshape(-1, 128)
    torch.testing.assert_close(hs["self_attn.q_proj"], 2 * xn.t() @ xn / 32)


def test_gptq_model_beats_rtn():
    model = outlier_model()
    calib = _tokens(1, 8)
    gptq = quantize_model(
        model, "gptq", bits=4, group_size=32, calib_tokens=calib, gptq_act_order=False
    )
    gptq_ao = quantize_model(
        model, "gptq", bits=4, group_size=32, calib_tokens=calib, gptq_act_order=True
    )
    rtn = quantize_model(model, "rtn", bits=4, group_size=32)
    ev = _tokens(3, 4)
    with torch.no_grad():
        ref = model(ev)
        errs = {
            k: (m(ev) - ref).pow(2).mean().item()
            for k, m in {"gptq": gptq, "gptq_ao": gptq_ao, "rtn": rtn}.items()
        }
    assert errs["gptq"] < 0.8 * errs["rtn"], errs
    assert errs["gptq_ao"] < 0.8 * errs["rtn"], errs
    layers = compression_metadata(gptq).quant_report["layers"]
    assert len(layers) == 2 and len(layers[0]["loss"]) == 7
