// Coded (4/6/8-bit) GEMM/GEMV over 16-row tiles with int8 activations.
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
#include "coded.h"
#include "avx2.h"

#include <algorithm>

namespace llmopt {

namespace {

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
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

#ifdef LLMOPT_AVX2
// 16 lanes of fp16 / fp32 scales or mins as two 8-lane halves
template <bool F16>
inline void load_lanes2(const void* p, int64_t tile, int64_t groups, int64_t g, __m256* out) {
  const int64_t off = (tile * groups + g) * kTile;
  if (F16) {
    const uint16_t* h = static_cast<const uint16_t*>(p) + off;
    out[0] = load8_f16(h);
    out[1] = load8_f16(h + 8);
  } else {
    const float* f = static_cast<const float*>(p) + off;
    out[0] = _mm256_loadu_ps(f);
    out[1] = _mm256_loadu_ps(f + 8);
  }
}

template <bool SIGNED>
inline void load_byte_lanes2(const void* p, int64_t tile, int64_t groups, int64_t g, __m256* out) {
  const uint8_t* q = static_cast<const uint8_t*>(p) + (tile * groups + g) * kTile;
  for (int h = 0; h < 2; ++h) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * h));
    out[h] = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  }
}

constexpr int64_t kPrefetchBytes2 = 4096;  // as kPrefetchBytes of the AVX-512 kernel

