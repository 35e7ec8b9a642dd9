// Coded (4/8-bit) GEMM/GEMV over 16-row tiles with int8 activations.
//
// Tile layout (built by llmopt/infer/fast/tiles.py): for each tile of 16 output rows and each
// block of 32 columns, 8 "lines" of 16 int32 lanes; lane i of line k holds the 4 codes of row i
// at columns 4k..4k+3. 8-bit codes store the 8 lines as they are (512 bytes); 4-bit codes store
// 4 lines of bytes whose low nibbles are line m and high nibbles line m + 4 (256 bytes); 6-bit
// codes (Q6_K) store their low nibbles so, then 2 planes of 64 bytes whose bits 2q..2q+1 are
// the top 2 bits of line 4p + q (384 bytes: the file's 6 bits per weight).
// Scales and mins are [tiles, groups, 16]: one 16-lane vector per tile and column group.
//
// Per block, `vpdpbusd(acc, w_line_k, broadcast(x[4k:4k+4]))` for k < 8 sums 32 columns of 16
// rows into one int32 vector; then y += float(sum) * (w_scale * x_scale) + w_min * x_blocksum.
// The weights of a block are unpacked once and reused for up to 8 tokens (GEMM); each token's
// arithmetic is the same whatever the batch, so batched rows equal batch-1 rows bit for bit.
#include "common.h"

#include <algorithm>

namespace llmopt {

Linear make_coded_linear(int64_t n, int64_t k, int64_t bits, int64_t group, at::Tensor codes,
                         at::Tensor scales, c10::optional<at::Tensor> mins, double zero,
                         c10::optional<at::Tensor> bias, c10::optional<at::Tensor> super_scales,
                         c10::optional<at::Tensor> super_mins) {
  Linear l;
  l.kind = CODED;
  l.n = n;
  l.k = k;
  l.bits = bits;
  l.group = group;
  l.zero = static_cast<float>(zero);
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "coded linear: bits must be 4, 6 or 8, got ",
              bits);
  TORCH_CHECK(n > 0 && k > 0 && k % kBlock == 0, "coded linear: in_features ", k,
              " must be a positive multiple of ", kBlock);
  TORCH_CHECK(group == 16 || (group >= kBlock && group % kBlock == 0), "coded linear: group ",
              group, " must be 16 or a multiple of ", kBlock);
  const int64_t line_bytes = block_bytes(bits);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 &&
                  codes.size(0) == l.tiles() && codes.size(1) == l.blocks() &&
                  codes.size(2) == line_bytes,
              "coded linear: codes must be uint8 [", l.tiles(), ", ", l.blocks(), ", ",
              line_bytes, "], got ", codes.sizes());
  l.codes = codes.contiguous();
  auto check_vec = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == l.tiles() && t.size(1) == l.groups() &&
                    t.size(2) == kTile,
                "coded linear: ", what, " must be [", l.tiles(), ", ", l.groups(), ", 16], got ",
                t.sizes());
    TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kFloat ||
                    t.scalar_type() == at::kByte || t.scalar_type() == at::kChar,
                "coded linear: ", what,
                " must be float16, float32, or uint8/int8 K-quant sub-scales");
  };
  check_vec(scales, "scales");
  l.scales = scales.contiguous();
  l.scale_f16 = scales.scalar_type() == at::kHalf;
  l.min_kind = MIN_ZERO;
  if (mins.has_value() && mins->defined() && mins->numel() > 0) {
    check_vec(*mins, "mins");
    l.mins = mins->contiguous();
    l.min_kind = mins->scalar_type() == at::kHalf ? MIN_F16 : MIN_F32;
  }
  if (scales.scalar_type() == at::kByte) {  // Q4_K: sub-scales/mins x fp16 super-scales
    const bool ok = bits == 4 && group == kBlock && k % 256 == 0 && l.mins.defined() &&
                    l.mins.scalar_type() == at::kByte && super_scales.has_value() &&
                    super_mins.has_value();
    TORCH_CHECK(ok, "coded linear: uint8 sub-scales need 4-bit codes, 32-column groups, uint8 "
                "sub-mins and fp16 super-scales and super-mins");
    for (const auto* t : {&*super_scales, &*super_mins})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 3 && t->size(0) == l.tiles() &&
                      t->size(1) == k / 256 && t->size(2) == kTile,
                  "coded linear: super-scales must be float16 [", l.tiles(), ", ", k / 256,
                  ", 16], got ", t->sizes());
    l.super_scales = super_scales->contiguous();
    l.super_mins = super_mins->contiguous();
    l.min_kind = MIN_KQ;
  } else {
    TORCH_CHECK(!l.mins.defined() || l.mins.scalar_type() != at::kByte,
                "coded linear: uint8 mins need uint8 sub-scales");
  }
  const bool q6 = bits == 6 || group == 16;
  TORCH_CHECK(!q6 || (bits == 6 && group == 16 && k % 256 == 0 && !l.mins.defined() &&
                      scales.scalar_type() == at::kChar && super_scales.has_value()),
              "coded linear: 6-bit codes (Q6_K) need 16-column groups, int8 sub-scales, fp16 "
              "super-scales and a zero point");
  TORCH_CHECK(scales.scalar_type() != at::kChar || q6, "coded linear: int8 scales are Q6_K's");
  if (q6) {
    TORCH_CHECK(super_scales->scalar_type() == at::kHalf && super_scales->dim() == 3 &&
                    super_scales->size(0) == l.tiles() && super_scales->size(1) == k / 256 &&
                    super_scales->size(2) == kTile,
                "coded linear: super-scales must be float16 [", l.tiles(), ", ", k / 256, ", 16]");
    l.super_scales = super_scales->contiguous();
  }
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    l.bias = bias->contiguous().to(at::kFloat);
    TORCH_CHECK(l.bias.numel() == n, "bias has ", l.bias.numel(), " values, want ", n);
  }
  return l;
}

