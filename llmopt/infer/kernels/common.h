// Shared declarations of the fused CPU forward (see model.cpp for the overview).
//
// Weights are `Linear`s of three kinds: fp32 rows, bf16 rows (both multiplied by fp32
// activations) and CODED tiles: 4- or 8-bit unsigned codes with W = code * scale + min per
// group of columns, stored in 16-row tiles (coded.cpp) so one AVX-512 VNNI instruction
// multiplies 4 columns of 16 rows by 4 broadcast activation bytes. Coded linears read the
// activation rounded to int8 per 32 columns (`QRows`, llama.cpp's Q8_0/Q8_1 activations).
#pragma once

#include <ATen/ATen.h>
#include "parallel.h"

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__)
#define LLMOPT_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 without AVX-512 (AMD Zen 1-3, Intel client cores): 8-lane versions of the same
// arithmetic (avx2.h); coded tiles multiply with vpmaddubsw instead of VNNI.
#define LLMOPT_AVX2 1
#include <immintrin.h>
#endif

namespace llmopt {

enum Kind : int64_t { F32 = 0, BF16 = 1, CODED = 2 };
// where a coded group's min comes from: -zero * scale (Q4_0, Q8_0, symmetric codes), a
// stored fp16 / fp32 value per group (Q4_1, zero-point INT4/INT8), or K-quant levels (Q4_K:
// scale = sub * super_scale, min = -sub_min * super_min, uint8 subs, fp16 supers per 256)
enum MinKind : int64_t { MIN_ZERO = 0, MIN_F16 = 1, MIN_F32 = 2, MIN_KQ = 3 };

constexpr int64_t kTile = 16;   // output rows per coded tile (one zmm of int32 lanes)
// bytes of one tile's block of 32 columns: 4-bit nibbles, 6-bit nibbles + 2-bit planes, bytes
constexpr int64_t block_bytes(int64_t bits) { return bits == 4 ? 256 : bits == 6 ? 384 : 512; }
constexpr int64_t kBlock = 32;  // columns per activation scale
// Per-row elementwise work (norms, RoPE, activation rounding) runs in parallel from this many
// rows on: below it one row costs less than waking the other threads.
constexpr int64_t kParallelRows = 32;

struct Linear {
  int64_t kind = F32, n = 0, k = 0;
  at::Tensor w;  // F32: float [n, k]; BF16: bfloat16 [n, k]
  // CODED: codes [tiles, blocks, 256 (4-bit) | 512 (8-bit)] uint8 (see coded.cpp for the
  // order), scales / mins [tiles, groups, 16] fp16 or fp32, group = columns per scale: a
  // multiple of 32, or 16 (Q6_K: 6-bit codes, int8 sub-scales x fp16 super_scales, zero 32)
  int64_t bits = 0, group = 0, min_kind = MIN_ZERO;
  bool scale_f16 = true;
  float zero = 0.f;
  at::Tensor codes, scales, mins, bias;  // bias: fp32 [n] or undefined
  at::Tensor super_scales, super_mins;   // MIN_KQ: fp16 [tiles, k / 256, 16]

  int64_t tiles() const { return (n + kTile - 1) / kTile; }
  int64_t blocks() const { return k / kBlock; }
  int64_t groups() const { return (k + group - 1) / group; }
  int64_t nbytes() const;  // what one pass over the weight reads
};

Linear make_float_linear(at::Tensor w, c10::optional<at::Tensor> bias);
Linear make_coded_linear(int64_t n, int64_t k, int64_t bits, int64_t group, at::Tensor codes,
                         at::Tensor scales, c10::optional<at::Tensor> mins, double zero,
                         c10::optional<at::Tensor> bias, c10::optional<at::Tensor> super_scales,
                         c10::optional<at::Tensor> super_mins);

// Activation rows rounded to int8 per 32 columns: scale = max|x| / 127, code = round(x / scale).
struct QRows {
  int64_t n = 0, k = 0;
  std::vector<int8_t> q;     // [n, k]
  std::vector<float> scale;  // [n, k / 32]
  std::vector<float> sum;    // [n, k / 32]: scale * sum(codes), the rounded block sum
  std::vector<float> sum16;  // [n, k / 16]: the same per half block (16-column groups)
};
void quantize_rows(const float* x, int64_t n, int64_t k, QRows& out);

// y[t, 0:l.n] (rows ldy apart) = x[t] W^T + bias for t < n_tok. `qx` must hold x quantized
// when l is CODED. Every token's arithmetic is independent of n_tok (batch invariance).
void linear_rows(const Linear& l, const float* x, const QRows* qx, int64_t n_tok, float* y,
                 int64_t ldy);
void coded_rows(const Linear& l, const QRows& qx, int64_t n_tok, float* y, int64_t ldy);
void dense_rows(const Linear& l, const float* x, int64_t n_tok, float* y, int64_t ldy);
// One output row of the weight, dequantized (embedding lookups from a tied coded head).
void weight_row(const Linear& l, int64_t row, float* out);

// ------------------------------------------------------------------ math helpers (math.cpp)
float dot_f32(const float* a, const float* b, int64_t k);
void rmsnorm_row(const float* x, const float* w, float* y, int64_t n, double eps);
void silu_mul(const float* gate, const float* up, float* out, int64_t n);
void gelu_mul(const float* gate, const float* up, float* out, int64_t n);  // up may be null
void softcap_inplace(float* x, int64_t n, float cap);
// exp(x[i] - shift) in place, returns their sum
float exp_sum(float* x, int64_t n, float shift);

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace llmopt
