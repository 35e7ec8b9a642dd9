// One engine step of a decoder in one C++ call: all layers for N tokens of S sequences
// (decode tokens, prefill chunks, speculative verify runs) over the paged KV cache.
//
// Why: an eager step is ~50 small torch ops per layer, each paying dispatch overhead, and
// torch's kernels for packed low-bit weights are far from the memory roofline on CPU. Per
// layer: RMSNorm -> QKV projection -> q/k norms, RoPE, cache store -> paged attention ->
// O projection -> [post-attention norm] -> residual -> RMSNorm -> gate/up projection ->
// SiLU/GELU -> down projection -> [post-MLP norm] -> residual. Projections run every token of
// the step through each weight tile once (GEMM); elementwise work is per token.
#include "model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace llmopt {

namespace {

int64_t total_out(const std::vector<Linear>& parts) {
  int64_t n = 0;
  for (const auto& p : parts) n += p.n;
  return n;
}

void check_parts(const std::vector<Linear>& parts, int64_t n, int64_t k, const std::string& what) {
  TORCH_CHECK(!parts.empty(), what, ": no weights");
  for (const auto& p : parts)
    TORCH_CHECK(p.k == k, what, ": in_features ", p.k, ", want ", k);
  TORCH_CHECK(total_out(parts) == n, what, ": out_features ", total_out(parts), ", want ", n);
}

at::Tensor float_vec(const at::Tensor& t, int64_t n, const std::string& what) {
  TORCH_CHECK(t.defined() && t.numel() == n, what, ": want ", n, " values");
  return t.contiguous().to(at::kFloat);
}

// fn(t) for every row; in parallel when there are many rows
template <typename F>
void each_row(int64_t n, F fn) {
  if (n < kParallelRows) {
    for (int64_t t = 0; t < n; ++t) fn(t);
  } else {
    parallel_for(0, n, 1, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) fn(t);
    });
  }
}

}  // namespace

Model::Model(ModelShape shape, Linear embed, std::vector<Layer> layers, at::Tensor final_norm,
             std::vector<Linear> head, at::Tensor cos, at::Tensor sin)
    : shape_(shape), embed_(std::move(embed)), layers_(std::move(layers)), head_(std::move(head)) {
  const auto& s = shape_;
  TORCH_CHECK(s.heads > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0, "heads ", s.heads,
              " must be a positive multiple of kv_heads ", s.kv_heads);
  TORCH_CHECK(s.head_dim > 0 && s.head_dim % 2 == 0, "head_dim ", s.head_dim, " must be even");
  TORCH_CHECK(s.ffn >= MLP_SILU_GATED && s.ffn <= MLP_GELU, "unknown ffn kind ", s.ffn);
  qkv_dim_ = (s.heads + 2 * s.kv_heads) * s.head_dim;
  up_dim_ = s.ffn == MLP_GELU ? s.inter : 2 * s.inter;
  TORCH_CHECK(embed_.n == s.vocab && embed_.k == s.hidden, "embedding must be [", s.vocab, ", ",
              s.hidden, "]");
  check_parts(head_, s.vocab, s.hidden, "head");
  const size_t norms = s.sandwich ? 4 : 2;
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& l = layers_[i];
    const std::string name = "layer " + std::to_string(i);
    TORCH_CHECK(l.norms.size() == norms, name, ": ", norms, " norms expected");
    for (auto& t : l.norms) t = float_vec(t, s.hidden, name + " norm");
    if (l.q_norm.defined()) l.q_norm = float_vec(l.q_norm, s.head_dim, name + " q_norm");
    if (l.k_norm.defined()) l.k_norm = float_vec(l.k_norm, s.head_dim, name + " k_norm");
    check_parts(l.qkv, qkv_dim_, s.hidden, name + " qkv");
    check_parts(l.o, s.hidden, s.heads * s.head_dim, name + " o");
    check_parts(l.up, up_dim_, s.hidden, name + " up");
    check_parts(l.down, s.hidden, s.inter, name + " down");
  }
  final_norm_ = float_vec(final_norm, s.hidden, "final norm");
  cos_ = cos.contiguous().to(at::kFloat);
  sin_ = sin.contiguous().to(at::kFloat);
  TORCH_CHECK(cos_.dim() == 2 && cos_.size(1) == s.head_dim && sin_.sizes() == cos_.sizes(),
              "rope tables must be [positions, ", s.head_dim, "]");
  max_pos_ = cos_.size(0);
  attn_.heads = s.heads;
  attn_.kv_heads = s.kv_heads;
  attn_.head_dim = s.head_dim;
  attn_.eps = s.eps;
  attn_.scale = static_cast<float>(s.attn_scale > 0 ? s.attn_scale
                                                    : 1.0 / std::sqrt(double(s.head_dim)));
  attn_.softcap = static_cast<float>(s.attn_softcap);
}

