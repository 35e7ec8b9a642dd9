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

inline void axpy(float a, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef LLMOPT_AVX512
  const __m512 av = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += a * x[i];
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
  if (m.n_tok < 4)
    body(0, m.n_tok);
  else
    at::parallel_for(0, m.n_tok, 1, body);
}

void paged_attention(const AttnShape& a, const StepMeta& m, const float* qkv, int64_t ld,
                     const float* k_layer, const float* v_layer, int64_t window, float* out,
                     int64_t ld_out) {
  const int64_t d = a.head_dim, hkv = a.kv_heads, group = a.heads / hkv;
  const int64_t row = hkv * d;  // floats per cache row
  at::parallel_for(0, m.n_tok * hkv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    std::vector<int64_t> rows;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / hkv, h = w % hkv, seq = m.seq_of[t], pos = m.positions[t];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const int64_t len = pos - lo + 1;
      rows.resize(len);
      for (int64_t j = 0; j < len; ++j) rows[j] = m.slot_of(seq, lo + j) * row + h * d;
      scores.resize(group * len);
      const float* q = qkv + t * ld + h * group * d;
      for (int64_t j = 0; j < len; ++j) {
        const float* kp = k_layer + rows[j];
        for (int64_t g = 0; g < group; ++g) scores[g * len + j] = dot_f32(q + g * d, kp, d) * a.scale;
      }
      float* o = out + t * ld_out + h * group * d;
      std::fill(o, o + group * d, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * len;
        if (a.softcap > 0.f) softcap_inplace(sc, len, a.softcap);
        float mx = sc[0];
        for (int64_t j = 1; j < len; ++j) mx = std::max(mx, sc[j]);
        const float inv = 1.f / exp_sum(sc, len, mx);
        for (int64_t j = 0; j < len; ++j) sc[j] *= inv;
      }
      for (int64_t j = 0; j < len; ++j) {
        const float* vp = v_layer + rows[j];
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + j], vp, o + g * d, d);
      }
    }
  });
}

}  // namespace llmopt
