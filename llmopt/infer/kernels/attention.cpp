// Attention of one engine step over the paged KV cache (vLLM's layout and metadata).
//
// The cache of one layer is rows [num_blocks * block_size, kv_heads, head_dim]; the key of
// position p of sequence s lives in row block_tables[s][p / block_size] * block_size +
// p % block_size. A query at position q sees keys at positions (q - window, q] (all of
// [0, q] without a window). Work is split over (token, kv head) pairs; the keys and values of
// a pair are read once for all query heads of its group, and each pair's arithmetic is the
// same whatever else is in the step (batched rows equal batch-1 rows). The cache holds fp32,
// bf16 or fp16 (the model's dtype, as the engine allocates it); math is fp32 throughout.
#include "attention.h"
#include "avx2.h"

#include <algorithm>
#include <cmath>

namespace llmopt {

namespace {

inline void rope(float* v, const float* cos, const float* sin, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = v[i], b = v[i + h];
    v[i] = a * cos[i] - b * sin[i];
    v[i + h] = b * cos[i + h] + a * sin[i + h];
  }
}

// Cache elements: fp32, or bf16 / fp16 (half the bytes; rounded to nearest even when stored).
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static float get(const float* p) { return *p; }
  static void put(float v, float* p) { *p = v; }
#ifdef LLMOPT_AVX512
  static __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#elif defined(LLMOPT_AVX2)
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#endif
};
template <>
struct Elem<at::BFloat16> {
  static float get(const at::BFloat16* p) { return static_cast<float>(*p); }
  static void put(float v, at::BFloat16* p) { *p = at::BFloat16(v); }
#ifdef LLMOPT_AVX512
  static __m512 load16(const at::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#elif defined(LLMOPT_AVX2)
  static __m256 load8(const at::BFloat16* p) { return load8_bf16(reinterpret_cast<const uint16_t*>(p)); }
#endif
};
template <>
struct Elem<at::Half> {
  static float get(const at::Half* p) { return static_cast<float>(*p); }
  static void put(float v, at::Half* p) { *p = at::Half(v); }
#ifdef LLMOPT_AVX512
  static __m512 load16(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
#elif defined(LLMOPT_AVX2)
  static __m256 load8(const at::Half* p) { return load8_f16(reinterpret_cast<const uint16_t*>(p)); }
#endif
};

// softmax in place over one head's scores (capped first when softcap > 0)
inline void softmax(float* sc, int64_t len, float softcap) {
  if (softcap > 0.f) softcap_inplace(sc, len, softcap);
  float mx = sc[0];
  for (int64_t j = 1; j < len; ++j) mx = std::max(mx, sc[j]);
  const float inv = 1.f / exp_sum(sc, len, mx);
  for (int64_t j = 0; j < len; ++j) sc[j] *= inv;
}

// Any head_dim: q.k per key, then p-weighted sums of the values.
template <typename T>
void attend_generic(const AttnShape& a, int64_t group, const float* q, const T* const* k,
                    const T* const* v, int64_t len, float* scores, float* out) {
  const int64_t d = a.head_dim;
  std::vector<float> row(d);
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * len;
    for (int64_t j = 0; j < len; ++j) {
      for (int64_t e = 0; e < d; ++e) row[e] = Elem<T>::get(k[j] + e);
      sc[j] = dot_f32(q + g * d, row.data(), d) * a.scale;
    }
    softmax(sc, len, a.softcap);
    float* o = out + g * d;
    std::fill(o, o + d, 0.f);
    for (int64_t j = 0; j < len; ++j)
      for (int64_t e = 0; e < d; ++e) o[e] += sc[j] * Elem<T>::get(v[j] + e);
  }
}

#ifdef LLMOPT_AVX512
// sums of the 16 lanes of a, b, c, d (in that order)
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));
  w = _mm512_add_ps(w, _mm512_permute_ps(w, 0xB1));
  const __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(pick, w));
}

