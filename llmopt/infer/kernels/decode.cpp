// Batch-1 decode step for Llama-family decoders: one call per token, fp32 activations.
//
// Why: an eager decode step is ~30 small torch ops per layer, each paying dispatch overhead,
// and torch's GEMV kernels for bf16/int4/int8 weights are far from the memory roofline on CPU.
// Here every layer is RMSNorm -> fused QKV GEMV -> RoPE -> cache store -> attention -> O GEMV
// -> RMSNorm -> fused gate/up GEMV -> SiLU*mul -> down GEMV, all in one C++ call.
//
// GEMV kinds: fp32 and bf16 weights (fp32 math on fp32 activations), and u8-coded weights
// (4-bit repacked two per byte, or 8-bit) with per-group scale s and zero z, W = (q - z) s.
// Coded GEMVs quantize the activation to int8 per 32-column block (scale max|x|/127) and use
// AVX-VNNI u8 x s8 dot products, llama.cpp style; the zero point is applied once per group
// through the block sums of the dequantized activation.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__AVX512BW__)
#define LLMOPT_AVX512 1
#include <immintrin.h>
#endif

namespace {

enum Kind : int64_t { F32 = 0, BF16 = 1, Q4 = 2, Q8 = 3 };

struct Linear {
  int64_t kind, n, k, group;  // group: columns per scale group (k for one per row)
  at::Tensor w, scales, zs, bias;  // zs = scale * zero, both fp32 [n, groups]
  int64_t groups() const { return (k + group - 1) / group; }
};

Linear make_linear(int64_t kind, at::Tensor w, at::Tensor scales, at::Tensor zs,
                   c10::optional<at::Tensor> bias, int64_t group) {
  Linear l;
  l.kind = kind;
  l.n = w.size(0);
  l.k = (kind == Q4) ? w.size(1) * 2 : w.size(1);
  l.group = group > 0 ? group : l.k;
  l.w = w.contiguous();
  TORCH_CHECK(kind >= F32 && kind <= Q8, "unknown linear kind ", kind);
  if (kind == F32) TORCH_CHECK(w.scalar_type() == at::kFloat, "F32 linear needs float32");
  if (kind == BF16) TORCH_CHECK(w.scalar_type() == at::kBFloat16, "BF16 linear needs bf16");
  if (kind == Q4 || kind == Q8) {
    TORCH_CHECK(w.scalar_type() == at::kByte, "coded linear needs uint8 codes");
    TORCH_CHECK(l.k % 64 == 0, "coded linear needs in_features % 64 == 0, got ", l.k);
    TORCH_CHECK(l.group % 64 == 0 || l.group == l.k, "group ", l.group, " not a multiple of 64");
    l.scales = scales.contiguous().to(at::kFloat);
    l.zs = zs.contiguous().to(at::kFloat);
    TORCH_CHECK(l.scales.size(0) == l.n && l.scales.size(1) == l.groups(), "bad scales shape");
    TORCH_CHECK(l.zs.sizes() == l.scales.sizes(), "bad zero shape");
  }
  if (bias.has_value() && bias->defined()) {
    l.bias = bias->contiguous().to(at::kFloat);
    TORCH_CHECK(l.bias.numel() == l.n, "bias has ", l.bias.numel(), " values, want ", l.n);
  }
  return l;
}

// ---------------------------------------------------------------- row dot products
inline float dot_f32(const float* w, const float* x, int64_t k) {
  int64_t i = 0;
  float s = 0.f;
#ifdef LLMOPT_AVX512
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
  }
  for (; i + 16 <= k; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
  s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
  for (; i < k; ++i) s += w[i] * x[i];
  return s;
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
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
#endif
  for (; i < k; ++i) s += bf16_to_f32(w[i]) * x[i];
  return s;
}

// fp32 rows four at a time: each 16-float slice of x is loaded once for four weight rows
// (1.25 loads per FMA instead of 2) and eight independent FMA chains stay in flight. One row at
// a time left the fp32 GEMV below torch's mv; A/B on SmolLM2's shapes, 1 thread: 1.27x less
// CPU time. (bf16 rows showed no gain this way and keep the one-row loop.)
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
#endif
  for (; i < k; ++i)
    for (int j = 0; j < 4; ++j) s[j] += r[j][i] * x[i];
  for (int j = 0; j < 4; ++j) out[j] = s[j];
}

// Activation quantized for coded GEMVs: int8 codes, one scale per 32 columns.
struct QAct {
  std::vector<int8_t> q;
  std::vector<float> scale, bsum;  // per 32-block: scale, scale * sum(codes)
};