int64_t Model::weight_bytes() const {
  int64_t total = 0;
  auto add = [&](const std::vector<Linear>& parts) {
    for (const auto& p : parts) total += p.nbytes();
  };
  for (const auto& l : layers_) {
    add(l.qkv);
    add(l.o);
    add(l.up);
    add(l.down);
    for (const auto& t : l.norms) total += t.numel() * 4;
    if (l.q_norm.defined()) total += 2 * l.q_norm.numel() * 4;
  }
  add(head_);
  return total + final_norm_.numel() * 4 + embed_.nbytes() / embed_.n;
}

void Model::project(const std::vector<Linear>& parts, const float* x, int64_t n_tok, float* y) {
  const int64_t ldy = total_out(parts);
  bool coded = false;
  for (const auto& p : parts) coded = coded || p.kind == CODED;
  if (coded) quantize_rows(x, n_tok, parts[0].k, qx_);
  int64_t col = 0;
  for (const auto& p : parts) {
    linear_rows(p, x, &qx_, n_tok, y + col, ldy);
    col += p.n;
  }
}

void Model::run(const StepMeta& m, const int64_t* tokens, const int64_t* rows, int64_t n_rows,
                const at::Tensor& k_cache, const at::Tensor& v_cache, float* logits,
                float* hidden, const float* inputs) {
  const auto& s = shape_;
  const int64_t n = m.n_tok, hd = s.hidden, qd = s.heads * s.head_dim;
  x_.resize(n * hd);
  h_.resize(n * hd);
  tmp_.resize(n * hd);
  qkv_.resize(n * qkv_dim_);
  att_.resize(n * qd);
  up_.resize(n * up_dim_);
  mid_.resize(n * s.inter);
  float *x = x_.data(), *h = h_.data(), *tmp = tmp_.data();
  const float embed_scale = static_cast<float>(s.embed_scale);
  each_row(n, [&](int64_t t) {
    if (inputs) {  // the caller's input vectors (a feature draft head's fused inputs)
      std::memcpy(x + t * hd, inputs + t * hd, hd * sizeof(float));
      return;
    }
    weight_row(embed_, tokens[t], x + t * hd);
    if (embed_scale != 1.f)
      for (int64_t i = 0; i < hd; ++i) x[t * hd + i] *= embed_scale;
  });
  // bytes of one layer's cache
  const int64_t layer_bytes = k_cache.size(1) * s.kv_heads * s.head_dim * k_cache.element_size();
  char* k_base = static_cast<char*>(k_cache.data_ptr());
  char* v_base = static_cast<char*>(v_cache.data_ptr());
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& l = layers_[li];
    auto norm = [&](const float* src, int which, float* dst) {
      const float* w = l.norms[which].data_ptr<float>();
      each_row(n, [&](int64_t t) { rmsnorm_row(src + t * hd, w, dst + t * hd, hd, s.eps); });
    };
    auto residual = [&](const float* add) {
      each_row(n, [&](int64_t t) {
        for (int64_t i = 0; i < hd; ++i) x[t * hd + i] += add[t * hd + i];
      });
    };
    const CacheLayer cache{k_base + li * layer_bytes, v_base + li * layer_bytes,
                           k_cache.scalar_type()};
    norm(x, 0, h);
    project(l.qkv, h, n, qkv_.data());
    qkv_to_cache(attn_, m, qkv_.data(), qkv_dim_,
                 l.q_norm.defined() ? l.q_norm.data_ptr<float>() : nullptr,
                 l.k_norm.defined() ? l.k_norm.data_ptr<float>() : nullptr,
                 cos_.data_ptr<float>(), sin_.data_ptr<float>(), cache);
    paged_attention(attn_, m, qkv_.data(), qkv_dim_, cache, l.window, att_.data(), qd);
    project(l.o, att_.data(), n, tmp);
    if (s.sandwich) {
      norm(tmp, 1, tmp);
      residual(tmp);
      norm(x, 2, h);
    } else {
      residual(tmp);
      norm(x, 1, h);
    }
    project(l.up, h, n, up_.data());
    each_row(n, [&](int64_t t) {
      const float* u = up_.data() + t * up_dim_;
      float* o = mid_.data() + t * s.inter;
      if (s.ffn == MLP_SILU_GATED)
        silu_mul(u, u + s.inter, o, s.inter);
      else if (s.ffn == MLP_GELU_GATED)
        gelu_mul(u, u + s.inter, o, s.inter);
      else
        gelu_mul(u, nullptr, o, s.inter);
    });
    project(l.down, mid_.data(), n, tmp);
    if (s.sandwich) norm(tmp, 3, tmp);
    residual(tmp);
  }
  if (n_rows == 0) return;
  last_.resize(n_rows * hd);
  const float* fw = final_norm_.data_ptr<float>();
  each_row(n_rows, [&](int64_t r) { rmsnorm_row(x + rows[r] * hd, fw, last_.data() + r * hd, hd, s.eps); });
  if (hidden) std::memcpy(hidden, last_.data(), n_rows * hd * sizeof(float));
  project(head_, last_.data(), n_rows, logits);
  if (s.final_softcap > 0)
    each_row(n_rows, [&](int64_t r) {
      softcap_inplace(logits + r * s.vocab, s.vocab, static_cast<float>(s.final_softcap));
    });
}