// head_dim = 16 * ND: q and the output of one head stay in registers; four keys share one
// reduction.
template <typename T, int ND>
void attend_avx512(const AttnShape& a, int64_t group, const float* q, const T* const* k,
                   const T* const* v, int64_t len, float* scores, float* out) {
  constexpr int64_t d = 16 * ND;
  const __m128 scale = _mm_set1_ps(a.scale);
  for (int64_t g = 0; g < group; ++g) {
    __m512 qv[ND];
    for (int c = 0; c < ND; ++c) qv[c] = _mm512_loadu_ps(q + g * d + 16 * c);
    float* sc = scores + g * len;
    int64_t j = 0;
    for (; j + 4 <= len; j += 4) {
      __m512 acc[4];
      for (int r = 0; r < 4; ++r) {
        acc[r] = _mm512_mul_ps(qv[0], Elem<T>::load16(k[j + r]));
        for (int c = 1; c < ND; ++c) acc[r] = _mm512_fmadd_ps(qv[c], Elem<T>::load16(k[j + r] + 16 * c), acc[r]);
      }
      _mm_storeu_ps(sc + j, _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), scale));
    }
    for (; j < len; ++j) {
      __m512 acc = _mm512_mul_ps(qv[0], Elem<T>::load16(k[j]));
      for (int c = 1; c < ND; ++c) acc = _mm512_fmadd_ps(qv[c], Elem<T>::load16(k[j] + 16 * c), acc);
      sc[j] = _mm512_reduce_add_ps(acc) * a.scale;
    }
    softmax(sc, len, a.softcap);
    __m512 o[ND];
    for (int c = 0; c < ND; ++c) o[c] = _mm512_setzero_ps();
    for (j = 0; j < len; ++j) {
      const __m512 p = _mm512_set1_ps(sc[j]);
      for (int c = 0; c < ND; ++c) o[c] = _mm512_fmadd_ps(p, Elem<T>::load16(v[j] + 16 * c), o[c]);
    }
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(out + g * d + 16 * c, o[c]);
  }
}
#elif defined(LLMOPT_AVX2)
// sums of the 8 lanes of a, b, c, d (in that order)
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// head_dim = 8 * ND: the AVX-512 kernel's scheme with 8-lane vectors.
template <typename T, int ND>
void attend_avx2(const AttnShape& a, int64_t group, const float* q, const T* const* k,
                 const T* const* v, int64_t len, float* scores, float* out) {
  constexpr int64_t d = 8 * ND;
  const __m128 scale = _mm_set1_ps(a.scale);
  for (int64_t g = 0; g < group; ++g) {
    __m256 qv[ND];
    for (int c = 0; c < ND; ++c) qv[c] = _mm256_loadu_ps(q + g * d + 8 * c);
    float* sc = scores + g * len;
    int64_t j = 0;
    for (; j + 4 <= len; j += 4) {
      __m256 acc[4];
      for (int r = 0; r < 4; ++r) {
        acc[r] = _mm256_mul_ps(qv[0], Elem<T>::load8(k[j + r]));
        for (int c = 1; c < ND; ++c) acc[r] = _mm256_fmadd_ps(qv[c], Elem<T>::load8(k[j + r] + 8 * c), acc[r]);
      }
      _mm_storeu_ps(sc + j, _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), scale));
    }
    for (; j < len; ++j) {
      __m256 acc = _mm256_mul_ps(qv[0], Elem<T>::load8(k[j]));
      for (int c = 1; c < ND; ++c) acc = _mm256_fmadd_ps(qv[c], Elem<T>::load8(k[j] + 8 * c), acc);
      sc[j] = hsum256(acc) * a.scale;
    }
    softmax(sc, len, a.softcap);
    __m256 o[ND];
    for (int c = 0; c < ND; ++c) o[c] = _mm256_setzero_ps();
    for (j = 0; j < len; ++j) {
      const __m256 p = _mm256_set1_ps(sc[j]);
      for (int c = 0; c < ND; ++c) o[c] = _mm256_fmadd_ps(p, Elem<T>::load8(v[j] + 8 * c), o[c]);
    }
    for (int c = 0; c < ND; ++c) _mm256_storeu_ps(out + g * d + 8 * c, o[c]);
  }
}
#endif

template <typename T>
using AttendFn = void (*)(const AttnShape&, int64_t, const float*, const T* const*,
                          const T* const*, int64_t, float*, float*);

template <typename T>
AttendFn<T> attend_for(int64_t head_dim) {
#ifdef LLMOPT_AVX512
  switch (head_dim) {
    case 16: return attend_avx512<T, 1>;
    case 32: return attend_avx512<T, 2>;
    case 64: return attend_avx512<T, 4>;
    case 128: return attend_avx512<T, 8>;
    case 256: return attend_avx512<T, 16>;
    default: break;
  }
#elif defined(LLMOPT_AVX2)
  switch (head_dim) {
    case 16: return attend_avx2<T, 2>;
    case 32: return attend_avx2<T, 4>;
    case 64: return attend_avx2<T, 8>;
    case 128: return attend_avx2<T, 16>;
    case 256: return attend_avx2<T, 32>;
    default: break;
  }
#endif
  return attend_generic<T>;
}

template <typename T>
void store_rows(const AttnShape& a, const StepMeta& m, const float* qkv, int64_t ld, T* k_layer,
                T* v_layer) {
  const int64_t n = a.kv_heads * a.head_dim;
  for (int64_t t = 0; t < m.n_tok; ++t) {
    const float* k = qkv + t * ld + a.heads * a.head_dim;
    T* kc = k_layer + m.slots[t] * n;
    T* vc = v_layer + m.slots[t] * n;
    for (int64_t i = 0; i < n; ++i) {
      Elem<T>::put(k[i], kc + i);
      Elem<T>::put(k[n + i], vc + i);
    }
  }
}

