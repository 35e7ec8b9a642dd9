"""Q4_K quantization (llama.cpp's 4-bit K-quant), which the `gguf` package can only read.

A super-block of 256 weights holds fp16 `d` and `dmin`, twelve bytes of 6-bit sub-block scales
and mins (eight sub-blocks of 32), and 128 bytes of 4-bit codes; a weight dequantises to
d * sc_j * q - dmin * m_j. This is the plain round-to-nearest fit (no iterative search), so it
is slightly less accurate than llama.cpp's `quantize` tool, but every file it writes decodes
with ggml's `dequantize_row_q4_K`.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
_SUB = 32


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> [n, 12] bytes in ggml's `get_scale_min_k4` layout."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def quantize_q4_k(array: np.ndarray) -> np.ndarray:
    """float [..., k*256] -> uint8 [..., k*144] Q4_K blocks (the last axis is the row)."""
    if array.shape[-1] % QK_K:
        raise ValueError(f"Q4_K needs rows of a multiple of {QK_K} values, got {array.shape[-1]}")
    x = np.ascontiguousarray(array, dtype=np.float32).reshape(-1, 8, _SUB)
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    scale = (hi - lo) / 15.0  # [n, 8]
    minv = -lo
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (minv.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(scale / d32), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin32 > 0, np.rint(minv / dmin32), 0).clip(0, 63).astype(np.uint8)
        step = (d32 * sc)[..., None]
        offset = (dmin32 * mn)[..., None]
        q = np.where(step > 0, np.rint((x + offset) / step), 0).clip(0, 15).astype(np.uint8)
    q = q.reshape(-1, 4, 2, _SUB)  # chunks of 64: low nibbles from the first 32, high the next
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [
            d.view(np.uint8).reshape(-1, 2),
            dmin.view(np.uint8).reshape(-1, 2),
            _pack_scales(sc, mn),
            qs,
        ],
        axis=1,
    )
    return blocks.reshape(*array.shape[:-1], array.shape[-1] // QK_K * 144)
