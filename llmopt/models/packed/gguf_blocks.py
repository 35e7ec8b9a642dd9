"""GGML quantized blocks -> codes, scales and mins, without dequantizing.

Block layouts follow ggml-common.h (as read by the `gguf` package's reference dequantizers):
- Q4_0 (18 B / 32): fp16 d, 16 bytes of nibbles (byte j: column j low, j + 16 high); w = d (q - 8)
- Q4_1 (20 B / 32): fp16 d, fp16 m, nibbles as Q4_0; w = d q + m
- Q8_0 (34 B / 32): fp16 d, 32 int8 q; w = d q (stored here as q + 128 with zero point 128)
- Q4_K (144 B / 256): fp16 d, fp16 dmin, 12 bytes of 6-bit sub-scales/mins, 128 bytes of
  nibbles (32-byte group g: low nibbles sub-block 2g, high 2g + 1); w = d sc q - dmin m
- Q6_K (210 B / 256): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 sub-scales, fp16 d;
  w = d sc (q - 32) per 16 columns
"""

from __future__ import annotations

import numpy as np
import torch

from llmopt.models.packed.block import BlockFormat, block_format

# GGML type name -> our block format name
GGML_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)


def _nibbles_q4(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes (low nibbles first, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> 8 six-bit sub-scales and 8 six-bit mins per super-block."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_blocks(
    data: np.ndarray, ggml_type: str, rows: int, cols: int
) -> tuple[BlockFormat, np.ndarray, dict[str, np.ndarray]]:
    """(format, codes uint8 [rows, cols], scale arrays by buffer name).

    `data` is the tensor's raw bytes, [rows, bytes per row] uint8 (as `gguf.GGUFReader` maps
    them). Scales: fp16 per block for Q4_0/Q4_1/Q8_0 (and Q4_1's fp16 mins); the K-quants keep
    their two levels: `scales` (and Q4_K's `mins`) per sub-block as integers, `super_scales`
    (and `super_mins`) fp16 per 256 columns.
    """
    fmt = block_format(GGML_FORMATS[ggml_type])
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    if ggml_type in ("Q4_0", "Q4_1", "Q8_0"):
        per = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[ggml_type]
        blocks = raw.reshape(rows, cols // 32, per)
        out = {"scales": _f16(blocks[..., 0:2]).reshape(rows, -1)}
        if ggml_type == "Q4_1":
            out["mins"] = _f16(blocks[..., 2:4]).reshape(rows, -1)
        if ggml_type == "Q8_0":
            codes = blocks[..., 2:] ^ np.uint8(0x80)  # int8 q -> unsigned q + 128
        else:
            codes = _nibbles_q4(blocks[..., per - 16 :])
        return fmt, codes.reshape(rows, cols), out
    blocks = raw.reshape(rows, cols // 256, -1)
    if ggml_type == "Q4_K":
        sc, mn = _k_scale_min(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(rows, cols // 256, 4, 1, 32)
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-2)  # [.., 4, 2, 32]: sub-block 2g, 2g+1
        out = {
            "scales": sc.reshape(rows, -1),
            "mins": mn.reshape(rows, -1),
            "super_scales": _f16(blocks[..., 0:2]).reshape(rows, -1),
            "super_mins": _f16(blocks[..., 2:4]).reshape(rows, -1),
        }
        return fmt, codes.reshape(rows, cols), out
    # Q6_K
    ql = blocks[..., 0:128].reshape(rows, cols // 256, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(rows, cols // 256, 2, 1, 32)
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    codes = low.reshape(rows, cols // 256, 8, 32) | (high.reshape(rows, cols // 256, 8, 32) << 4)
    out = {
        "scales": np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(rows, -1),
        "super_scales": _f16(blocks[..., 208:210]).reshape(rows, -1),
    }
    return fmt, codes.reshape(rows, cols), out


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [rows, cols] < 16 -> [rows, cols / 2], even column in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def packed_tensors(
    data: np.ndarray, ggml_type: str, rows: int, cols: int
) -> tuple[BlockFormat, dict[str, torch.Tensor]]:
    """The format and the buffers (`codes`, `scales`, ...) of a `BlockQuantLinear`."""
    fmt, codes, arrays = decode_blocks(data, ggml_type, rows, cols)
    if fmt.bits == 4:
        codes = pack_nibbles(codes)
    out = {"codes": torch.from_numpy(np.ascontiguousarray(codes))}
    for name, array in arrays.items():
        out[name] = torch.from_numpy(np.ascontiguousarray(array))
    return fmt, out
