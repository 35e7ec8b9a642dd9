"""GPTQ v1 export: our reader of the documented layout and transformers (+GPTQModel) load it.

Layout reference: GPTQModel's `PackableQuantLinear.pack` / `dequantize_weight`
(ModelCloud/GPTQModel, gptqmodel/nn_modules/qlinear/__init__.py, release 7.6.0 as installed
here) and AutoGPTQ's `QuantLinear.pack` (AutoGPTQ/AutoGPTQ, auto_gptq/nn_modules/qlinear/
qlinear_cuda_old.py): qweight packs 32/bits input rows per int32 (row j at bit j*bits), qzeros
packs zero-1 along the output axis, scales [groups, out], g_idx [in].
"""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.compress.quant.apply import quantize_model
from llmopt.export import ExportError, export_gptq
from llmopt.export.gptq import dequantize_gptq, pack_rows, unpack_rows
from llmopt.models.hf import ours_to_hf
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.quant.linear import QuantLinear
from tests.export_fixtures import PROMPT, tiny_llama


def _quantized(bits: int, group: int, sym: bool = True, method: str = "rtn"):
    cfg = QuantConfig(method=method, bits=bits, group_size=group, sym=sym)
    return quantize_model(tiny_llama(), config=cfg)


def test_pack_rows_bit_positions():
    values = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [15]])
    word = pack_rows(values, 4)
    assert word.shape == (1, 1)
    assert int(word) & 0xFFFFFFFF == 0xF7654321  # row j in bits 4j..4j+3
    assert torch.equal(unpack_rows(word, 4), values)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64), (2, -1), (4, 64)])
def test_gptq_layout_reads_back_exactly(tmp_path, bits, group):
    from safetensors.torch import load_file

    qmodel = _quantized(bits, group)
    out = export_gptq(qmodel, tmp_path / "g")
    qcfg = json.loads((out / "quantize_config.json").read_text())
    assert qcfg == json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qcfg["bits"], qcfg["group_size"], qcfg["desc_act"], qcfg["sym"]) == (
        bits,
        group,
        False,
        True,
    )
    files = load_file(out / "model.safetensors")
    for name, layer in qmodel.named_modules():
        if not isinstance(layer, QuantLinear):
            continue
        prefix = ours_to_hf(name) + "."
        tensors = {k[len(prefix) :]: v for k, v in files.items() if k.startswith(prefix)}
        groups = 1 if group == -1 else layer.in_features // group
        assert tensors["qweight"].shape == (layer.in_features * bits // 32, layer.out_features)
        assert tensors["qzeros"].shape == (groups, layer.out_features * bits // 32)
        assert tensors["scales"].shape == (groups, layer.out_features)
        assert tensors["g_idx"].dtype == torch.int32
        assert torch.equal(dequantize_gptq(tensors, bits), layer.dequantize(torch.float32))


def test_gptq_method_output_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    cfg = QuantConfig(method="gptq", bits=4, group_size=32, sym=True)
    qmodel = quantize_model(tiny_llama(), config=cfg, calib_tokens=calib)
    for layer in qmodel.modules():
        if isinstance(layer, QuantLinear):
            layer.backend = "dequant"
    out = export_gptq(qmodel, tmp_path / "g", dtype="fp32")
    ref = AutoModelForCausalLM.from_pretrained(out, device_map="cpu").eval()
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        diff = (ref(tokens).logits.float() - qmodel(tokens)).abs().max().item()
    # GPTQModel picks its CPU kernel (TorchAtenLinear: torch's int4 matmul in bf16), so ~1% of
    # logits up to ~2.3 is expected; a wrong nibble order or zero convention gives O(1)
    assert diff < 5e-2, diff


def test_gptq_refusals(tmp_path):
    with pytest.raises(ExportError, match="GPTQ export holds bits"):
        export_gptq(_quantized(3, 32), tmp_path / "a")
    qmodel = _quantized(4, 32, sym=False)
    layer = next(m for m in qmodel.modules() if isinstance(m, QuantLinear))
    layer.zeros[0, 0] = 0
    with pytest.raises(ExportError, match="zero point of 0"):
        export_gptq(qmodel, tmp_path / "b")
    assert not (tmp_path / "b").exists()
