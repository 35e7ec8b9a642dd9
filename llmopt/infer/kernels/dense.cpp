// fp32 and bf16 weight rows times fp32 activations (no activation rounding).
//
// Rows go four at a time: each 16-float slice of x is loaded once for four weight rows and
// eight FMA chains stay in flight. For several tokens the four rows are reused from L1 for
// every token (the weights are streamed from memory once per call); each token's result is
// the same as a batch-1 call.
#include "avx2.h"

#include <algorithm>

namespace llmopt {

Linear make_float_linear(at::Tensor w, c10::optional<at::Tensor> bias) {
  Linear l;
  TORCH_CHECK(w.dim() == 2, "float linear: weight must be 2-D, got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "float linear: weight must be float32 or bfloat16, got ", w.scalar_type());
  l.kind = w.scalar_type() == at::kFloat ? F32 : BF16;
  l.n = w.size(0);
  l.k = w.size(1);
  l.w = w.contiguous();
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    l.bias = bias->contiguous().to(at::kFloat);
    TORCH_CHECK(l.bias.numel() == l.n, "bias has ", l.bias.numel(), " values, want ", l.n);
  }
  return l;
}

namespace {

inline void dot4_f32(const float* w, int64_t k, const float* x, float* out) {
  const float* r[4] = {w, w + k, w + 2 * k, w + 3 * k};
  int64_t i = 0;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef LLMOPT_AVX512
  __m512 a[4], b[4];
  for (int j = 0; j < 4; ++j) a[j] = b[j] = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    const __m512 xv = _mm512_loadu_ps(x + i), xw = _mm512_loadu_ps(x + i + 16);
    for (int j = 0; j < 4; ++j) {
      a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(r[j] + i), xv, a[j]);
      b[j] = _mm512_fmadd_ps(_mm512_loadu_ps(r[j] + i + 16), xw, b[j]);
    }
  }
  for (; i + 16 <= k; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int j = 0; j < 4; ++j) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(r[j] + i), xv, a[j]);
  }
  for (int j = 0; j < 4; ++j) s[j] = _mm512_reduce_add_ps(_mm512_add_ps(a[j], b[j]));
#elif defined(LLMOPT_AVX2)
  __m256 a[4], b[4];
  for (int j = 0; j < 4; ++j) a[j] = b[j] = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m256 xv = _mm256_loadu_ps(x + i), xw = _mm256_loadu_ps(x + i + 8);
    for (int j = 0; j < 4; ++j) {
      a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(r[j] + i), xv, a[j]);
      b[j] = _mm256_fmadd_ps(_mm256_loadu_ps(r[j] + i + 8), xw, b[j]);
    }
  }
  for (; i + 8 <= k; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int j = 0; j < 4; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(r[j] + i), xv, a[j]);
  }
  for (int j = 0; j < 4; ++j) s[j] = hsum256(_mm256_add_ps(a[j], b[j]));
#endif
  for (; i < k; ++i)
    for (int j = 0; j < 4; ++j) s[j] += r[j][i] * x[i];
  for (int j = 0; j < 4; ++j) out[j] = s[j];
}

inline float dot_bf16(const uint16_t* w, const float* x, int64_t k) {
  int64_t i = 0;
  float s = 0.f;
#ifdef LLMOPT_AVX512
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  auto load = [](const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  for (; i + 32 <= k; i += 32) {
    a0 = _mm512_fmadd_ps(load(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(load(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
  }
  for (; i + 16 <= k; i += 16) a0 = _mm512_fmadd_ps(load(w + i), _mm512_loadu_ps(x + i), a0);
  s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(LLMOPT_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    a0 = _mm256_fmadd_ps(load8_bf16(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load8_bf16(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(load8_bf16(w + i), _mm256_loadu_ps(x + i), a0);
  s = hsum256(_mm256_add_ps(a0, a1));
#endif
  for (; i < k; ++i) s += bf16_to_f32(w[i]) * x[i];
  return s;
}

}  // namespace

void dense_rows(const Linear& l, const float* x, int64_t n_tok, float* y, int64_t ldy) {
  const int64_t n = l.n, k = l.k;
  const float* bias = l.bias.defined() ? l.bias.data_ptr<float>() : nullptr;
  const int64_t blocks = (n + 3) / 4;
  const int64_t grain = std::max<int64_t>(4, blocks / (8 * num_threads() + 1));
  parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r = blk * 4, rows = std::min<int64_t>(4, n - r);
      for (int64_t t = 0; t < n_tok; ++t) {
        const float* xt = x + t * k;
        float* yt = y + t * ldy;
        if (l.kind == F32) {
          const float* w = l.w.data_ptr<float>() + r * k;
          if (rows == 4) {
            dot4_f32(w, k, xt, yt + r);
          } else {
            for (int64_t j = 0; j < rows; ++j) yt[r + j] = dot_f32(w + j * k, xt, k);
          }
        } else {
          auto* w = reinterpret_cast<const uint16_t*>(l.w.data_ptr<at::BFloat16>()) + r * k;
          for (int64_t j = 0; j < rows; ++j) yt[r + j] = dot_bf16(w + j * k, xt, k);
        }
        for (int64_t j = 0; bias && j < rows; ++j) yt[r + j] += bias[r + j];
      }
    }
  });
}

void linear_rows(const Linear& l, const float* x, const QRows* qx, int64_t n_tok, float* y,
                 int64_t ldy) {
  if (l.kind == CODED) {
    TORCH_CHECK(qx != nullptr, "coded linear needs quantized activations");
    coded_rows(l, *qx, n_tok, y, ldy);
  } else {
    dense_rows(l, x, n_tok, y, ldy);
  }
}

}  // namespace llmopt
