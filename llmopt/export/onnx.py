"""ONNX export with KV-cache inputs and outputs (onnxruntime, TensorRT's ONNX parser).

The graph is the model's own forward (the one forward of every path) with the past/present
attention backend (`llmopt.models.attention.past`), so every registered architecture exports
with its features (windows, q/k norms, soft-capping, sandwich norms). optimum's contract:
inputs `input_ids` [batch, seq], `attention_mask` [batch, past + seq] (0 marks padding),
`position_ids` [batch, seq] and per layer `past_key_values.{i}.key/value`
[batch, kv_heads, past, head_dim] (past may be 0 for the prefill); outputs `logits`
[batch, seq, vocab] and `present.{i}.key/value` with past + seq positions. Quantized linears
are dequantised first. Weights past 2 GB go to an external data file (protobuf's limit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.export.output import ExportError, check_output, staged_directory
from llmopt.export.tensors import checked, dense_state_dict, float_dtype
from llmopt.models.attention.past import PastKeyValues

# protobuf refuses messages of 2 GiB; stay clear of it with the graph's own bytes
EXTERNAL_DATA_BYTES = 1_800_000_000


class KVDecoder(nn.Module):
    """(input_ids, attention_mask, position_ids, past k/v per layer) -> (logits, presents)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past: torch.Tensor):
        attn = PastKeyValues(list(past), attention_mask, position_ids)
        logits = self.model(input_ids, attn)
        return (logits, *attn.presents)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def dense_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A float `Transformer` with the model's (dequantised) weights in `dtype`."""
    from llmopt.models.loading import model_from_tensors

    state = checked(dense_state_dict(model, torch.float32))
    dense = model_from_tensors(model.config, state.items(), source="export")
    return dense.to(dtype).eval()


KIND = "export:onnx"  # llmopt.output_dir


def export_onnx(
    model: nn.Module,
    out: str | Path,
    tokenizer: Any = None,
    *,
    dtype: str = "float32",
    source: str | Path | None = None,
    opset: int = 18,
    external_data: bool | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `model.onnx` (+ config.json, tokenizer files) into the directory `out`.

    `external_data`: weights in `model.onnx.data` beside the graph (None: when they exceed
    what one protobuf file may hold). `overwrite`: an `out` holding other files gets only
    this export's files replaced."""
    import json

    from llmopt.artifacts import atomic_write_text

    torch_dtype = float_dtype(dtype)
    cfg = model.config
    if getattr(cfg, "moe", None) is not None:
        raise ExportError(
            f"ONNX export of mixture-of-experts models ({cfg.architecture!r}) is not supported: "
            "dropless routing has data-dependent shapes torch.export cannot trace; export it as "
            "safetensors (`llmopt export --format hf`)"
        )
    out = check_output(out, source, KIND, overwrite)
    dense = dense_copy(model, torch_dtype)
    decoder = KVDecoder(dense).eval()
    inputs, outputs = io_names(cfg.num_layers)
    kv_heads, k_dim, v_dim = dense.kv_layout()
    ids = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.ones(2, 5, dtype=torch.long)
    positions = torch.arange(2, 5)[None].repeat(2, 1)
    past = [
        torch.zeros(2, kv_heads, 2, dim, dtype=torch_dtype)
        for _ in range(cfg.num_layers)
        for dim in (k_dim, v_dim)
    ]
    if external_data is None:
        external_data = sum(p.numel() * p.element_size() for p in dense.parameters()) > (
            EXTERNAL_DATA_BYTES
        )
    from torch.export import Dim

    batch, seq, past_len = (
        Dim("batch", max=1024),
        Dim("seq", max=cfg.max_seq_len),
        Dim("past", max=cfg.max_seq_len),
    )
    total = Dim("total", max=2 * cfg.max_seq_len)  # past + seq (the tracer keeps it apart)
    shapes = (
        {0: batch, 1: seq},
        {0: batch, 1: total},
        {0: batch, 1: seq},
        tuple({0: batch, 2: past_len} for _ in past),  # *past
    )
    with staged_directory(out, KIND, overwrite) as stage, torch.no_grad():
        torch.onnx.export(
            decoder,
            (ids, mask, positions, *past),
            str(stage / "model.onnx"),
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=shapes,
            opset_version=opset,
            dynamo=True,
            verbose=False,
            external_data=external_data,
        )
        hf = cfg.to_hf_config()
        hf["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
        atomic_write_text(stage / "config.json", json.dumps(hf, indent=2))
        if tokenizer is not None:
            tokenizer.save(stage)
    return out