namespace {

inline float half_to_float(uint16_t h) {
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// scale / min vector `g` of `tile` as 16 floats (p: the tensor's data)
template <bool F16>
inline void lanes(const void* p, int64_t tile, int64_t groups, int64_t g, float* out) {
  const int64_t off = (tile * groups + g) * kTile;
  if (F16) {
    const uint16_t* h = static_cast<const uint16_t*>(p) + off;
    for (int i = 0; i < kTile; ++i) out[i] = half_to_float(h[i]);
  } else {
    std::memcpy(out, static_cast<const float*>(p) + off, kTile * sizeof(float));
  }
}

// K-quant levels of `tile`'s group g: scale = sub * super, min = -sub_min * super_min
inline void kq_lanes(const Linear& l, int64_t tile, int64_t g, float* ws, float* wm) {
  const int64_t off = (tile * l.groups() + g) * kTile;
  float d[kTile], dm[kTile];
  lanes<true>(l.super_scales.data_ptr(), tile, l.k / 256, g / 8, d);
  lanes<true>(l.super_mins.data_ptr(), tile, l.k / 256, g / 8, dm);
  const uint8_t* sc = l.scales.data_ptr<uint8_t>() + off;
  const uint8_t* mn = l.mins.data_ptr<uint8_t>() + off;
  for (int i = 0; i < kTile; ++i) {
    ws[i] = static_cast<float>(sc[i]) * d[i];
    wm[i] = -(static_cast<float>(mn[i]) * dm[i]);
  }
}

// Q6_K levels of `tile`'s 16-column group g: scale = int8 sub * fp16 super
inline void q6_lanes(const Linear& l, int64_t tile, int64_t g, float* ws) {
  float d[kTile];
  lanes<true>(l.super_scales.data_ptr(), tile, l.k / 256, g / 16, d);
  const int8_t* sc = l.scales.data_ptr<int8_t>() + (tile * l.groups() + g) * kTile;
  for (int i = 0; i < kTile; ++i) ws[i] = static_cast<float>(sc[i]) * d[i];
}

// code e (= 4 * row + column) of line m of a block at p, for any bit width
inline int code_of(const uint8_t* p, int bits, int m, int e) {
  if (bits == 8) return p[64 * m + e];
  const uint8_t v = p[64 * (m % 4) + e];
  const int lo = m < 4 ? (v & 0x0F) : (v >> 4);
  if (bits == 4) return lo;
  return lo | (((p[256 + 64 * (m / 4) + e] >> (2 * (m % 4))) & 3) << 4);
}

#ifdef LLMOPT_AVX512
inline __m512 load_i8_lanes(const void* p, int64_t tile, int64_t groups, int64_t g) {
  const int8_t* q = static_cast<const int8_t*>(p) + (tile * groups + g) * kTile;
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

inline __m512 load_u8_lanes(const void* p, int64_t tile, int64_t groups, int64_t g) {
  const uint8_t* q = static_cast<const uint8_t*>(p) + (tile * groups + g) * kTile;
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}

template <bool F16>
inline __m512 load_lanes(const void* p, int64_t tile, int64_t groups, int64_t g) {
  const int64_t off = (tile * groups + g) * kTile;
  if (F16) {
    auto h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + off));
    return _mm512_cvtph_ps(h);
  }
  return _mm512_loadu_ps(static_cast<const float*>(p) + off);
}

// Codes are prefetched this many bytes ahead of the block being multiplied: the hardware
// prefetcher stops at 4 KiB pages, and a decode step streams ~100 MB of codes once. Measured
// on SmolLM2's Q4_1 GGUF, batch 1, 1 thread, ms CPU per token (medians of 5, 2-4 sweeps,
// load average 6-11 on the 2 cores): none 12.0-15.0, 512 B 14.2-14.6, 1 KiB 12.6-14.5,
// 2 KiB 10.5-13.0, 4 KiB 9.1-11.1, 8 KiB 9.3-11.1, 16 KiB 12.0-12.4.
constexpr int64_t kPrefetchBytes = 4096;

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One tile of 16 rows for TT tokens starting at tok0 (rows of y are ldy apart). HALF (Q6_K,
// BITS 6): one scale per 16 columns (lines 0-3 and 4-7 of a block are summed apart).
template <int BITS, bool SF16, int MK, bool HALF, int TT>
void tile_avx512(const Linear& l, int64_t tile, const QRows& qx, int64_t tok0, float* y,
                 int64_t ldy) {
  const int64_t nb = l.blocks(), groups = l.groups(), k = l.k;
  const int64_t per = HALF ? 1 : l.group / kBlock;
  const int64_t line_bytes = block_bytes(BITS);
  const uint8_t* wp = l.codes.data_ptr<uint8_t>() + tile * nb * line_bytes;
  const void* sp = l.scales.data_ptr();
  const void* mp = MK == MIN_ZERO ? nullptr : l.mins.data_ptr();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512 negzero = _mm512_set1_ps(-l.zero);
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  __m512 ws = _mm512_setzero_ps(), wm = _mm512_setzero_ps();
  __m512 ws2 = _mm512_setzero_ps(), wm2 = _mm512_setzero_ps();
  __m512 dv = _mm512_setzero_ps(), dmv = _mm512_setzero_ps();  // K-quant super-scales
  for (int64_t b = 0; b < nb; ++b, wp += line_bytes) {
    for (int64_t i = 0; i < line_bytes; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchBytes + i), _MM_HINT_T0);
    __m512i w[8];
    if (BITS == 4) {
      for (int m = 0; m < 4; ++m) {
        const __m512i v = _mm512_loadu_si512(wp + 64 * m);
        w[m] = _mm512_and_si512(v, nib);
        w[m + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
    } else if (BITS == 6) {  // low nibbles, then the top 2 bits from two planes
      const __m512i hi[2] = {_mm512_loadu_si512(wp + 256), _mm512_loadu_si512(wp + 320)};
      const __m512i top = _mm512_set1_epi8(0x30);
      for (int m = 0; m < 4; ++m) {
        const __m512i v = _mm512_loadu_si512(wp + 64 * m);
        w[m] = _mm512_and_si512(v, nib);
        w[m + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
      for (int m = 0; m < 8; ++m) {  // bits 2q..2q+1 of the plane to bits 4..5: w | (h & 0x30)
        const __m512i p = hi[m / 4];
        const int q = m % 4;
        const __m512i h = q == 0 ? _mm512_slli_epi16(p, 4)
                          : q == 1 ? _mm512_slli_epi16(p, 2)
                          : q == 2 ? p
                                   : _mm512_srli_epi16(p, 2);
        w[m] = _mm512_ternarylogic_epi32(w[m], h, top, 0xF8);
      }
    } else {
      for (int m = 0; m < 8; ++m) w[m] = _mm512_loadu_si512(wp + 64 * m);
    }
    if (HALF) {
      if (b % 8 == 0) dv = load_lanes<true>(l.super_scales.data_ptr(), tile, nb / 8, b / 8);
      ws = _mm512_mul_ps(load_i8_lanes(sp, tile, groups, 2 * b), dv);
      ws2 = _mm512_mul_ps(load_i8_lanes(sp, tile, groups, 2 * b + 1), dv);
      wm = _mm512_mul_ps(ws, negzero);
      wm2 = _mm512_mul_ps(ws2, negzero);
    } else if (MK == MIN_KQ) {
      if (b % 8 == 0) {
        dv = load_lanes<true>(l.super_scales.data_ptr(), tile, nb / 8, b / 8);
        dmv = load_lanes<true>(l.super_mins.data_ptr(), tile, nb / 8, b / 8);
      }
      ws = _mm512_mul_ps(load_u8_lanes(sp, tile, groups, b), dv);
      wm = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(load_u8_lanes(mp, tile, groups, b), dmv));
    } else if (b % per == 0) {
      ws = load_lanes<SF16>(sp, tile, groups, b / per);
      if (MK == MIN_ZERO) {
        wm = _mm512_mul_ps(ws, negzero);
      } else {
        wm = load_lanes<MK == MIN_F16>(mp, tile, groups, b / per);
      }
    }
    for (int t = 0; t < TT; ++t) {
      const int64_t row = tok0 + t;
      const int8_t* xq = qx.q.data() + row * k + b * kBlock;
      const __m512 xs = _mm512_set1_ps(qx.scale[row * nb + b]);
      if (HALF) {
        __m512i s = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
        for (int m = 0; m < 4; ++m) {
          s = _mm512_dpbusd_epi32(s, w[m], _mm512_set1_epi32(load4(xq + 4 * m)));
          s2 = _mm512_dpbusd_epi32(s2, w[m + 4], _mm512_set1_epi32(load4(xq + 16 + 4 * m)));
        }
        const float* xsum = qx.sum16.data() + 2 * (row * nb + b);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, xs), acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), _mm512_mul_ps(ws2, xs), acc[t]);
        acc[t] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xsum[0]), acc[t]);
        acc[t] = _mm512_fmadd_ps(wm2, _mm512_set1_ps(xsum[1]), acc[t]);
        continue;
      }
      __m512i s = _mm512_setzero_si512();
      for (int m = 0; m < 8; ++m) s = _mm512_dpbusd_epi32(s, w[m], _mm512_set1_epi32(load4(xq + 4 * m)));
      const float xsum = qx.sum[row * nb + b];
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, xs), acc[t]);
      acc[t] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xsum), acc[t]);
    }
  }
  const int64_t r0 = tile * kTile, valid = std::min<int64_t>(kTile, l.n - r0);
  const __mmask16 mask = valid >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const float* bias = l.bias.defined() ? l.bias.data_ptr<float>() : nullptr;
  for (int t = 0; t < TT; ++t) {
    __m512 v = acc[t];
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + r0));
    _mm512_mask_storeu_ps(y + (tok0 + t) * ldy + r0, mask, v);
  }
}
#endif

