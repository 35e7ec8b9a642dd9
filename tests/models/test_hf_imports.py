"""AWQ (GEMM) and GPTQ (v1, act-order) checkpoints load as QuantLinear with the checkpoint's
exact weights; llmopt's native quantized directory is refused by transformers."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

from llmopt.cli import main as cli_main
from llmopt.compress.quant.apply import quantize_model
from llmopt.compress.quant.autoawq import export_autoawq
from llmopt.compress.quant.io import save_quantized
from llmopt.models import build_model
from llmopt.models.loading import load_model, save_pretrained
from llmopt.models.packed.metadata import compression_metadata
from llmopt.models.packed.quant.directory import WEIGHTS, QuantFileError
from llmopt.models.packed.quant.hf import PermutedQuantLinear, QuantImportError
from llmopt.models.packed.quant.linear import QuantLinear
from llmopt.models.spec import spec_for
from tests.tiny_models import smol_config


def _fp16_exact(model: nn.Module) -> nn.Module:
    """Round float tensors to fp16 values, which AWQ/GPTQ files store the rest in."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


@pytest.fixture
def quantized(tiny_config):
    model = _fp16_exact(build_model(tiny_config.replace(tie_embeddings=True), seed=0).eval())
    return quantize_model(model, "rtn", bits=4, group_size=32)


def _layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def test_default_quantize_output_is_refused_by_transformers(tmp_path, quantized):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    other = tmp_path / "hf"
    save_pretrained(build_model(quantized.config, seed=1), other)  # someone's HF model
    with pytest.raises(QuantFileError, match="holds files llmopt did not write .* --overwrite"):
        save_quantized(quantized, other)  # replacing the directory would delete it
    out = tmp_path / "q"
    save_quantized(quantized, out)
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    # without model.safetensors the explicit class cannot fall back to a default config
    for cls in (AutoModelForCausalLM, LlamaForCausalLM):
        with pytest.raises((OSError, ValueError), match="config.json|model.safetensors"):
            cls.from_pretrained(out)
    tokens = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(load_model(out)(tokens), quantized(tokens))


def test_directories_from_before_the_rename_still_load(tmp_path, quantized):
    out = save_quantized(quantized, tmp_path / "q")
    (out / WEIGHTS).rename(out / "model.safetensors")
    meta = json.loads((out / "llmopt_quant.json").read_text())
    del meta["weights_file"]
    (out / "llmopt_quant.json").write_text(json.dumps(meta))
    tokens = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(load_model(out)(tokens), quantized(tokens))


