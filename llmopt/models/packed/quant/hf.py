"""Read AutoAWQ (GEMM) and GPTQ (v1/v2 layout) checkpoints into `QuantLinear` layers.

Both formats store int32-packed codes, zero points and fp16 scales per (group, output); they
differ in the packing axis and nibble order:
- AWQ GEMM: `qweight` [in, out/8] and `qzeros` [groups, out/8], 8 output columns per int32 in
  the interleaved order `AWQ_ORDER`; `scales` [groups, out].
- GPTQ: `qweight` [in*bits/32, out] packs consecutive *input* rows, `qzeros`
  [groups, out*bits/32] consecutive outputs, both low bits first; the v1 layout stores zero - 1.
  `g_idx` [in] names each input's group: with `desc_act` the groups are not contiguous, so the
  inputs are sorted by group and the layer permutes its input (`PermutedQuantLinear`).
W[o, i] = (q[i, o] - z[g(i), o]) * s[g(i), o] in both. Repacking is exact: the loaded model
computes from the very codes and fp16 scales of the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmopt.errors import LlmoptError
from llmopt.models.packed.metadata import CompressionMetadata, set_compression_metadata
from llmopt.models.packed.quant.config import QuantConfig
from llmopt.models.packed.quant.format import (
    VALID_GROUP_SIZES,
    PackedWeight,
    num_groups,
    pack_codes,
)
from llmopt.models.packed.quant.linear import QuantLinear, retie_head
from llmopt.models.spec import spec_for

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order of 8 nibbles in an int32

PACKED_KEYS = ("qweight", "qzeros", "scales", "g_idx")


class QuantImportError(LlmoptError, ValueError):
    """An AWQ/GPTQ checkpoint llmopt cannot represent (or a malformed one)."""


class PermutedQuantLinear(QuantLinear):
    """A QuantLinear whose inputs are first reordered (GPTQ act-order): y = x[..., perm] W'^T,
    with W' the weight's columns sorted by group so every group is contiguous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("in_perm", torch.arange(self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.index_select(-1, self.in_perm))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in the checkpoint's (unsorted) input order."""
        sorted_w = super().dequantize(dtype)
        out = torch.empty_like(sorted_w)
        out[:, self.in_perm] = sorted_w
        return out


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] = ()):
    """int32 words -> one code per value along `dim` (low bits first; `order` = AWQ's)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).unsqueeze(-1)
    vals = (words >> shifts) & (2**bits - 1)  # [..., per]; arithmetic shift, then masked
    if order:
        vals = vals[..., list(torch.tensor(order).argsort())]
    if dim == 0:  # consecutive rows share a word
        rows, cols = packed.shape
        return vals.permute(0, 2, 1).reshape(rows * per, cols)
    return vals.reshape(packed.shape[0], -1)


def _settings(qc: dict[str, Any], method: str) -> tuple[int, int, bool]:
    """(bits, group_size, zeros stored minus one) after checking the variant is readable."""
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4:
            raise QuantImportError(
                f"AWQ version={version!r} bits={bits!r} is not supported; llmopt reads 4-bit GEMM"
            )
        if qc.get("zero_point") is False:
            raise QuantImportError("AWQ zero_point=False checkpoints are not supported")
        offset = False
    else:
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantImportError(
                f"GPTQ checkpoint_format={fmt!r} is not supported; llmopt reads 'gptq', 'gptq_v2'"
            )
        if bits not in (2, 4, 8):
            raise QuantImportError(f"GPTQ bits={bits!r} is not supported; valid: 2, 4, 8")
        offset = fmt == "gptq"
    if group not in VALID_GROUP_SIZES:
        raise QuantImportError(
            f"{method} group_size={group!r} is not supported; valid: "
            + ", ".join(map(str, VALID_GROUP_SIZES))
        )
    return bits, group, offset


def build_layer(
    name: str, parts: dict[str, torch.Tensor], method: str, qc: dict[str, Any]
) -> QuantLinear:
    """One QuantLinear (or PermutedQuantLinear) from a module's packed checkpoint tensors."""
    bits, group, zero_offset = _settings(qc, method)
    missing = [k for k in ("qweight", "qzeros", "scales") if k not in parts]
    if missing:
        raise QuantImportError(f"{name} lacks {', '.join(missing)}")
    scales = parts["scales"].to(torch.float16)  # [groups, out]
    out_f = scales.shape[1]
    if method == "awq":
        codes = unpack_int32(parts["qweight"], 4, dim=1, order=AWQ_ORDER)  # [in, out]
        zeros = unpack_int32(parts["qzeros"], 4, dim=1, order=AWQ_ORDER)
        g_idx = None
    else:
        codes = unpack_int32(parts["qweight"], bits, dim=0)
        zeros = unpack_int32(parts["qzeros"], bits, dim=1)
        if zero_offset:
            zeros = (zeros + 1) & (2**bits - 1)
        g_idx = parts.get("g_idx")
    in_f = codes.shape[0]
    groups = num_groups(in_f, group)
    if (
        codes.shape[1] != out_f
        or tuple(zeros.shape) != (groups, out_f)
        or scales.shape[0] != groups
    ):
        raise QuantImportError(
            f"{name}: qweight {tuple(parts['qweight'].shape)}, qzeros "
            f"{tuple(parts['qzeros'].shape)} and scales {tuple(scales.shape)} do not describe "
            f"one {bits}-bit layer with group_size={group}"
        )
    if not torch.isfinite(scales).all():
        raise QuantImportError(f"{name}: scales hold NaN or inf")
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        contiguous = torch.arange(in_f) // (in_f if group == -1 else group)
        if g_idx.shape != (in_f,):
            raise QuantImportError(f"{name}: g_idx has shape {tuple(g_idx.shape)}, need ({in_f},)")
        if not torch.equal(g_idx, contiguous):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], contiguous):
                raise QuantImportError(
                    f"{name}: g_idx does not give every group exactly {group} inputs"
                )
            codes = codes[perm]
    packed = PackedWeight(
        qweight=pack_codes(codes.t().to(torch.uint8).contiguous(), bits),
        scales=scales.t().contiguous(),
        zeros=zeros.t().to(torch.uint8).contiguous(),
        bits=bits,
        group_size=group,
        in_features=in_f,
    )
    bias = parts.get("bias")
    layer = (PermutedQuantLinear if perm is not None else QuantLinear).from_packed(packed, bias)
    if perm is not None:
        layer.in_perm.copy_(perm)
    return layer