// Portable version of the same arithmetic (any CPU; the reference for the layout).
template <int BITS, bool SF16, int MK, bool HALF, int TT>
void tile_scalar(const Linear& l, int64_t tile, const QRows& qx, int64_t tok0, float* y,
                 int64_t ldy) {
  const int64_t nb = l.blocks(), groups = l.groups(), k = l.k;
  const int64_t per = HALF ? 1 : l.group / kBlock;
  const int64_t line_bytes = block_bytes(BITS);
  const uint8_t* wp = l.codes.data_ptr<uint8_t>() + tile * nb * line_bytes;
  float acc[TT][kTile] = {};
  float ws[2][kTile] = {}, wm[2][kTile] = {};
  uint8_t w[8][64];
  for (int64_t b = 0; b < nb; ++b, wp += line_bytes) {
    for (int m = 0; m < 8; ++m)
      for (int e = 0; e < 64; ++e) w[m][e] = static_cast<uint8_t>(code_of(wp, BITS, m, e));
    for (int h = 0; h < (HALF ? 2 : 1); ++h) {
      if (!HALF && b % per) break;
      const int64_t g = HALF ? 2 * b + h : b / per;
      if (MK == MIN_KQ) {
        kq_lanes(l, tile, g, ws[h], wm[h]);
        continue;
      }
      if (HALF) {
        q6_lanes(l, tile, g, ws[h]);
        for (int i = 0; i < kTile; ++i) wm[h][i] = ws[h][i] * -l.zero;
        continue;
      }
      lanes<SF16>(l.scales.data_ptr(), tile, groups, g, ws[h]);
      if (MK == MIN_ZERO) {
        for (int i = 0; i < kTile; ++i) wm[h][i] = ws[h][i] * -l.zero;
      } else {
        lanes<MK == MIN_F16>(l.mins.data_ptr(), tile, groups, g, wm[h]);
      }
    }
    for (int t = 0; t < TT; ++t) {
      const int64_t row = tok0 + t;
      const int8_t* xq = qx.q.data() + row * k + b * kBlock;
      const float xs = qx.scale[row * nb + b];
      for (int i = 0; i < kTile; ++i) {
        int32_t s[2] = {0, 0};
        for (int m = 0; m < 8; ++m)
          for (int j = 0; j < 4; ++j) s[HALF && m >= 4] += int32_t(w[m][4 * i + j]) * xq[4 * m + j];
        if (HALF) {
          const float* xsum = qx.sum16.data() + 2 * (row * nb + b);
          acc[t][i] += static_cast<float>(s[0]) * (ws[0][i] * xs);
          acc[t][i] += static_cast<float>(s[1]) * (ws[1][i] * xs);
          acc[t][i] += wm[0][i] * xsum[0];
          acc[t][i] += wm[1][i] * xsum[1];
        } else {
          acc[t][i] += static_cast<float>(s[0]) * (ws[0][i] * xs);
          acc[t][i] += wm[0][i] * qx.sum[row * nb + b];
        }
      }
    }
  }
  const int64_t r0 = tile * kTile, valid = std::min<int64_t>(kTile, l.n - r0);
  const float* bias = l.bias.defined() ? l.bias.data_ptr<float>() : nullptr;
  for (int t = 0; t < TT; ++t)
    for (int i = 0; i < valid; ++i)
      y[(tok0 + t) * ldy + r0 + i] = acc[t][i] + (bias ? bias[r0 + i] : 0.f);
}

