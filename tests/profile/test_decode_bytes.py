"""The one eager decode-bytes definition: every weight once, packed state as stored."""

from __future__ import annotations

import dataclasses

from llmopt.compress.quant import quantize_model
from llmopt.models import build_model
from llmopt.models.packed.quant.linear import QuantLinear
from llmopt.profile.decode_bytes import eager_decode_bytes


def _param_bytes(model) -> int:
    unique = {p.data_ptr(): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


def test_a_float_model_reads_each_parameter_once_and_no_rotary_table(tiny_config):
    tied = build_model(dataclasses.replace(tiny_config, tie_embeddings=True), seed=0)
    untied = build_model(dataclasses.replace(tiny_config, tie_embeddings=False), seed=0)
    assert eager_decode_bytes(tied) == _param_bytes(tied)
    head = tiny_config.vocab_size * tiny_config.hidden_size * 4
    assert eager_decode_bytes(untied) == eager_decode_bytes(tied) + head


def test_a_quantized_model_reads_the_packed_codes_not_the_float_weights(tiny_model):
    q = quantize_model(tiny_model, "rtn", bits=4, group_size=32)
    linears = [m for m in q.modules() if isinstance(m, QuantLinear)]
    packed = sum(m.packed_nbytes() for m in linears)
    rest = _param_bytes(q)  # the float parameters left (embedding, norms, biases)
    assert eager_decode_bytes(q) == packed + rest - sum(
        m.bias.numel() * m.bias.element_size() for m in linears if m.bias is not None
    )
    assert eager_decode_bytes(q) < eager_decode_bytes(tiny_model) / 3