void quantize_act(const float* x, int64_t k, QAct& a) {
  int64_t nb = k / 32;
  a.q.resize(k);
  a.scale.resize(nb);
  a.bsum.resize(nb);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      v = std::min(127, std::max(-127, v));
      a.q[b * 32 + i] = static_cast<int8_t>(v);
      sum += v;
    }
    a.scale[b] = s;
    a.bsum[b] = s * static_cast<float>(sum);
  }
}

// R rows at once (row j at w + j * ws, its scales at sc + j * ss): sum over 64-column chunks of
// scale(group) * (xs0 * dot(lo, xq0) + xs1 * dot(hi, xq1)). The activation codes are loaded once
// per chunk for all R rows; each row's arithmetic is the same as with R = 1 (same result).
template <bool FOUR, int R>
inline void dot_coded(const uint8_t* w, int64_t ws, const float* sc, int64_t ss, int64_t group,
                      const QAct& a, int64_t k, float* out) {
  const int64_t chunks = k / 64;
#ifdef LLMOPT_AVX512
  __m256 acc[R];
  for (int j = 0; j < R; ++j) acc[j] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t c = 0; c < chunks; ++c) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + c * 64));
    const __m256i x1 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + c * 64 + 32));
    const float xs0 = a.scale[2 * c], xs1 = a.scale[2 * c + 1];
    for (int j = 0; j < R; ++j) {
      const uint8_t* wr = w + j * ws;
      const float g = sc[j * ss + (c * 64) / group];
      __m256i lo, hi;
      if (FOUR) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + c * 32));
        lo = _mm256_and_si256(v, mask);
        hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      } else {
        lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + c * 64));
        hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + c * 64 + 32));
      }
      __m256i d0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x0);
      __m256i d1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi, x1);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(g * xs0), acc[j]);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(g * xs1), acc[j]);
    }
  }
  for (int j = 0; j < R; ++j) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    out[j] = _mm_cvtss_f32(r);
  }
#else
  for (int j = 0; j < R; ++j) {
    const uint8_t* wr = w + j * ws;
    float s = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      float g = sc[j * ss + (c * 64) / group];
      int d0 = 0, d1 = 0;
      for (int i = 0; i < 32; ++i) {
        int lo = FOUR ? (wr[c * 32 + i] & 0x0F) : wr[c * 64 + i];
        int hi = FOUR ? (wr[c * 32 + i] >> 4) : wr[c * 64 + 32 + i];
        d0 += lo * a.q[c * 64 + i];
        d1 += hi * a.q[c * 64 + 32 + i];
      }
      s += g * (a.scale[2 * c] * d0 + a.scale[2 * c + 1] * d1);
    }
    out[j] = s;
  }
#endif
}

// Rows [r, r + R) of a coded linear into y (zero points and bias applied).
template <int R>
inline void coded_rows(const Linear& l, int64_t r, const QAct& act, const float* gsum,
                       const float* bias, float* y) {
  const int64_t g = l.groups(), k = l.k;
  const float* sc = l.scales.data_ptr<float>() + r * g;
  const uint8_t* w = l.w.data_ptr<uint8_t>();
  float v[R];
  if (l.kind == Q4)
    dot_coded<true, R>(w + r * (k / 2), k / 2, sc, g, l.group, act, k, v);
  else
    dot_coded<false, R>(w + r * k, k, sc, g, l.group, act, k, v);
  for (int j = 0; j < R; ++j) {
    const float* zs = l.zs.data_ptr<float>() + (r + j) * g;
    for (int64_t i = 0; i < g; ++i) v[j] -= zs[i] * gsum[i];
    y[r + j] = bias ? v[j] + bias[r + j] : v[j];
  }
}

// y[n] = W x (+ bias); `act` is scratch for coded kinds. Rows go four at a time, then one by one.
void gemv(const Linear& l, const float* x, float* y, QAct& act) {
  const int64_t n = l.n, k = l.k;
  std::vector<float> gsum;
  if (l.kind == Q4 || l.kind == Q8) {
    quantize_act(x, k, act);
    const int64_t per = l.group / 32;
    gsum.assign(l.groups(), 0.f);
    for (int64_t b = 0; b < k / 32; ++b) gsum[b / per] += act.bsum[b];
  }
  const float* bias = l.bias.defined() ? l.bias.data_ptr<float>() : nullptr;
  const int64_t grain = std::max<int64_t>(16, n / (8 * at::get_num_threads() + 1));
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    int64_t rows = 1;
    for (int64_t r = r0; r < r1; r += rows) {
      rows = l.kind != BF16 && r + 4 <= r1 ? 4 : 1;
      if (l.kind == F32) {
        if (rows == 4) {
          dot4_f32(l.w.data_ptr<float>() + r * k, k, x, y + r);
        } else {
          y[r] = dot_f32(l.w.data_ptr<float>() + r * k, x, k);
        }
        for (int64_t j = 0; bias && j < rows; ++j) y[r + j] += bias[r + j];
      } else if (l.kind == BF16) {
        auto* w = reinterpret_cast<const uint16_t*>(l.w.data_ptr<at::BFloat16>());
        y[r] = dot_bf16(w + r * k, x, k) + (bias ? bias[r] : 0.f);
      } else if (rows == 4) {
        coded_rows<4>(l, r, act, gsum.data(), bias, y);
      } else {
        coded_rows<1>(l, r, act, gsum.data(), bias, y);
      }
    }
  });
}