template <int BITS, bool SF16, int MK, bool HALF, int TT>
inline void tile_any(const Linear& l, int64_t tile, const QRows& qx, int64_t tok0, float* y,
                     int64_t ldy) {
#ifdef LLMOPT_AVX512
  tile_avx512<BITS, SF16, MK, HALF, TT>(l, tile, qx, tok0, y, ldy);
#else
  tile_scalar<BITS, SF16, MK, HALF, TT>(l, tile, qx, tok0, y, ldy);
#endif
}

template <int BITS, bool SF16, int MK, bool HALF = false>
void run_tiles(const Linear& l, const QRows& qx, int64_t n_tok, float* y, int64_t ldy) {
  const int64_t tiles = l.tiles();
  // Few tiles per thread when decoding (n_tok small), so every thread gets work.
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; ++tile) {
      int64_t tok = 0;
      for (; tok + 8 <= n_tok; tok += 8) tile_any<BITS, SF16, MK, HALF, 8>(l, tile, qx, tok, y, ldy);
      if (tok + 4 <= n_tok) {
        tile_any<BITS, SF16, MK, HALF, 4>(l, tile, qx, tok, y, ldy);
        tok += 4;
      }
      if (tok + 2 <= n_tok) {
        tile_any<BITS, SF16, MK, HALF, 2>(l, tile, qx, tok, y, ldy);
        tok += 2;
      }
      if (tok < n_tok) tile_any<BITS, SF16, MK, HALF, 1>(l, tile, qx, tok, y, ldy);
    }
  });
}