def load_hf_quantized(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> nn.Module:
    """A HF directory whose config.json has an AWQ or GPTQ `quantization_config`."""
    from llmopt.models.hf import drop_rotary_buffers, iter_tensors, quant_method, read_config
    from llmopt.models.llama import RotaryEmbedding, Transformer

    directory = Path(path)
    hf = json.loads((directory / "config.json").read_text())
    method = quant_method(directory)
    if method not in ("awq", "gptq"):
        raise QuantImportError(f"quant_method={method!r}; llmopt imports 'awq' and 'gptq'")
    qc = hf["quantization_config"]
    config = read_config(directory)
    packed: dict[str, dict[str, torch.Tensor]] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in drop_rotary_buffers(iter_tensors(directory, dtype), config, str(path)):
        module, _, key = name.rpartition(".")
        if key in PACKED_KEYS or (key == "bias" and module in packed):
            packed.setdefault(module, {})[key] = tensor
        else:
            plain[name] = tensor
    for module in list(packed):  # a bias read before its module's qweight
        if f"{module}.bias" in plain:
            packed[module]["bias"] = plain.pop(f"{module}.bias")
    if not packed:
        raise QuantImportError(f"{directory} declares {method} but holds no qweight tensors")
    with torch.device("meta"):
        model = Transformer(config)
    bits, group, _ = _settings(qc, method)
    for name, parts in packed.items():
        try:
            target = model.get_submodule(name)
        except AttributeError:
            raise QuantImportError(f"{directory}: {name!r} is not a module of the model") from None
        layer = build_layer(name, parts, method, qc)
        if (layer.out_features, layer.in_features) != tuple(target.weight.shape):
            raise QuantImportError(
                f"{name}: packed weight is {layer.out_features}x{layer.in_features}, the config "
                f"implies {tuple(target.weight.shape)}"
            )
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    expected = {n: t for n, t in model.state_dict().items() if n.rpartition(".")[0] not in packed}
    head = spec_for(model).head
    if config.tie_embeddings and head not in packed:  # the head is the embedding
        expected.pop(f"{head}.weight", None)
        plain.pop(f"{head}.weight", None)
    for name, tensor in plain.items():
        if name not in expected or tuple(tensor.shape) != tuple(expected[name].shape):
            raise QuantImportError(f"{directory}: unexpected tensor {name!r} {tuple(tensor.shape)}")
    missing = sorted(set(expected) - set(plain))
    if missing:
        raise QuantImportError(f"{directory} lacks tensors {missing[:4]}")
    model.load_state_dict(plain, strict=False, assign=True)
    retie_head(model)
    model.rotary = RotaryEmbedding(config)
    model = model.to(device).eval()
    quant_config = QuantConfig(method=method, bits=bits, group_size=group)
    set_compression_metadata(model, CompressionMetadata(quant_config=quant_config))
    return model
