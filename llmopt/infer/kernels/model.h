// The fused decoder forward over a paged KV cache (model.cpp).
#pragma once

#include <mutex>
#include <stdexcept>
#include <string>

#include "attention.h"
#include "common.h"

namespace llmopt {

// Bad step metadata or inputs (Python sees a ValueError).
struct StepError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

enum Mlp : int64_t { MLP_SILU_GATED = 0, MLP_GELU_GATED = 1, MLP_GELU = 2 };

struct ModelShape {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, inter = 0, vocab = 0;
  double eps = 1e-5;
  bool sandwich = false;  // Gemma 2: norms on the attention / MLP outputs too
  int64_t ffn = MLP_SILU_GATED;
  double embed_scale = 1.0;  // Gemma: sqrt(hidden)
  double attn_scale = 0.0;   // 0: 1 / sqrt(head_dim)
  double attn_softcap = 0.0, final_softcap = 0.0;  // 0: none
};

struct Layer {
  // pre-norm block: [input, post_attention]; sandwich: [input, post_attention, pre_ff, post_ff]
  std::vector<at::Tensor> norms;
  at::Tensor q_norm, k_norm;  // per-head norms (Qwen3) or undefined
  // each projection is a list of segments whose outputs are concatenated (q | k | v,
  // gate | up): one segment when the parts share a weight format
  std::vector<Linear> qkv, o, up, down;
  int64_t window = 0;  // > 0: sliding window of this layer
};

class Model {
 public:
  Model(ModelShape shape, Linear embed, std::vector<Layer> layers, at::Tensor final_norm,
        std::vector<Linear> head, at::Tensor cos, at::Tensor sin);

  // Logits [logits_rows, vocab] of one step; keys/values of every token go to the cache
  // (k_cache / v_cache: [layers, rows, kv_heads, head_dim] float32, bfloat16 or float16).
  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& positions,
                     const at::Tensor& slots, const at::Tensor& query_start,
                     const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     const at::Tensor& logits_rows, at::Tensor k_cache, at::Tensor v_cache,
                     int64_t block_size, int64_t threads,
                     const c10::optional<at::Tensor>& parents = c10::nullopt,
                     const c10::optional<at::Tensor>& hidden = c10::nullopt,
                     const c10::optional<at::Tensor>& inputs = c10::nullopt);

  int64_t weight_bytes() const;  // bytes of every weight one token reads (one embedding row)
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  const ModelShape& shape() const { return shape_; }

 private:
  void check_step(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& slots,
                  const at::Tensor& query_start, const at::Tensor& seq_lens,
                  const at::Tensor& block_tables, const at::Tensor& logits_rows,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t block_size,
                  const at::Tensor& parents);
  void project(const std::vector<Linear>& parts, const float* x, int64_t n_tok, float* y);
  void run(const StepMeta& m, const int64_t* tokens, const int64_t* rows, int64_t n_rows,
           const at::Tensor& k_cache, const at::Tensor& v_cache, float* logits, float* hidden,
           const float* inputs);

  ModelShape shape_;
  AttnShape attn_;
  Linear embed_;
  std::vector<Layer> layers_;
  at::Tensor final_norm_, cos_, sin_;
  std::vector<Linear> head_;
  int64_t qkv_dim_ = 0, up_dim_ = 0, max_pos_ = 0;
  std::mutex mutex_;  // one step at a time: the buffers below are shared
  std::vector<float> x_, h_, qkv_, att_, tmp_, up_, mid_, last_;
  std::vector<int64_t> seq_of_;
  QRows qx_;
};

}  // namespace llmopt