template <int BITS, bool SF16>
void run_min(const Linear& l, const QRows& qx, int64_t n_tok, float* y, int64_t ldy) {
  switch (l.min_kind) {
    case MIN_ZERO:
      return run_tiles<BITS, SF16, MIN_ZERO>(l, qx, n_tok, y, ldy);
    case MIN_F16:
      return run_tiles<BITS, SF16, MIN_F16>(l, qx, n_tok, y, ldy);
    case MIN_KQ:
      return run_tiles<BITS, false, MIN_KQ>(l, qx, n_tok, y, ldy);
    default:
      return run_tiles<BITS, SF16, MIN_F32>(l, qx, n_tok, y, ldy);
  }
}

}  // namespace

void coded_rows(const Linear& l, const QRows& qx, int64_t n_tok, float* y, int64_t ldy) {
  TORCH_CHECK(qx.k == l.k && qx.n >= n_tok, "coded linear: activation rows do not match");
  if (l.bits == 6) return run_tiles<6, false, MIN_ZERO, true>(l, qx, n_tok, y, ldy);
  if (l.bits == 4) {
    if (l.scale_f16) return run_min<4, true>(l, qx, n_tok, y, ldy);
    return run_min<4, false>(l, qx, n_tok, y, ldy);
  }
  if (l.scale_f16) return run_min<8, true>(l, qx, n_tok, y, ldy);
  return run_min<8, false>(l, qx, n_tok, y, ldy);
}

