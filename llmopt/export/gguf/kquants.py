"""K-quant encoders (Q4_K, Q5_K, Q6_K): the `gguf` package decodes these but cannot write them.

Each follows the search ggml's reference quantizers run (`quantize_row_q{4,5,6}_K_ref` in
ggml-quants.c), vectorised over every sub-block of a tensor at once, so a file carries the
codes llama.cpp's `llama-quantize` would choose without an importance matrix:
- Q4_K / Q5_K: super-blocks of 256 = 8 sub-blocks of 32, each with a scale and a min; per
  sub-block a weighted least-squares fit of (scale, min) over a sweep of grid sizes (weights
  |x| + rms(x)), then the eight scales and mins quantized to 6 bits against fp16 `d`/`dmin`
  and the codes recomputed on the quantized grid. A weight is d*sc*q - dmin*m.
- Q6_K: 16 sub-blocks of 16 with a signed 8-bit scale each against an fp16 `d`; the
  per-sub-block scale is the best of 19 grid sizes by x^2-weighted error. A weight is
  d*sc*(q - 32).
Arithmetic is float32 with round-half-to-even, as ggml's `nearest_int`.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
_EPS = 1e-15  # ggml's GROUP_MAX_EPS: a sub-block this small is all zeros
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _rint(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)


def _fit_scale_min(
    x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray]:
    """[n, 32] sub-blocks -> (scale [n], min [n] >= 0): x ~ scale * q - min, q in 0..nmax.

    ggml's `make_qkx2_quants`: start from the min/max grid, then try grids of
    nmax + rmin + rdelta*i steps over the range and keep the weighted least-squares
    (scale, min) of whichever codes give the smallest weighted squared error; each grid
    starts at the best min found so far."""
    weights = np.sqrt((x * x).mean(axis=1, keepdims=True)) + np.abs(x)
    lo = np.minimum(x.min(axis=1), 0.0)
    hi = x.max(axis=1)
    span = hi - lo
    flat = span == 0
    span = np.where(flat, 1.0, span).astype(np.float32)
    sum_w = weights.sum(axis=1)
    sum_x = (weights * x).sum(axis=1)

    def codes(iscale: np.ndarray, origin: np.ndarray) -> np.ndarray:
        q = _rint(iscale[:, None] * (x - origin[:, None]))
        return np.clip(q, 0, nmax).astype(np.float32)

    def error(scale: np.ndarray, low: np.ndarray, q: np.ndarray) -> np.ndarray:
        return (weights * (scale[:, None] * q + low[:, None] - x) ** 2).sum(axis=1)

    scale = (span / nmax).astype(np.float32)
    low = lo.astype(np.float32)
    best = error(scale, low, codes(np.float32(nmax) / span, low))
    for step in range(nstep + 1):
        # the grid starts at the best min so far (ggml updates it in place as it goes)
        width = np.where(flat, 1.0, hi - low).astype(np.float32)
        q = codes(
            (np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax)) / width,
            low,
        )
        sum_l = (weights * q).sum(axis=1)
        sum_l2 = (weights * q * q).sum(axis=1)
        sum_xl = (weights * q * x).sum(axis=1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_low = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_low > 0  # the grid must reach down to 0: refit the scale alone
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        this_low = np.where(positive, 0.0, this_low)
        err = error(this_scale, this_low, q)
        better = ok & (err < best)
        best = np.where(better, err, best)
        scale = np.where(better, this_scale, scale)
        low = np.where(better, this_low, low)
    scale = np.where(flat, 0.0, scale)
    return scale.astype(np.float32), (-low).astype(np.float32)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> [n, 12] bytes (ggml's `get_scale_min_k4` layout)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def _asymmetric_codes(blocks: np.ndarray, nmax: int, rmin: float, nstep: int):
    """[n, 256] -> (d, dmin fp16 [n], packed scales [n, 12], codes [n, 256] in 0..nmax)."""
    sub = blocks.reshape(-1, 32)
    scale, low = _fit_scale_min(sub, nmax, rmin, 0.1, nstep)
    scale, low = np.maximum(scale, 0).reshape(-1, 8), np.maximum(low, 0).reshape(-1, 8)
    max_scale, max_low = scale.max(axis=1), low.max(axis=1)
    inv_scale = np.where(max_scale > 0, 63.0 / np.where(max_scale > 0, max_scale, 1), 0)
    inv_low = np.where(max_low > 0, 63.0 / np.where(max_low > 0, max_low, 1), 0)
    sc = np.minimum(_rint(inv_scale[:, None] * scale), 63).astype(np.uint8)
    mn = np.minimum(_rint(inv_low[:, None] * low), 63).astype(np.uint8)
    d = (max_scale / 63.0).astype(np.float16)
    dmin = (max_low / 63.0).astype(np.float16)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    x = blocks.reshape(-1, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = _rint((x + offset[..., None]) / step[..., None])
    q = np.where(step[..., None] > 0, np.clip(q, 0, nmax), 0).astype(np.uint8)
    return d, dmin, _pack_scales(sc, mn), q.reshape(-1, QK_K)


def _rows(array: np.ndarray, what: str) -> np.ndarray:
    if array.shape[-1] % QK_K:
        raise ValueError(f"{what} needs rows of a multiple of {QK_K} values, got {array.shape[-1]}")
    return np.ascontiguousarray(array, dtype=np.float32).reshape(-1, QK_K)


def _half_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 256] codes -> [n, 128]: per 64 values, the first 32 low nibbles, the next 32 high."""
    q = q.reshape(-1, 4, 2, 32) & 0xF
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128).astype(np.uint8)


