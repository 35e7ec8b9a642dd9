// Attention of one engine step over the paged KV cache (vLLM's layout and metadata).
//
// The cache of one layer is rows [num_blocks * block_size, kv_heads, head_dim]; the key of
// position p of sequence s lives in row block_tables[s][p / block_size] * block_size +
// p % block_size. A query at position q sees keys at positions (q - window, q] (all of
// [0, q] without a window). Work is split over (token, kv head) pairs; the keys and values of
// a pair are read once for all query heads of its group, and each pair's arithmetic is the
// same whatever else is in the step (batched rows equal batch-1 rows).
#include "attention.h"

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

// softmax in place over one head's scores (capped first when softcap > 0)
inline void softmax(float* sc, int64_t len, float softcap) {
  if (softcap > 0.f) softcap_inplace(sc, len, softcap);
  float mx = sc[0];
  for (int64_t j = 1; j < len; ++j) mx = std::max(mx, sc[j]);
  const float inv = 1.f / exp_sum(sc, len, mx);
  for (int64_t j = 0; j < len; ++j) sc[j] *= inv;
}

// Any head_dim: q.k per key, then p-weighted sums of the values.
void attend_generic(const AttnShape& a, int64_t group, const float* q, const float* const* k,
                    const float* const* v, int64_t len, float* scores, float* out) {
  const int64_t d = a.head_dim;
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * len;
    for (int64_t j = 0; j < len; ++j) sc[j] = dot_f32(q + g * d, k[j], d) * a.scale;
    softmax(sc, len, a.softcap);
    float* o = out + g * d;
    std::fill(o, o + d, 0.f);
    for (int64_t j = 0; j < len; ++j)
      for (int64_t e = 0; e < d; ++e) o[e] += sc[j] * v[j][e];
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
template <int ND>
void attend_avx512(const AttnShape& a, int64_t group, const float* q, const float* const* k,
                   const float* const* v, int64_t len, float* scores, float* out) {
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
        acc[r] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k[j + r]));
        for (int c = 1; c < ND; ++c) acc[r] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k[j + r] + 16 * c), acc[r]);
      }
      _mm_storeu_ps(sc + j, _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), scale));
    }
    for (; j < len; ++j) {
      __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k[j]));
      for (int c = 1; c < ND; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k[j] + 16 * c), acc);
      sc[j] = _mm512_reduce_add_ps(acc) * a.scale;
    }
    softmax(sc, len, a.softcap);
    __m512 o[ND];
    for (int c = 0; c < ND; ++c) o[c] = _mm512_setzero_ps();
    for (j = 0; j < len; ++j) {
      const __m512 p = _mm512_set1_ps(sc[j]);
      for (int c = 0; c < ND; ++c) o[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v[j] + 16 * c), o[c]);
    }
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(out + g * d + 16 * c, o[c]);
  }
}
#endif

using AttendFn = void (*)(const AttnShape&, int64_t, const float*, const float* const*,
                          const float* const*, int64_t, float*, float*);

AttendFn attend_for(int64_t head_dim) {
#ifdef LLMOPT_AVX512
  switch (head_dim) {
    case 16: return attend_avx512<1>;
    case 32: return attend_avx512<2>;
    case 64: return attend_avx512<4>;
    case 128: return attend_avx512<8>;
    case 256: return attend_avx512<16>;
    default: break;
  }
#endif
  return attend_generic;
}

}  // namespace

int64_t StepMeta::slot_of(int64_t seq, int64_t pos) const {
  const int64_t block = block_tables[seq * max_blocks + pos / block_size];
  return block * block_size + pos % block_size;
}

void qkv_to_cache(const AttnShape& a, const StepMeta& m, float* qkv, int64_t ld,
                  const float* q_norm, const float* k_norm, const float* cos, const float* sin,
                  float* k_layer, float* v_layer) {
  const int64_t d = a.head_dim, hkv = a.kv_heads;
  auto body = [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(d);
    for (int64_t t = t0; t < t1; ++t) {
      float* q = qkv + t * ld;
      float* k = q + a.heads * d;
      const float* v = k + hkv * d;
      const float* c = cos + m.positions[t] * d;
      const float* s = sin + m.positions[t] * d;
      for (int64_t h = 0; h < a.heads; ++h) {
        if (q_norm) {
          rmsnorm_row(q + h * d, q_norm, tmp.data(), d, a.eps);
          std::memcpy(q + h * d, tmp.data(), d * sizeof(float));
        }
        rope(q + h * d, c, s, d);
      }
      float* kc = k_layer + m.slots[t] * hkv * d;
      float* vc = v_layer + m.slots[t] * hkv * d;
      for (int64_t h = 0; h < hkv; ++h) {
        if (k_norm) {
          rmsnorm_row(k + h * d, k_norm, tmp.data(), d, a.eps);
          std::memcpy(k + h * d, tmp.data(), d * sizeof(float));
        }
        rope(k + h * d, c, s, d);
      }
      std::memcpy(kc, k, hkv * d * sizeof(float));
      std::memcpy(vc, v, hkv * d * sizeof(float));
    }
  };
  if (m.n_tok < kParallelRows)
    body(0, m.n_tok);
  else
    at::parallel_for(0, m.n_tok, 1, body);
}

void paged_attention(const AttnShape& a, const StepMeta& m, const float* qkv, int64_t ld,
                     const float* k_layer, const float* v_layer, int64_t window, float* out,
                     int64_t ld_out) {
  const int64_t d = a.head_dim, hkv = a.kv_heads, group = a.heads / hkv;
  const int64_t row = hkv * d;  // floats per cache row
  const AttendFn attend = attend_for(d);
  at::parallel_for(0, m.n_tok * hkv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    std::vector<const float*> keys, values;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / hkv, h = w % hkv, seq = m.seq_of[t], pos = m.positions[t];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t len = pos - lo + 1;
      keys.resize(len);
      values.resize(len);
      for (int64_t j = 0; j < len; ++j) {
        const int64_t off = m.slot_of(seq, lo + j) * row + h * d;
        keys[j] = k_layer + off;
        values[j] = v_layer + off;
      }
      scores.resize(group * len);
      attend(a, group, qkv + t * ld + h * group * d, keys.data(), values.data(), len,
             scores.data(), out + t * ld_out + h * group * d);
    }
  });
}

}  // namespace llmopt
