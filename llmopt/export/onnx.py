"""ONNX export with KV-cache inputs and outputs (onnxruntime, TensorRT's ONNX parser).

The graph takes `input_ids` [batch, seq] and, per layer, `past_key_values.{i}.key/value`
[batch, kv_heads, past, head_dim] (past may be 0 for the prefill), and returns `logits`
[batch, seq, vocab] and `present.{i}.key/value` with past + seq positions: optimum's names,
without padding masks (every row of a batch has the same length). Positions start at `past`.

The traced forward is written here, from the modules the ModelSpec names, instead of tracing
`Transformer.forward`: that one branches in Python on cache lengths (fast paths), which a
graph with a symbolic past length cannot hold. Quantized linears are dequantised first.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.export.output import check_output, staged_directory
from llmopt.export.tensors import checked, dense_state_dict, float_dtype


class KVDecoder(nn.Module):
    """(input_ids, past k/v per layer) -> (logits, present k/v per layer) for one dense model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        from llmopt.models.features import require_llama_block
        from llmopt.models.spec import spec_for

        require_llama_block(model.config, "ONNX export", windows=True)

        spec = spec_for(model)
        self.model, self.spec, self.config = model, spec, model.config
        qkv = next(g for g in spec.fused if len(g.parts) == 3)
        self.qkv_names = qkv.parts
        attn = spec.attention + "."
        self.out_name = next(n for n in spec.row_parallel if n.startswith(attn))
        # the feed-forward module: the parent of the row-parallel linear outside attention
        ffn_out = next(n for n in spec.row_parallel if not n.startswith(attn))
        self.ffn_name = ffn_out.rsplit(".", 1)[0]

    def _attention(self, block: nn.Module, x, cos, sin, past_k, past_v):
        from llmopt.models.llama import apply_rope

        cfg, spec = self.config, self.spec
        b, t, _ = x.shape
        q, k, v = (spec.block_module(block, n)(x) for n in self.qkv_names)
        q = q.view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        groups = cfg.num_heads // cfg.num_kv_heads
        keys, values = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) / math.sqrt(cfg.head_dim)
        s = k.shape[2]
        query_pos = torch.arange(t, device=x.device) + (s - t)
        key_pos = torch.arange(s, device=x.device)
        visible = key_pos[None, :] <= query_pos[:, None]
        if cfg.sliding_window is not None and spec.sliding_window:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - cfg.sliding_window)
        scores = scores.masked_fill(~visible, float("-inf"))
        attn = torch.matmul(torch.softmax(scores, dim=-1).to(x.dtype), values)
        out = spec.block_module(block, self.out_name)(attn.transpose(1, 2).reshape(b, t, -1))
        return out, k, v

    def forward(self, input_ids: torch.Tensor, *past: torch.Tensor):
        spec, model = self.spec, self.model
        t = input_ids.shape[1]
        past_len = past[0].shape[2]
        positions = torch.arange(t, device=input_ids.device) + past_len
        x = spec.top_module(model, "embedding")(input_ids)
        cos = model.rotary.cos[positions].to(x.dtype)
        sin = model.rotary.sin[positions].to(x.dtype)
        norm_in, norm_post = spec.block_norms
        presents = []
        for i, (_, block) in enumerate(spec.named_blocks(model)):
            h = spec.block_module(block, norm_in)(x)
            out, k, v = self._attention(block, h, cos, sin, past[2 * i], past[2 * i + 1])
            x = x + out
            x = x + spec.block_module(block, self.ffn_name)(spec.block_module(block, norm_post)(x))
            presents += [k, v]
        x = spec.top_module(model, "final_norm")(x)
        return (spec.top_module(model, "head")(x), *presents)


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    return ["input_ids", *past], ["logits", *present]


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
    dtype: str = "fp32",
    source: str | Path | None = None,
    opset: int = 18,
    overwrite: bool = False,
) -> Path:
    """Write `model.onnx` (+ config.json, tokenizer files) into the directory `out`;
    `overwrite`: an `out` holding other files gets only this export's files replaced."""
    import json

    from llmopt.artifacts import atomic_write_text

    torch_dtype = float_dtype(dtype)
    out = check_output(out, source, KIND, overwrite)
    cfg = model.config
    decoder = KVDecoder(dense_copy(model, torch_dtype)).eval()
    inputs, outputs = io_names(cfg.num_layers)
    ids = torch.zeros(1, 3, dtype=torch.long)
    past = [
        torch.zeros(1, cfg.num_kv_heads, 2, cfg.head_dim, dtype=torch_dtype)
        for _ in range(2 * cfg.num_layers)
    ]
    from torch.export import Dim

    batch, seq, past_len = (
        Dim("batch", max=1024),
        Dim("seq", max=cfg.max_seq_len),
        Dim("past", max=cfg.max_seq_len),
    )
    shapes = ({0: batch, 1: seq}, tuple({0: batch, 2: past_len} for _ in past))  # *past
    with staged_directory(out, KIND, overwrite) as stage, torch.no_grad():
        torch.onnx.export(
            decoder,
            (ids, *past),
            str(stage / "model.onnx"),
            input_names=inputs,
            output_names=outputs,
            dynamic_shapes=shapes,
            opset_version=opset,
            dynamo=True,
            verbose=False,
            external_data=False,
        )
        hf = cfg.to_hf_config()
        hf["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
        atomic_write_text(stage / "config.json", json.dumps(hf, indent=2))
        if tokenizer is not None:
            tokenizer.save(stage)
    return out