void rmsnorm(const float* x, const float* w, float* y, int64_t n, double eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  float inv = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

void rope(float* v, const float* cos, const float* sin, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    float a = v[i], b = v[i + h];
    v[i] = a * cos[i] - b * sin[i];
    v[i + h] = b * cos[i + h] + a * sin[i + h];
  }
}

struct Decoder {
  int64_t layers, hidden, heads, kv_heads, head_dim, inter, vocab, max_len;
  double eps;
  at::Tensor embed, final_norm, cos, sin, k_cache, v_cache, logits;
  std::vector<at::Tensor> in_norm, post_norm;
  std::vector<Linear> qkv, o, gate_up, down;
  Linear head;
  std::vector<float> x, h, qkvb, att, gu, mid, tmp, scores;
  QAct act;

  Decoder(int64_t heads_, int64_t kv_heads_, int64_t head_dim_, int64_t max_len_, double eps_,
          at::Tensor embed_, std::vector<at::Tensor> in_norm_, std::vector<at::Tensor> post_norm_,
          at::Tensor final_norm_, std::vector<Linear> qkv_, std::vector<Linear> o_,
          std::vector<Linear> gate_up_, std::vector<Linear> down_, Linear head_,
          at::Tensor cos_, at::Tensor sin_)
      : heads(heads_), kv_heads(kv_heads_), head_dim(head_dim_), max_len(max_len_), eps(eps_),
        embed(embed_.contiguous()), final_norm(final_norm_.contiguous().to(at::kFloat)),
        cos(cos_.contiguous().to(at::kFloat)), sin(sin_.contiguous().to(at::kFloat)),
        qkv(qkv_), o(o_), gate_up(gate_up_), down(down_), head(head_) {
    layers = static_cast<int64_t>(qkv.size());
    hidden = embed.size(1);
    vocab = head.n;
    TORCH_CHECK(heads % kv_heads == 0, "heads ", heads, " not a multiple of kv_heads ", kv_heads);
    TORCH_CHECK(cos.size(0) >= max_len && cos.size(1) == head_dim, "rope table too small");
    TORCH_CHECK(embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kBFloat16,
                "embedding must be float32 or bfloat16");
    for (auto& t : in_norm_) in_norm.push_back(t.contiguous().to(at::kFloat));
    for (auto& t : post_norm_) post_norm.push_back(t.contiguous().to(at::kFloat));
    for (int64_t i = 0; i < layers; ++i) {
      TORCH_CHECK(qkv[i].k == hidden && qkv[i].n == (heads + 2 * kv_heads) * head_dim,
                  "layer ", i, ": qkv shape");
      TORCH_CHECK(gate_up[i].n % 2 == 0 && down[i].k == gate_up[i].n / 2, "layer ", i, ": mlp");
    }
    inter = layers ? down[0].k : 0;
    auto opts = at::TensorOptions().dtype(at::kFloat);
    k_cache = at::zeros({layers, kv_heads, max_len, head_dim}, opts);
    v_cache = at::zeros({layers, kv_heads, max_len, head_dim}, opts);
    logits = at::zeros({vocab}, opts);
    x.resize(hidden);
    h.resize(hidden);
    tmp.resize(hidden);
    qkvb.resize((heads + 2 * kv_heads) * head_dim);
    att.resize(heads * head_dim);
    gu.resize(2 * inter);
    mid.resize(inter);
    scores.resize(max_len);
  }

