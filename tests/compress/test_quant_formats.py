"""Packed INT formats, RTN and QuantLinear: exact round trips and parity with dequantisation."""

import pytest
import torch

from llmopt.compress.quant.apply import model_nbytes, quant_linears, quantize_model
from llmopt.models.packed.metadata import compression_metadata
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.quant.format import (
    PackedWeight,
    QuantFormatError,
    compute_qparams,
    pack_codes,
    pack_weight,
    unpack_codes,
)
from llmopt.models.packed.quant.linear import QuantLinear


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("in_features", [64, 77])
def test_pack_unpack_roundtrip(bits, in_features):
    codes = torch.randint(0, 2**bits, (5, in_features), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    expected_cols = in_features if bits == 8 else (in_features + 1) // 2
    assert packed.shape == (5, expected_cols)
    assert torch.equal(unpack_codes(packed, bits, in_features), codes)


def test_nibble_order_is_low_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x0F]]


def test_hand_computed_asymmetric_codes():
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-1.0, 0.0, 0.5, 2.0]])
    packed = pack_weight(w, bits=2, group_size=-1, sym=False)
    # row 0: scale (3-0)/3 = 1, zero 0; row 1: scale 3/3 = 1, zero round(1/1) = 1
    assert packed.scales.float().flatten().tolist() == [1.0, 1.0]
    assert packed.zeros.flatten().tolist() == [0, 1]
    # 0.5 / 1 rounds half to even (0), plus zero 1 -> code 1
    assert packed.codes().tolist() == [[0, 1, 2, 3], [0, 1, 1, 3]]


@pytest.mark.parametrize("bits,group_size,sym", [(4, 128, False), (3, 128, False), (8, 32, True)])
def test_rtn_error_bounded_by_step(bits, group_size, sym):
    torch.manual_seed(0)
    w = torch.randn(48, 576) * 0.02  # 576 = 4.5 groups of 128: exercises the short last group
    packed = pack_weight(w, bits, group_size, sym)
    scale, _ = compute_qparams(w, bits, group_size, sym)
    step = scale.repeat_interleave(group_size, 1)[:, :576]
    rel = (packed.dequantize() - w).abs() / step
    # symmetric: the grid covers [-absmax, absmax], so rounding costs at most half a step
    # (1e-3 slack: the scale is rounded to fp16). Asymmetric: the integer zero point shifts
    # the grid by up to half a step, so an end value can lose one step.
    assert rel.max() <= (0.5 + 1e-3 if sym else 1.0 + 1e-3)
    # rounding error is ~uniform on [-step/2, step/2]: mean |e| = step/4
    assert 0.22 < rel.mean() < 0.28


def test_bad_bits_and_group_size_list_valid_choices():
    w = torch.randn(8, 64)
    with pytest.raises(
        QuantFormatError, match=r"bits=5 is not supported; valid choices: 2, 3, 4, 8"
    ):
        pack_weight(w, bits=5, group_size=32)
    with pytest.raises(QuantFormatError, match=r"group_size=48 .* -1, 32, 64, 128"):
        pack_weight(w, bits=4, group_size=48)
    with pytest.raises(ValueError, match="method='fp4'; valid choices: rtn, awq, gptq"):
        QuantConfig(method="fp4")
    with pytest.raises(QuantFormatError, match="bits=16"):
        QuantConfig(bits=16)


def test_packed_weight_rejects_mismatched_tensors():
    p = pack_weight(torch.randn(16, 64), 4, 32)
    with pytest.raises(QuantFormatError, match=r"scales has shape \(16, 3\)"):
        PackedWeight(p.qweight, torch.ones(16, 3, dtype=torch.float16), p.zeros, 4, 32, 64)