void weight_row(const Linear& l, int64_t row, float* out) {
  TORCH_CHECK(row >= 0 && row < l.n, "row ", row, " outside [0, ", l.n, ")");
  if (l.kind == F32) {
    std::memcpy(out, l.w.data_ptr<float>() + row * l.k, l.k * sizeof(float));
    return;
  }
  if (l.kind == BF16) {
    auto* w = reinterpret_cast<const uint16_t*>(l.w.data_ptr<at::BFloat16>()) + row * l.k;
    for (int64_t i = 0; i < l.k; ++i) out[i] = bf16_to_f32(w[i]);
    return;
  }
  const int64_t tile = row / kTile, i = row % kTile, nb = l.blocks();
  const int64_t line_bytes = block_bytes(l.bits);
  const uint8_t* wp = l.codes.data_ptr<uint8_t>() + tile * nb * line_bytes;
  float ws[kTile], wm[kTile];
  int64_t loaded = -1;
  for (int64_t b = 0; b < nb; ++b, wp += line_bytes) {
    for (int m = 0; m < 8; ++m) {
      const int64_t g = (b * kBlock + 4 * m) / l.group;
      if (g != loaded && l.min_kind == MIN_KQ) {
        kq_lanes(l, tile, g, ws, wm);
        loaded = g;
      } else if (g != loaded && l.bits == 6) {
        q6_lanes(l, tile, g, ws);
        for (int j = 0; j < kTile; ++j) wm[j] = ws[j] * -l.zero;
        loaded = g;
      } else if (g != loaded) {
        if (l.scale_f16)
          lanes<true>(l.scales.data_ptr(), tile, l.groups(), g, ws);
        else
          lanes<false>(l.scales.data_ptr(), tile, l.groups(), g, ws);
        if (l.min_kind == MIN_ZERO)
          for (int j = 0; j < kTile; ++j) wm[j] = ws[j] * -l.zero;
        else if (l.min_kind == MIN_F16)
          lanes<true>(l.mins.data_ptr(), tile, l.groups(), g, wm);
        else
          lanes<false>(l.mins.data_ptr(), tile, l.groups(), g, wm);
        loaded = g;
      }
      for (int j = 0; j < 4; ++j) {
        const int code = code_of(wp, static_cast<int>(l.bits), m, 4 * static_cast<int>(i) + j);
        out[b * kBlock + 4 * m + j] = static_cast<float>(code) * ws[i] + wm[i];
      }
    }
  }
}

int64_t Linear::nbytes() const {
  int64_t total = 0;
  for (const at::Tensor* t : {&w, &codes, &scales, &mins, &bias, &super_scales, &super_mins})
    if (t->defined()) total += t->numel() * t->element_size();
  return total;
}

}  // namespace llmopt