at::Tensor Model::forward(const at::Tensor& tokens, const at::Tensor& positions,
                          const at::Tensor& slots, const at::Tensor& query_start,
                          const at::Tensor& seq_lens, const at::Tensor& block_tables,
                          const at::Tensor& logits_rows, at::Tensor k_cache, at::Tensor v_cache,
                          int64_t block_size, int64_t threads,
                          const c10::optional<at::Tensor>& parents,
                          const c10::optional<at::Tensor>& hidden,
                          const c10::optional<at::Tensor>& inputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  const at::Tensor tree = parents.has_value() ? *parents : at::Tensor();
  check_step(tokens, positions, slots, query_start, seq_lens, block_tables, logits_rows, k_cache,
             v_cache, block_size, tree);
  const int64_t r = logits_rows.numel();
  float* hidden_out = nullptr;
  if (hidden.has_value() && hidden->defined()) {
    const auto& hd = *hidden;
    if (hd.scalar_type() != at::kFloat || !hd.is_contiguous() || hd.dim() != 2 ||
        hd.size(0) != r || hd.size(1) != shape_.hidden)
      throw StepError("hidden must be a contiguous float32 [len(logits_rows), hidden] tensor");
    hidden_out = hd.data_ptr<float>();
  }
  const float* inputs_in = nullptr;
  if (inputs.has_value() && inputs->defined()) {
    const auto& in = *inputs;
    if (in.scalar_type() != at::kFloat || !in.is_contiguous() || in.dim() != 2 ||
        in.size(0) != tokens.numel() || in.size(1) != shape_.hidden)
      throw StepError("inputs must be a contiguous float32 [len(tokens), hidden] tensor");
    inputs_in = in.data_ptr<float>();
  }
  ThreadScope scope(threads);
  StepMeta m;
  m.n_tok = tokens.numel();
  m.n_seq = seq_lens.numel();
  m.block_size = block_size;
  m.max_blocks = block_tables.size(1);
  m.positions = positions.data_ptr<int64_t>();
  m.slots = slots.data_ptr<int64_t>();
  m.seq_of = seq_of_.data();
  m.block_tables = block_tables.data_ptr<int32_t>();
  if (tree.defined()) {
    m.parents = tree.data_ptr<int64_t>();
  }
  auto logits = at::empty({r, shape_.vocab}, at::TensorOptions().dtype(at::kFloat));
  run(m, tokens.data_ptr<int64_t>(), logits_rows.data_ptr<int64_t>(), r, k_cache, v_cache,
      logits.data_ptr<float>(), hidden_out, inputs_in);
  return logits;
}

}  // namespace llmopt
