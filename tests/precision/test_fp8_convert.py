"""convert_to_fp8 on the Llama model: what is swapped, what is kept, and the failure modes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmopt.models import build_model
from llmopt.precision import fp8
from llmopt.precision.fp8 import (
    Float8Linear,
    Fp8Error,
    Fp8UnsupportedError,
    convert_to_fp8,
    fp8_modules,
)
from llmopt.precision.fp8 import linear as fp8_linear


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def test_convert_swaps_exactly_the_block_linears(tiny_config):
    model = build_model(tiny_config, seed=0)
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())
    convert_to_fp8(model, "delayed")
    converted = fp8_modules(model)
    assert sorted(converted) == sorted(
        f"layers.{i}.{part}.{n}_proj"
        for i in range(tiny_config.num_layers)
        for part, names in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for n in names
    )
    assert len(converted) == 7 * tiny_config.num_layers
    # high precision everywhere else
    assert type(model.lm_head) is nn.Linear
    assert type(model.embed_tokens) is nn.Embedding
    assert all(type(b.input_layernorm).__name__ == "RMSNorm" for b in model.layers)
    # the master weights are the very same fp32 Parameters, and checkpoints keep their keys
    after = dict(model.named_parameters())
    assert after.keys() == params_before.keys()
    assert all(after[k] is params_before[k] for k in after)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert list(model.state_dict()) == keys_before
    assert all(m.recipe == fp8.DelayedScaling() for m in converted.values())


def test_converted_model_loss_and_grads_close_to_high_precision(tiny_config):
    torch.manual_seed(0)
    tokens = torch.randint(0, tiny_config.vocab_size, (4, 33))
    ref = build_model(tiny_config, seed=0)
    model = convert_to_fp8(build_model(tiny_config, seed=0), "current")
    ref_loss, loss = _loss(ref, tokens), _loss(model, tokens)
    ref_loss.backward()
    loss.backward()
    # FP8 noise in 14 GEMMs moves the loss of a random-init model by well under 1%
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 0.01
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        err = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert err < 0.15, f"{name}: grad rel err {err:.3f}"


def test_skip_patterns_keep_layers_in_high_precision(tiny_config):
    model = convert_to_fp8(build_model(tiny_config, seed=0), skip=["layers.0.*", "*.down_proj"])
    names = sorted(fp8_modules(model))
    assert names == sorted(
        f"layers.1.{p}"
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        )
    )
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear
    with pytest.raises(Fp8Error, match="found no block linear layers"):
        convert_to_fp8(build_model(tiny_config, seed=0), skip=["layers.*"])


def test_bad_shapes_fail_clearly_or_are_kept(tiny_config):
    cfg = tiny_config.replace(intermediate_size=72)  # MLP dims not multiples of 16
    with pytest.raises(Fp8Error, match=r"layers.0.mlp.gate_proj: out_features=72 not a multi"):
        convert_to_fp8(build_model(cfg, seed=0))
    model = convert_to_fp8(build_model(cfg, seed=0), on_bad_shape="keep")
    assert len(fp8_modules(model)) == 4 * cfg.num_layers  # only attention converted
    assert type(model.layers[1].mlp.down_proj) is nn.Linear
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    _loss(model, tokens).backward()
    with pytest.raises(Fp8Error, match="on_bad_shape='drop' is not supported"):
        convert_to_fp8(build_model(cfg, seed=0), on_bad_shape="drop")


def test_bad_dtype_fails_clearly(tiny_config):
    model = build_model(tiny_config, seed=0, dtype=torch.float64)
    with pytest.raises(Fp8Error, match="weight dtype torch.float64 cannot be an FP8 master"):
        convert_to_fp8(model)


def test_unsupported_device_errors_or_emulates(tiny_config, monkeypatch):
    meta = build_model(tiny_config, seed=None, device="meta")
    with pytest.raises(Fp8UnsupportedError, match="no FP8 GEMM on device type 'meta'"):
        convert_to_fp8(meta)
    with pytest.raises(Fp8Error, match="fallback='cpu' is not supported"):
        convert_to_fp8(meta, fallback="cpu")

    # A torch without a CPU FP8 GEMM: error by default, exact emulation when asked.
    monkeypatch.setattr(fp8_linear, "_cpu_scaled_mm_error", lambda: "torch 2.3 has no CPU FP8 GEMM")
    with pytest.raises(Fp8UnsupportedError, match="torch 2.3 has no CPU FP8 GEMM; pass fallback"):
        convert_to_fp8(build_model(tiny_config, seed=0))
    emulated = convert_to_fp8(build_model(tiny_config, seed=0), fallback="emulate")
    assert {m.gemm for m in fp8_modules(emulated).values()} == {"emulated"}
    monkeypatch.undo()
    real = convert_to_fp8(build_model(tiny_config, seed=0))
    assert {m.gemm for m in fp8_modules(real).values()} == {"scaled_mm"}
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 17))
    a, b = _loss(emulated, tokens), _loss(real, tokens)
    assert torch.allclose(a, b, rtol=1e-5)


def test_cuda_support_reason_matches_build():
    reason = fp8.fp8_gemm_unsupported_reason("cuda")
    if not torch.cuda.is_available():
        assert reason == "CUDA is not available in this torch build"
    else:
        cap = torch.cuda.get_device_capability()
        assert (reason is None) == (cap >= (8, 9))
    assert fp8.fp8_gemm_unsupported_reason("cpu") is None  # torch 2.13 CPU has _scaled_mm


@pytest.mark.slow
def test_converted_model_trains_in_bf16_autocast(tiny_config):
    torch.manual_seed(0)
    model = convert_to_fp8(build_model(tiny_config, seed=0), "delayed")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, tiny_config.vocab_size, (4, 17))
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5  # memorising one batch: the loss must fall
    assert isinstance(model.layers[0].mlp.up_proj, Float8Linear)