@pytest.mark.parametrize("tied", [True, False])
def test_our_autoawq_export_loads_back_with_identical_logits(tmp_path, tiny_config, tied):
    model = _fp16_exact(build_model(tiny_config.replace(tie_embeddings=tied), seed=2).eval())
    q = quantize_model(model, "rtn", bits=4, group_size=32)
    export_autoawq(q, tmp_path / "awq")
    loaded = load_model(tmp_path / "awq")
    got, want = _layers(loaded), _layers(q)
    assert sorted(got) == sorted(want) and len(got) == 14
    for name, layer in got.items():
        assert torch.equal(layer.qweight, want[name].qweight)
        assert torch.equal(layer.zeros, want[name].zeros)
        assert torch.equal(layer.scales, want[name].scales)
    assert (
        compression_metadata(loaded).quant_config.method == "awq"
        and compression_metadata(loaded).quant_config.group_size == 32
    )
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), q(tokens))


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight: consecutive rows into one int32, low bits first (written independently)."""
    per = 32 // bits
    v = values.astype(np.uint32).reshape(values.shape[0] // per, per, values.shape[1])
    word = np.zeros((v.shape[0], v.shape[2]), dtype=np.uint32)
    for i in range(per):
        word |= v[:, i, :] << np.uint32(bits * i)
    return word.view(np.int32)


def _write_gptq(q: nn.Module, directory, desc_act: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPTQ v1 checkpoint of q's layers (with act-order: a random input order per layer).

    Returns each layer's float weight in the checkpoint's input order."""
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    state, weights = {}, {}
    for name, layer in _layers(q).items():
        codes = layer.packed().codes().numpy()  # [out, in], groups contiguous
        zeros = layer.zeros.numpy().astype(np.int64)  # [out, G]
        n_in, gs = layer.in_features, layer.group_size
        perm = rng.permutation(n_in) if desc_act else np.arange(n_in)
        q_in = np.zeros((n_in, layer.out_features), dtype=np.int64)
        q_in[perm] = codes.T
        g_idx = np.zeros(n_in, dtype=np.int32)
        g_idx[perm] = np.arange(n_in) // gs
        stored_zeros = (zeros.T - 1) & 0xF  # v1 stores zero - 1
        prefix = f"model.{name}"
        state[f"{prefix}.qweight"] = torch.from_numpy(_pack_rows(q_in, 4))
        state[f"{prefix}.qzeros"] = torch.from_numpy(_pack_rows(stored_zeros.T, 4).T.copy())
        state[f"{prefix}.scales"] = layer.scales.t().contiguous()
        state[f"{prefix}.g_idx"] = torch.from_numpy(g_idx)
        w = layer.dequantize()
        scattered = torch.empty_like(w)
        scattered[:, torch.from_numpy(perm)] = w
        weights[name] = scattered
    for name, tensor in q.state_dict().items():
        if name.rpartition(".")[0] not in weights and name != f"{spec_for(q).head}.weight":
            state[f"model.{name}"] = tensor.half()
    directory.mkdir()
    save_file(state, str(directory / "model.safetensors"))
    hf = q.config.to_hf_config()
    hf["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": desc_act,
        "sym": False,
        "checkpoint_format": "gptq",
    }
    (directory / "config.json").write_text(json.dumps(hf))
    return weights


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_v1_checkpoint_loads_with_its_weights(tmp_path, quantized, desc_act):
    weights = _write_gptq(quantized, tmp_path / "gptq", desc_act)
    loaded = load_model(tmp_path / "gptq")
    layers = _layers(loaded)
    assert sorted(layers) == sorted(weights)
    for name, layer in layers.items():
        assert isinstance(layer, PermutedQuantLinear) == desc_act
        assert torch.equal(layer.dequantize(), weights[name])
    reference = copy.deepcopy(quantized)
    for name, w in weights.items():
        parent, _, attr = name.rpartition(".")
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        setattr(reference.get_submodule(parent), attr, linear)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), reference(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"bits": 3}, QuantImportError, "GPTQ bits=3 is not supported"),
        ({"checkpoint_format": "marlin"}, QuantImportError, "'marlin' is not supported"),
        ({"group_size": 48}, QuantImportError, "group_size=48 is not supported"),
        ({"quant_method": "bitsandbytes"}, ValueError, "'bitsandbytes' cannot be loaded.*awq"),
    ],
)
def test_unreadable_quantization_settings_are_refused(tmp_path, quantized, change, error, message):
    _write_gptq(quantized, tmp_path / "g", desc_act=False)
    hf = json.loads((tmp_path / "g" / "config.json").read_text())
    hf["quantization_config"].update(change)
    (tmp_path / "g" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(error, match=message):
        load_model(tmp_path / "g")


def test_gptq_g_idx_with_unequal_groups_is_refused(tmp_path, quantized):
    from safetensors.torch import load_file, save_file

    _write_gptq(quantized, tmp_path / "g", desc_act=True)
    state = load_file(tmp_path / "g" / "model.safetensors")
    name = next(k for k in state if k.endswith(".g_idx"))
    state[name][:3] = 0  # group 0 gets three extra inputs
    save_file(state, str(tmp_path / "g" / "model.safetensors"))
    with pytest.raises(QuantImportError, match="g_idx does not give every group exactly 32"):
        load_model(tmp_path / "g")


def test_eval_kl_reads_an_awq_directory(tmp_path, capsys, smollm2_tokenizer):
    config = smol_config("smollm-vocab", tie_embeddings=True)
    model = _fp16_exact(build_model(config, seed=0).eval())
    tokenizer = smollm2_tokenizer
    save_pretrained(model, tmp_path / "ref", tokenizer)
    export_autoawq(quantize_model(model, "rtn", bits=4, group_size=32), tmp_path / "awq", tokenizer)
    argv = ["eval", "kl", "--model", str(tmp_path / "awq"), "--ref", str(tmp_path / "ref")]
    assert cli_main([*argv, "--ctx", "64", "--max-tokens", "128", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] > 0 and 0 < result["mean"] < 0.5
