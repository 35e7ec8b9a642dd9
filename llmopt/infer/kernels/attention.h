// Paged attention of one step (attention.cpp) and the step metadata it reads.
#pragma once

#include "common.h"

namespace llmopt {

struct AttnShape {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 1e-6;    // of the per-head q/k norms
  float scale = 1.f;    // multiplies q.k
  float softcap = 0.f;  // > 0: scores -> cap * tanh(score / cap) before the softmax
};

// Validated views of one engine step's metadata (model.cpp checks them).
struct StepMeta {
  int64_t n_tok = 0, n_seq = 0, block_size = 0, max_blocks = 0;
  const int64_t* positions = nullptr;  // [n_tok]
  const int64_t* slots = nullptr;      // [n_tok] cache rows the new keys/values go to
  const int64_t* seq_of = nullptr;     // [n_tok] sequence of each token
  const int32_t* block_tables = nullptr;  // [n_seq, max_blocks]
  // Tree steps (speculative draft trees): the step index of each token's parent, or -1 for
  // a token whose parent is the last cached one. Null: every sequence's tokens are a chain.
  // A token sees its sequence's cached keys before the step and its own ancestors' (and its
  // own) keys, which sit at those tokens' slots.
  const int64_t* parents = nullptr;       // [n_tok] or null
  int64_t slot_of(int64_t seq, int64_t pos) const;
};

// One layer's k and v cache rows [rows, kv_heads, head_dim] of float32, bfloat16 or float16.
struct CacheLayer {
  void* k = nullptr;
  void* v = nullptr;
  at::ScalarType dtype = at::kFloat;
};

// q/k norms and RoPE in place on qkv rows [n_tok, ld] (q | k | v heads), then k/v into the
// layer's cache rows at m.slots.
void qkv_to_cache(const AttnShape& a, const StepMeta& m, float* qkv, int64_t ld,
                  const float* q_norm, const float* k_norm, const float* cos, const float* sin,
                  const CacheLayer& cache);

// out[t, heads * head_dim] = softmax(q k^T * scale [capped]) v over the visible cached keys.
void paged_attention(const AttnShape& a, const StepMeta& m, const float* qkv, int64_t ld,
                     const CacheLayer& cache, int64_t window, float* out, int64_t ld_out);

}  // namespace llmopt
