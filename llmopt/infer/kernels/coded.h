// Coded weights: the tile layout's scale/min lanes and codes, shared by the GEMM kernels
// (coded.cpp) and the construction / row lookups (coded_linear.cpp).
#pragma once

#include "common.h"

namespace llmopt {

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

}  // namespace llmopt