  void attention(int64_t layer, int64_t pos) {
    const int64_t d = head_dim, groups = heads / kv_heads;
    float* q = qkvb.data();
    float* k = q + heads * d;
    float* v = k + kv_heads * d;
    const float* c = cos.data_ptr<float>() + pos * d;
    const float* s = sin.data_ptr<float>() + pos * d;
    for (int64_t i = 0; i < heads; ++i) rope(q + i * d, c, s, d);
    float* kc = k_cache.data_ptr<float>() + layer * kv_heads * max_len * d;
    float* vc = v_cache.data_ptr<float>() + layer * kv_heads * max_len * d;
    for (int64_t j = 0; j < kv_heads; ++j) {
      rope(k + j * d, c, s, d);
      std::memcpy(kc + (j * max_len + pos) * d, k + j * d, d * sizeof(float));
      std::memcpy(vc + (j * max_len + pos) * d, v + j * d, d * sizeof(float));
    }
    const float scale = 1.f / std::sqrt(static_cast<float>(d));
    for (int64_t i = 0; i < heads; ++i) {
      const float* kh = kc + (i / groups) * max_len * d;
      const float* vh = vc + (i / groups) * max_len * d;
      float mx = -INFINITY;
      for (int64_t t = 0; t <= pos; ++t) {
        scores[t] = dot_f32(kh + t * d, q + i * d, d) * scale;
        mx = std::max(mx, scores[t]);
      }
      float total = 0.f;
      for (int64_t t = 0; t <= pos; ++t) total += (scores[t] = std::exp(scores[t] - mx));
      float* out = att.data() + i * d;
      std::fill(out, out + d, 0.f);
      for (int64_t t = 0; t <= pos; ++t) {
        const float p = scores[t] / total;
        for (int64_t e = 0; e < d; ++e) out[e] += p * vh[t * d + e];
      }
    }
  }

  // Logits [vocab] for `token` at position `pos` (keys/values of 0..pos-1 already cached).
  // The returned tensor is this decoder's buffer: the next step overwrites it.
  at::Tensor step(int64_t token, int64_t pos) {
    TORCH_CHECK(token >= 0 && token < embed.size(0), "token ", token, " outside [0, ",
                embed.size(0), ")");
    TORCH_CHECK(pos >= 0 && pos < max_len, "position ", pos, " outside the cache [0, ", max_len,
                ")");
    if (embed.scalar_type() == at::kFloat) {
      std::memcpy(x.data(), embed.data_ptr<float>() + token * hidden, hidden * sizeof(float));
    } else {
      auto* e = reinterpret_cast<const uint16_t*>(embed.data_ptr<at::BFloat16>());
      for (int64_t i = 0; i < hidden; ++i) x[i] = bf16_to_f32(e[token * hidden + i]);
    }
    for (int64_t l = 0; l < layers; ++l) {
      rmsnorm(x.data(), in_norm[l].data_ptr<float>(), h.data(), hidden, eps);
      gemv(qkv[l], h.data(), qkvb.data(), act);
      attention(l, pos);
      gemv(o[l], att.data(), tmp.data(), act);
      for (int64_t i = 0; i < hidden; ++i) x[i] += tmp[i];
      rmsnorm(x.data(), post_norm[l].data_ptr<float>(), h.data(), hidden, eps);
      gemv(gate_up[l], h.data(), gu.data(), act);
      for (int64_t i = 0; i < inter; ++i) {
        const float g = gu[i];
        mid[i] = g / (1.f + std::exp(-g)) * gu[inter + i];
      }
      gemv(down[l], mid.data(), tmp.data(), act);
      for (int64_t i = 0; i < hidden; ++i) x[i] += tmp[i];
    }
    rmsnorm(x.data(), final_norm.data_ptr<float>(), h.data(), hidden, eps);
    gemv(head, h.data(), logits.data_ptr<float>(), act);
    return logits;
  }
};

at::Tensor linear_forward(const Linear& l, at::Tensor x) {
  TORCH_CHECK(x.dim() == 1 && x.numel() == l.k && x.scalar_type() == at::kFloat,
              "x must be float32 [", l.k, "]");
  auto xc = x.contiguous();
  auto y = at::empty({l.n}, xc.options());
  QAct act;
  gemv(l, xc.data_ptr<float>(), y.data_ptr<float>(), act);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("HAS_AVX512_VNNI") = py::bool_(
#ifdef LLMOPT_AVX512
      true
#else
      false
#endif
  );
  py::class_<Linear>(m, "Linear")
      .def_readonly("kind", &Linear::kind)
      .def_readonly("out_features", &Linear::n)
      .def_readonly("in_features", &Linear::k)
      .def("__call__", &linear_forward);
  m.def("make_linear", &make_linear, py::arg("kind"), py::arg("w"), py::arg("scales"),
        py::arg("zs"), py::arg("bias"), py::arg("group"));
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, at::Tensor,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor,
                    std::vector<Linear>, std::vector<Linear>, std::vector<Linear>,
                    std::vector<Linear>, Linear, at::Tensor, at::Tensor>())
      .def("step", &Decoder::step, py::call_guard<py::gil_scoped_release>())
      .def_readonly("k_cache", &Decoder::k_cache)
      .def_readonly("v_cache", &Decoder::v_cache)
      .def_readonly("max_len", &Decoder::max_len);
}
