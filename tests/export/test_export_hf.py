"""HF export: transformers' AutoModelForCausalLM loads the directory and matches our logits."""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.export import ExportError, export_hf
from tests.export_fixtures import PROMPT, smollm_tokenizer, tiny_llama


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_export_loads_in_transformers_with_equal_logits(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    kw = {"architecture": arch, "attention_bias": arch == "qwen2"}
    model = tiny_llama(**kw)
    out = export_hf(model, tmp_path / "hf", smollm_tokenizer())
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        [
            "config.json",
            "generation_config.json",
            "llmopt_output.json",  # the record that lets a later export replace this one
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    ref = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        theirs = ref(tokens).logits
        ours = model(tokens)
    assert torch.allclose(theirs, ours, atol=1e-4), (theirs - ours).abs().max()


def test_hf_export_fp16_and_quantized_model_dequantised(tmp_path):
    from transformers import AutoModelForCausalLM

    from llmopt.compress.quant.apply import quantize_model
    from llmopt.models.packed.quant.config import QuantConfig

    model = tiny_llama()
    qmodel = quantize_model(model, config=QuantConfig(method="rtn", bits=4, group_size=32))
    for module in qmodel.modules():
        if hasattr(module, "backend"):
            module.backend = "dequant"  # exact fp32 reference, not the bf16 decode kernel
    out = export_hf(qmodel, tmp_path / "q", dtype="fp16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    ref = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        diff = (ref(tokens).logits - qmodel(tokens)).abs().max()
    # the exported weights are the dequantised ones, rounded once more to fp16
    assert diff < 5e-3, diff


def test_hf_export_refuses_output_equal_to_input_and_bad_dtype(tmp_path):
    model = tiny_llama()
    src = export_hf(model, tmp_path / "m")
    with pytest.raises(ExportError, match="would overwrite the input"):
        export_hf(model, src, source=src)
    with pytest.raises(ExportError, match=r"dtype='int3' is not supported; valid choices"):
        export_hf(model, tmp_path / "x", dtype="int3")
    assert not (tmp_path / "x").exists()


def test_hf_export_refuses_nan_and_leaves_no_partial_output(tmp_path):
    model = tiny_llama()
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(ExportError, match="NaN or inf"):
        export_hf(model, tmp_path / "nan")
    assert list(tmp_path.iterdir()) == []


def test_hf_export_shards_with_an_index_at_the_umask(tmp_path):
    """Past max_shard_size the weights are split as transformers splits them, with
    model.safetensors.index.json; transformers and our loader read the shards; every file
    follows the umask (safetensors itself writes 0600)."""
    import os

    from transformers import AutoModelForCausalLM

    from llmopt.models.loading import load_model

    model = tiny_llama(eos_token_ids=(2, 3))  # ~0.2 MB of fp32 weights
    old = os.umask(0o027)
    try:
        out = export_hf(model, tmp_path / "hf", smollm_tokenizer(), max_shard_size="60KB")
    finally:
        os.umask(old)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    assert not (out / "model.safetensors").exists()
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o640)}
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 3]
    tokens = torch.tensor([PROMPT])
    ref = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(ref(tokens).logits, model(tokens), atol=1e-4)
        assert torch.equal(load_model(out)(tokens), model(tokens))
    with pytest.raises(ExportError, match="max_shard_size='5 parsecs' is not a size"):
        export_hf(model, tmp_path / "bad", max_shard_size="5 parsecs")
    with pytest.raises(ExportError, match="max_shard_size=0 must be positive"):
        export_hf(model, tmp_path / "bad", max_shard_size=0)