template <typename T>
void attention_t(const AttnShape& a, const StepMeta& m, const float* qkv, int64_t ld,
                 const T* k_layer, const T* v_layer, int64_t window, float* out, int64_t ld_out) {
  const int64_t d = a.head_dim, hkv = a.kv_heads, group = a.heads / hkv;
  const int64_t row = hkv * d;  // elements per cache row
  const AttendFn<T> attend = attend_for<T>(d);
  parallel_for(0, m.n_tok * hkv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    std::vector<const T*> keys, values;
    std::vector<int64_t> chain;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / hkv, h = w % hkv, seq = m.seq_of[t], pos = m.positions[t];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t len = pos - lo + 1;
      keys.resize(len);
      values.resize(len);
      // positions before `cached_end` come from the block table, the rest from the chain
      int64_t cached_end = pos + 1;
      if (m.parents) {
        chain.clear();
        for (int64_t u = t; u >= 0; u = m.parents[u]) chain.push_back(u);  // t, ..., root
        cached_end = pos + 1 - static_cast<int64_t>(chain.size());
      }
      for (int64_t j = 0; j < len; ++j) {
        const int64_t p = lo + j;
        const int64_t slot = p < cached_end ? m.slot_of(seq, p) : m.slots[chain[pos - p]];
        const int64_t off = slot * row + h * d;
        keys[j] = k_layer + off;
        values[j] = v_layer + off;
      }
      scores.resize(group * len);
      attend(a, group, qkv + t * ld + h * group * d, keys.data(), values.data(), len,
             scores.data(), out + t * ld_out + h * group * d);
    }
  });
}

}  // namespace

int64_t StepMeta::slot_of(int64_t seq, int64_t pos) const {
  const int64_t block = block_tables[seq * max_blocks + pos / block_size];
  return block * block_size + pos % block_size;
}

void qkv_to_cache(const AttnShape& a, const StepMeta& m, float* qkv, int64_t ld,
                  const float* q_norm, const float* k_norm, const float* cos, const float* sin,
                  const CacheLayer& cache) {
  const int64_t d = a.head_dim, hkv = a.kv_heads;
  auto body = [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(d);
    for (int64_t t = t0; t < t1; ++t) {
      float* q = qkv + t * ld;
      float* k = q + a.heads * d;
      const float* c = cos + m.positions[t] * d;
      const float* s = sin + m.positions[t] * d;
      for (int64_t h = 0; h < a.heads; ++h) {
        if (q_norm) {
          rmsnorm_row(q + h * d, q_norm, tmp.data(), d, a.eps);
          std::memcpy(q + h * d, tmp.data(), d * sizeof(float));
        }
        rope(q + h * d, c, s, d);
      }
      for (int64_t h = 0; h < hkv; ++h) {
        if (k_norm) {
          rmsnorm_row(k + h * d, k_norm, tmp.data(), d, a.eps);
          std::memcpy(k + h * d, tmp.data(), d * sizeof(float));
        }
        rope(k + h * d, c, s, d);
      }
    }
  };
  if (m.n_tok < kParallelRows)
    body(0, m.n_tok);
  else
    parallel_for(0, m.n_tok, 1, body);
  switch (cache.dtype) {
    case at::kFloat:
      return store_rows(a, m, qkv, ld, static_cast<float*>(cache.k), static_cast<float*>(cache.v));
    case at::kBFloat16:
      return store_rows(a, m, qkv, ld, static_cast<at::BFloat16*>(cache.k),
                        static_cast<at::BFloat16*>(cache.v));
    default:
      return store_rows(a, m, qkv, ld, static_cast<at::Half*>(cache.k),
                        static_cast<at::Half*>(cache.v));
  }
}

void paged_attention(const AttnShape& a, const StepMeta& m, const float* qkv, int64_t ld,
                     const CacheLayer& cache, int64_t window, float* out, int64_t ld_out) {
  switch (cache.dtype) {
    case at::kFloat:
      return attention_t(a, m, qkv, ld, static_cast<const float*>(cache.k),
                         static_cast<const float*>(cache.v), window, out, ld_out);
    case at::kBFloat16:
      return attention_t(a, m, qkv, ld, static_cast<const at::BFloat16*>(cache.k),
                         static_cast<const at::BFloat16*>(cache.v), window, out, ld_out);
    default:
      return attention_t(a, m, qkv, ld, static_cast<const at::Half*>(cache.k),
                         static_cast<const at::Half*>(cache.v), window, out, ld_out);
  }
}

}  // namespace llmopt