// The AVX-512 tile kernel's arithmetic with 8-lane vectors: half h of a 64-byte line holds
// rows 8h..8h+7. vpmaddubsw multiplies unsigned codes by signed int8 activations into int16
// pairs; 4-bit codes (|pair| <= 2*15*127) sum all 8 lines in int16 before vpmaddwd widens,
// 6-bit codes two lines at a time; 8-bit codes are flipped to signed (code - 128) and use the
// sign trick (|w| * sign(x, w): |pair| <= 2*128*127), the 128 * sum(x) term added back in
// int32. The int32 sums equal the VNNI ones exactly, so every build agrees on them.
template <int BITS, bool SF16, int MK, bool HALF, int TT>
void tile_avx2(const Linear& l, int64_t tile, const QRows& qx, int64_t tok0, float* y,
               int64_t ldy) {
  const int64_t nb = l.blocks(), groups = l.groups(), k = l.k;
  const int64_t per = HALF ? 1 : l.group / kBlock;
  const int64_t line_bytes = block_bytes(BITS);
  const uint8_t* wp = l.codes.data_ptr<uint8_t>() + tile * nb * line_bytes;
  const void* sp = l.scales.data_ptr();
  const void* mp = MK == MIN_ZERO ? nullptr : l.mins.data_ptr();
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256 negzero = _mm256_set1_ps(-l.zero);
  __m256 acc[TT][2];
  for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  __m256 ws[2] = {}, wm[2] = {}, ws2[2] = {}, wm2[2] = {};
  __m256 dv[2] = {}, dmv[2] = {};
  for (int64_t b = 0; b < nb; ++b, wp += line_bytes) {
    for (int64_t i = 0; i < line_bytes; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetchBytes2 + i), _MM_HINT_T0);
    if (HALF) {
      if (b % 8 == 0) load_lanes2<true>(l.super_scales.data_ptr(), tile, nb / 8, b / 8, dv);
      __m256 s1[2], s2[2];
      load_byte_lanes2<true>(sp, tile, groups, 2 * b, s1);
      load_byte_lanes2<true>(sp, tile, groups, 2 * b + 1, s2);
      for (int h = 0; h < 2; ++h) {
        ws[h] = _mm256_mul_ps(s1[h], dv[h]);
        ws2[h] = _mm256_mul_ps(s2[h], dv[h]);
        wm[h] = _mm256_mul_ps(ws[h], negzero);
        wm2[h] = _mm256_mul_ps(ws2[h], negzero);
      }
    } else if (MK == MIN_KQ) {
      if (b % 8 == 0) {
        load_lanes2<true>(l.super_scales.data_ptr(), tile, nb / 8, b / 8, dv);
        load_lanes2<true>(l.super_mins.data_ptr(), tile, nb / 8, b / 8, dmv);
      }
      __m256 sc[2], mn[2];
      load_byte_lanes2<false>(sp, tile, groups, b, sc);
      load_byte_lanes2<false>(mp, tile, groups, b, mn);
      for (int h = 0; h < 2; ++h) {
        ws[h] = _mm256_mul_ps(sc[h], dv[h]);
        wm[h] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(mn[h], dmv[h]));
      }
    } else if (b % per == 0) {
      load_lanes2<SF16>(sp, tile, groups, b / per, ws);
      if (MK == MIN_ZERO) {
        for (int h = 0; h < 2; ++h) wm[h] = _mm256_mul_ps(ws[h], negzero);
      } else {
        load_lanes2<MK == MIN_F16>(mp, tile, groups, b / per, wm);
      }
    }
    // integer block sums of the activation codes (8-bit codes only: the -128 shift)
    int32_t xsum_i[TT];
    if (BITS == 8) {
      for (int t = 0; t < TT; ++t) {
        const int8_t* xq = qx.q.data() + (tok0 + t) * k + b * kBlock;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i w16 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), xv), ones16);
        xsum_i[t] = hsum256_epi32(w16);
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256i w[8];
      if (BITS == 4 || BITS == 6) {
        for (int m = 0; m < 4; ++m) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 64 * m + 32 * h));
          w[m] = _mm256_and_si256(v, nib);
          w[m + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        if (BITS == 6) {
          const __m256i top = _mm256_set1_epi8(0x30);
          for (int m = 0; m < 8; ++m) {
            const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 256 + 64 * (m / 4) + 32 * h));
            const int q = m % 4;
            const __m256i hb = q == 0 ? _mm256_slli_epi16(p, 4)
                               : q == 1 ? _mm256_slli_epi16(p, 2)
                               : q == 2 ? p
                                        : _mm256_srli_epi16(p, 2);
            w[m] = _mm256_or_si256(w[m], _mm256_and_si256(hb, top));
          }
        }
      } else {
        const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
        for (int m = 0; m < 8; ++m)
          w[m] = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 64 * m + 32 * h)), flip);
      }
      for (int t = 0; t < TT; ++t) {
        const int64_t row = tok0 + t;
        const int8_t* xq = qx.q.data() + row * k + b * kBlock;
        const __m256 xs = _mm256_set1_ps(qx.scale[row * nb + b]);
        if (HALF) {
          __m256i s = _mm256_setzero_si256(), s2 = _mm256_setzero_si256();
          for (int m = 0; m < 4; m += 2) {
            __m256i p = _mm256_add_epi16(
                _mm256_maddubs_epi16(w[m], _mm256_set1_epi32(load4(xq + 4 * m))),
                _mm256_maddubs_epi16(w[m + 1], _mm256_set1_epi32(load4(xq + 4 * m + 4))));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones16));
            p = _mm256_add_epi16(
                _mm256_maddubs_epi16(w[m + 4], _mm256_set1_epi32(load4(xq + 16 + 4 * m))),
                _mm256_maddubs_epi16(w[m + 5], _mm256_set1_epi32(load4(xq + 16 + 4 * m + 4))));
            s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(p, ones16));
          }
          const float* xsum = qx.sum16.data() + 2 * (row * nb + b);
          __m256 a = acc[t][h];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(ws[h], xs), a);
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), _mm256_mul_ps(ws2[h], xs), a);
          a = _mm256_fmadd_ps(wm[h], _mm256_set1_ps(xsum[0]), a);
          acc[t][h] = _mm256_fmadd_ps(wm2[h], _mm256_set1_ps(xsum[1]), a);
          continue;
        }
        __m256i s;
        if (BITS == 4) {
          __m256i p = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(load4(xq)));
          for (int m = 1; m < 8; ++m)
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[m], _mm256_set1_epi32(load4(xq + 4 * m))));
          s = _mm256_madd_epi16(p, ones16);
        } else {  // 8-bit: sum (code - 128) x + 128 sum x
          s = _mm256_set1_epi32(128 * xsum_i[t]);
          for (int m = 0; m < 8; ++m) {
            const __m256i xb = _mm256_set1_epi32(load4(xq + 4 * m));
            const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w[m]), _mm256_sign_epi8(xb, w[m]));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones16));
          }
        }
        const float xsum = qx.sum[row * nb + b];
        __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(ws[h], xs), acc[t][h]);
        acc[t][h] = _mm256_fmadd_ps(wm[h], _mm256_set1_ps(xsum), a);
      }
    }
  }
  const int64_t r0 = tile * kTile, valid = std::min<int64_t>(kTile, l.n - r0);
  const float* bias = l.bias.defined() ? l.bias.data_ptr<float>() : nullptr;
  for (int t = 0; t < TT; ++t) {
    alignas(32) float out[kTile];
    _mm256_store_ps(out, acc[t][0]);
    _mm256_store_ps(out + 8, acc[t][1]);
    float* yt = y + (tok0 + t) * ldy + r0;
    for (int i = 0; i < valid; ++i) yt[i] = out[i] + (bias ? bias[r0 + i] : 0.f);
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
#if defined(LLMOPT_AVX512)
  tile_avx512<BITS, SF16, MK, HALF, TT>(l, tile, qx, tok0, y, ldy);
#elif defined(LLMOPT_AVX2)
  tile_avx2<BITS, SF16, MK, HALF, TT>(l, tile, qx, tok0, y, ldy);
#else
  tile_scalar<BITS, SF16, MK, HALF, TT>(l, tile, qx, tok0, y, ldy);
#endif
}

template <int BITS, bool SF16, int MK, bool HALF = false>
void run_tiles(const Linear& l, const QRows& qx, int64_t n_tok, float* y, int64_t ldy) {
  const int64_t tiles = l.tiles();
  // Few tiles per thread when decoding (n_tok small), so every thread gets work.
  parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
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

}  // namespace llmopt
