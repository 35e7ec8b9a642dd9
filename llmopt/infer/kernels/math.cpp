// Elementwise pieces of the forward: dot products, RMSNorm, gated activations, softmax
// exponentials and the int8 activation rounding of coded linears.
//
// exp is a Cephes-style polynomial (range reduction by ln 2, degree-6 polynomial, exact 2^n
// by scalef): ~1 ulp in fp32, so logits stay within 1e-4 of torch's; the scalar tails use
// std::exp. Everything here is per row, so results never depend on the batch.
#include "avx2.h"

#include <algorithm>
#include <cmath>

namespace llmopt {

#ifdef LLMOPT_AVX512
namespace {
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}
}  // namespace
#endif

float dot_f32(const float* a, const float* b, int64_t k) {
  int64_t i = 0;
  float s = 0.f;
#ifdef LLMOPT_AVX512
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), a1);
  }
  for (; i + 16 <= k; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
  s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(LLMOPT_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
  }
  for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
  s = hsum256(_mm256_add_ps(a0, a1));
#endif
  for (; i < k; ++i) s += a[i] * b[i];
  return s;
}

void rmsnorm_row(const float* x, const float* w, float* y, int64_t n, double eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#ifdef LLMOPT_AVX512
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(up + i)));
  }
#elif defined(LLMOPT_AVX2)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// gelu_tanh(g) = g / 2 * (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3); 1 + tanh(u) is
// computed as 2 - 2 / (exp(2u) + 1), exact in the limits.
void gelu_mul(const float* gate, const float* up, float* out, int64_t n) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  int64_t i = 0;
#ifdef LLMOPT_AVX512
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f), half = _mm512_set1_ps(.5f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(kBeta),
                                   _mm512_fmadd_ps(_mm512_set1_ps(kKappa), cube, g));
    const __m512 e = exp512(_mm512_mul_ps(two, u));
    const __m512 tanh1 = _mm512_sub_ps(two, _mm512_div_ps(two, _mm512_add_ps(e, one)));
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(half, g), tanh1);
    if (up) v = _mm512_mul_ps(v, _mm512_loadu_ps(up + i));
    _mm512_storeu_ps(out + i, v);
  }
#elif defined(LLMOPT_AVX2)
  const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(.5f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(kBeta),
                                   _mm256_fmadd_ps(_mm256_set1_ps(kKappa), cube, g));
    const __m256 e = exp256(_mm256_mul_ps(two, u));
    const __m256 tanh1 = _mm256_sub_ps(two, _mm256_div_ps(two, _mm256_add_ps(e, one)));
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(half, g), tanh1);
    if (up) v = _mm256_mul_ps(v, _mm256_loadu_ps(up + i));
    _mm256_storeu_ps(out + i, v);
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i];
    const float u = kBeta * (g + kKappa * g * g * g);
    const float v = 0.5f * g * (1.f + std::tanh(u));
    out[i] = up ? v * up[i] : v;
  }
}

void softcap_inplace(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] / cap) * cap;
}

float exp_sum(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.f;
#ifdef LLMOPT_AVX512
  __m512 acc = _mm512_setzero_ps();
  const __m512 sh = _mm512_set1_ps(shift);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), sh));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(LLMOPT_AVX2)
  __m256 acc = _mm256_setzero_ps();
  const __m256 sh = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = hsum256(acc);
#endif
  for (; i < n; ++i) total += (x[i] = std::exp(x[i] - shift));
  return total;
}

namespace {
void quantize_row(const float* x, int64_t k, int8_t* q, float* scale, float* sum, float* sum16) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* qb = q + b * kBlock;
#ifdef LLMOPT_AVX512
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 iv = _mm512_set1_ps(inv);
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, iv));  // round to nearest even
    const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, iv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(c1));
    const int s0 = _mm512_reduce_add_epi32(c0), s1 = _mm512_reduce_add_epi32(c1);
#elif defined(LLMOPT_AVX2)
    __m256 v[4];
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
    }
    const float amax = hmax256(mx);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i c[4];
    for (int j = 0; j < 4; ++j) {  // round to nearest even; |x * inv| <= 127 needs no clamp
      c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], iv));
      c[j] = _mm256_min_epi32(_mm256_max_epi32(c[j], _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
    }
    const __m256i p01 = _mm256_packs_epi32(c[0], c[1]), p23 = _mm256_packs_epi32(c[2], c[3]);
    const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), b8);
    const int s0 = hsum256_epi32(_mm256_add_epi32(c[0], c[1]));
    const int s1 = hsum256_epi32(_mm256_add_epi32(c[2], c[3]));
#else
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int s0 = 0, s1 = 0;
    for (int i = 0; i < kBlock; ++i) {
      int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      v = std::min(127, std::max(-127, v));
      qb[i] = static_cast<int8_t>(v);
      (i < 16 ? s0 : s1) += v;
    }
#endif
    scale[b] = amax / 127.f;
    sum[b] = scale[b] * static_cast<float>(s0 + s1);
    sum16[2 * b] = scale[b] * static_cast<float>(s0);
    sum16[2 * b + 1] = scale[b] * static_cast<float>(s1);
  }
}
}  // namespace

void quantize_rows(const float* x, int64_t n, int64_t k, QRows& out) {
  TORCH_CHECK(k % kBlock == 0, "activation width ", k, " is not a multiple of ", kBlock);
  const int64_t nb = k / kBlock;
  out.n = n;
  out.k = k;
  out.q.resize(n * k);
  out.scale.resize(n * nb);
  out.sum.resize(n * nb);
  out.sum16.resize(2 * n * nb);
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(x + r * k, k, out.q.data() + r * k, out.scale.data() + r * nb,
                   out.sum.data() + r * nb, out.sum16.data() + 2 * r * nb);
  };
  if (n < kParallelRows) {
    body(0, n);
  } else {
    parallel_for(0, n, 1, body);
  }
}

}  // namespace llmopt