def quantize_q4_k(array: np.ndarray) -> np.ndarray:
    """float [..., k*256] -> uint8 [..., k*144] Q4_K blocks (the last axis is the row)."""
    blocks = _rows(array, "Q4_K")
    d, dmin, scales, q = _asymmetric_codes(blocks, 15, -1.0, 20)
    out = np.concatenate([_half_bytes(d), _half_bytes(dmin), scales, _nibbles(q)], axis=1)
    return out.reshape(*array.shape[:-1], array.shape[-1] // QK_K * 144)


def quantize_q5_k(array: np.ndarray) -> np.ndarray:
    """float [..., k*256] -> uint8 [..., k*176] Q5_K blocks: Q4_K's plus one high bit per code."""
    blocks = _rows(array, "Q5_K")
    d, dmin, scales, q = _asymmetric_codes(blocks, 31, -0.5, 15)
    high = (q >> 4).reshape(-1, 4, 2, 32).astype(np.uint8)  # chunk c: bits 2c (first), 2c+1
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)
    qh = (high << shifts[None, :, :, None]).sum(axis=(1, 2)).astype(np.uint8)  # [n, 32]
    out = np.concatenate([_half_bytes(d), _half_bytes(dmin), scales, qh, _nibbles(q)], axis=1)
    return out.reshape(*array.shape[:-1], array.shape[-1] // QK_K * 176)


def _symmetric_scale(x: np.ndarray, nmax: int) -> np.ndarray:
    """[n, 16] -> scale [n] (signed): ggml's `make_qx_quants` with x^2 weights (rmse_type 1)."""
    idx = np.abs(x).argmax(axis=1)
    peak = x[np.arange(len(x)), idx]
    zero = np.abs(peak) < _EPS
    peak = np.where(zero, 1.0, peak).astype(np.float32)
    w = x * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = np.clip(_rint(iscale[:, None] * x), -nmax, nmax - 1).astype(np.float32)
        return (w * x * q).sum(axis=1), (w * q * q).sum(axis=1)

    sumlx, suml2 = fit(-nmax / peak)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), 0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2 = fit(-(np.float32(nmax) + np.float32(0.1) * np.float32(step)) / peak)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        this = sumlx / np.where(suml2 > 0, suml2, 1)
        scale = np.where(better, this, scale)
        best = np.where(better, this * sumlx, best)
    return np.where(zero, 0.0, scale).astype(np.float32)


def quantize_q6_k(array: np.ndarray) -> np.ndarray:
    """float [..., k*256] -> uint8 [..., k*210] Q6_K blocks (the last axis is the row)."""
    blocks = _rows(array, "Q6_K")
    scale = _symmetric_scale(blocks.reshape(-1, 16), 32).reshape(-1, 16)
    pick = np.abs(scale).argmax(axis=1)
    max_scale = scale[np.arange(len(scale)), pick]
    empty = np.abs(max_scale) < _EPS
    iscale = np.where(empty, 0.0, -128.0 / np.where(empty, 1.0, max_scale)).astype(np.float32)
    d = np.where(empty, 0.0, 1.0 / np.where(empty, 1.0, iscale)).astype(np.float16)
    sc = np.minimum(_rint(iscale[:, None] * scale), 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc.astype(np.float32)  # [n, 16]
    x = blocks.reshape(-1, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(_rint(x / step[..., None]), -32, 31) + 32
    q = np.where(step[..., None] != 0, q, 32).reshape(-1, 2, 4, 32).astype(np.uint8)
    # per half of 128: ql[0:32] = q0 | q2 << 4, ql[32:64] = q1 | q3 << 4 (quarters of 32)
    low = q & 0xF
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2
    ).reshape(-1, 128)
    high = q >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out = np.concatenate(
        [ql, qh.reshape(-1, 64).astype(np.uint8), sc.view(np.uint8), _half_bytes(d)], axis=1
    )
    return out.reshape(*array.shape[:-1], array.shape[-1] // QK_K * 210)


QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