@pytest.mark.parametrize(
    "bits,group_size,backend",
    [
        (4, 128, "int4pack"),
        (4, -1, "int4pack"),
        (3, 64, "int4pack"),
        (8, -1, "int8pack"),
        (4, 128, "dequant"),
        (8, 32, "dequant"),
    ],
)
def test_quant_linear_matches_dequantised_matmul(bits, group_size, backend):
    torch.manual_seed(0)
    w = torch.randn(64, 576) * 0.02
    bias = torch.randn(64)
    packed = pack_weight(w, bits, group_size, sym=False)
    layer = QuantLinear.from_packed(packed, bias=bias, backend=backend)
    assert layer.resolved_backend() == backend
    x = torch.randn(2, 3, 576)
    if backend == "dequant":
        ref = x @ packed.dequantize().t() + bias
        # exact dequantisation, fp32 matmul: only summation order differs
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
        return
    # kernels take bf16 activations: compare with the same rounded activations; what is left
    # (the kernel's bf16 copies of the scales and zero offsets, bf16 outputs) is bf16 rounding,
    # 2^-8 relative, so the whole output must agree to ~1% in norm
    ref = x.bfloat16().float() @ packed.dequantize().t() + bias
    y = layer(x)
    assert y.dtype == torch.float32
    assert (y - ref).norm() / ref.norm() < 1e-2


def test_auto_backend_uses_kernels_for_decode_and_exact_dequant_for_prefill():
    layer = QuantLinear.from_packed(pack_weight(torch.randn(32, 128), 4, 32))
    assert layer.resolved_backend(rows=1) == "int4pack"
    assert layer.resolved_backend(rows=layer.kernel_max_rows + 1) == "dequant"
    x = torch.randn(40, 128)
    torch.testing.assert_close(layer(x), x @ layer.dequantize().t(), rtol=1e-5, atol=1e-5)
    assert layer(x[:1]).dtype == torch.float32


def test_int4_g128_linear_is_3_5x_smaller_than_fp16():
    layer = QuantLinear.from_packed(pack_weight(torch.randn(1536, 576), 4, 128))
    fp16 = 2 * 1536 * 576
    assert fp16 / layer.packed_nbytes() >= 3.5


def test_rtn_quantize_model_copies_and_replaces(tiny_model):
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    q8 = quantize_model(tiny_model, "rtn", bits=8, group_size=32)
    q4 = quantize_model(tiny_model, "rtn", bits=4, group_size=32)
    for k, v in tiny_model.state_dict().items():  # the input model is untouched
        assert torch.equal(v, before[k])
    assert len(quant_linears(q4)) == 7 * tiny_model.config.num_layers
    assert not isinstance(q4.lm_head, QuantLinear)
    tokens = torch.randint(0, 128, (2, 16))
    ref = tiny_model(tokens)
    err8 = (q8(tokens) - ref).pow(2).mean()
    err4 = (q4(tokens) - ref).pow(2).mean()
    assert err8 < err4 / 50  # 4 more bits: ~256x less weight MSE, keep a wide margin
    assert (
        compression_metadata(q4).quant_config.bits == 4
        and compression_metadata(q4).quant_report["seconds"] >= 0
    )
    sizes = model_nbytes(q4)
    assert sizes["quant_linear_fp16_bytes"] / sizes["quant_linear_bytes"] > 3.0


def test_model_to_bf16_keeps_the_packed_format(tiny_model):
    q = quantize_model(tiny_model, "rtn", bits=4, group_size=32)
    layer = q.layers[0].mlp.up_proj
    scales = layer.scales.clone()
    q16 = q.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and torch.equal(layer.scales, scales)
    assert layer.qweight.dtype == torch.uint8
    tokens = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        out = q16(tokens)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_module_selection_reads_the_spec_and_names_bad_entries(tiny_model):
    q = quantize_model(
        tiny_model, "rtn", bits=8, group_size=32, modules=("mlp.down_proj", "q_proj")
    )
    assert sorted(quant_linears(q)) == [
        f"layers.{i}.{n}" for i in range(2) for n in ("mlp.down_proj", "self_attn.q_proj")
    ]
    with pytest.raises(ValueError, match=r"modules=\['wq'\] are not linears of a llama block"):
        quantize_model(tiny_model, "rtn", modules=("wq",))
