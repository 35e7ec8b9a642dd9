// Validation of one step's metadata before any cache row is written: a bad slot or block
// table would otherwise corrupt another sequence's keys or read out of bounds.
#include <sstream>

#include "model.h"

namespace llmopt {

namespace {

template <typename... Args>
[[noreturn]] void fail(const Args&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  throw StepError(out.str());
}

void want(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  if (!t.defined() || t.scalar_type() != dtype || t.dim() != dim || !t.is_contiguous() ||
      t.device().type() != at::kCPU)
    fail(name, " must be a contiguous CPU ", c10::toString(dtype), " tensor with ", dim,
         " dimension(s)", t.defined() ? "" : " (got None)");
}

}  // namespace

void Model::check_step(const at::Tensor& tokens, const at::Tensor& positions,
                       const at::Tensor& slots, const at::Tensor& query_start,
                       const at::Tensor& seq_lens, const at::Tensor& block_tables,
                       const at::Tensor& logits_rows, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, int64_t block_size,
                       const at::Tensor& parents) {
  const auto& s = shape_;
  want(tokens, "tokens", at::kLong, 1);
  want(positions, "positions", at::kLong, 1);
  want(slots, "slots", at::kLong, 1);
  want(query_start, "query_start", at::kLong, 1);
  want(seq_lens, "seq_lens", at::kLong, 1);
  want(block_tables, "block_tables", at::kInt, 2);
  want(logits_rows, "logits_rows", at::kLong, 1);
  const auto cache_type = k_cache.defined() ? k_cache.scalar_type() : at::kFloat;
  if (cache_type != at::kFloat && cache_type != at::kBFloat16 && cache_type != at::kHalf)
    fail("k_cache must be float32, bfloat16 or float16, got ", c10::toString(cache_type));
  want(k_cache, "k_cache", cache_type, 4);
  want(v_cache, "v_cache", cache_type, 4);
  const int64_t n = tokens.numel(), n_seq = seq_lens.numel();
  if (n == 0) fail("a step needs at least one token");
  if (positions.numel() != n || slots.numel() != n)
    fail("positions (", positions.numel(), ") and slots (", slots.numel(),
         ") must have one entry per token (", n, ")");
  if (query_start.numel() != n_seq + 1 || n_seq == 0)
    fail("query_start must have len(seq_lens) + 1 = ", n_seq + 1, " entries, got ",
         query_start.numel());
  if (block_tables.size(0) != n_seq)
    fail("block_tables has ", block_tables.size(0), " rows for ", n_seq, " sequences");
  const std::vector<int64_t> cache_shape = {num_layers(), k_cache.size(1), s.kv_heads, s.head_dim};
  if (k_cache.sizes().vec() != cache_shape || v_cache.sizes() != k_cache.sizes())
    fail("k_cache and v_cache must be [layers=", num_layers(), ", rows, kv_heads=", s.kv_heads,
         ", head_dim=", s.head_dim, "], got ", k_cache.sizes(), " and ", v_cache.sizes());
  if (block_size <= 0 || k_cache.size(1) % block_size)
    fail("block_size ", block_size, " must be positive and divide the cache's ", k_cache.size(1),
         " rows");
  const int64_t num_blocks = k_cache.size(1) / block_size, max_blocks = block_tables.size(1);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  if (qs[0] != 0 || qs[n_seq] != n)
    fail("query_start must start at 0 and end at the token count ", n, ", got ", qs[0], " .. ",
         qs[n_seq]);
  const bool tree = parents.defined();
  const int64_t* par = nullptr;
  if (tree) {
    want(parents, "parents", at::kLong, 1);
    if (parents.numel() != n) fail("parents (", parents.numel(), ") must have one entry per token (", n, ")");
    par = parents.data_ptr<int64_t>();
  }
  seq_of_.resize(n);
  for (int64_t q = 0; q < n_seq; ++q) {
    if (qs[q + 1] <= qs[q])
      fail("sequence ", q, " has no tokens (query_start ", qs[q], " -> ", qs[q + 1], ")");
    if (lens[q] < qs[q + 1] - qs[q] || lens[q] > max_pos_)
      fail("seq_lens[", q, "] = ", lens[q], " must cover its ", qs[q + 1] - qs[q],
           " new tokens and stay within the model's ", max_pos_, " positions");
    const int64_t blocks = (lens[q] + block_size - 1) / block_size;
    if (blocks > max_blocks)
      fail("sequence ", q, " needs ", blocks, " blocks, block_tables has ", max_blocks, " columns");
    for (int64_t b = 0; b < blocks; ++b)
      if (bt[q * max_blocks + b] < 0 || bt[q * max_blocks + b] >= num_blocks)
        fail("block_tables[", q, ", ", b, "] = ", bt[q * max_blocks + b], " outside [0, ",
             num_blocks, ")");
    for (int64_t t = qs[q]; t < qs[q + 1]; ++t) {
      seq_of_[t] = q;
      if (tok[t] < 0 || tok[t] >= s.vocab)
        fail("token ", tok[t], " at row ", t, " outside the vocabulary [0, ", s.vocab, ")");
      if (pos[t] < 0 || pos[t] >= lens[q])
        fail("position ", pos[t], " at row ", t, " outside its sequence's [0, ", lens[q], ")");
      // a chain stores position p at p's row; a tree stores its i-th token at row base + i
      const int64_t base = lens[q] - (qs[q + 1] - qs[q]);
      const int64_t at = tree ? base + (t - qs[q]) : pos[t];
      const int64_t expect =
          int64_t(bt[q * max_blocks + at / block_size]) * block_size + at % block_size;
      if (slot[t] != expect)
        fail("slot ", slot[t], " at row ", t, " is not where block_tables puts ",
             tree ? "tree row " : "position ", at, " of sequence ", q, " (", expect, ")");
      if (tree) {
        const int64_t u = par[t];
        if (u != -1 && (u < qs[q] || u >= t))
          fail("parents[", t, "] = ", u, " must be -1 or an earlier token of its sequence [",
               qs[q], ", ", t, ")");
        const int64_t want_pos = u == -1 ? base : pos[u] + 1;
        if (pos[t] != want_pos)
          fail("position ", pos[t], " at row ", t, " must be ", want_pos,
               u == -1 ? " (the cached length: a root of the tree)" : " (its parent's + 1)");
      }
    }
  }
  const int64_t* rows = logits_rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < logits_rows.numel(); ++r)
    if (rows[r] < 0 || rows[r] >= n) fail("logits_rows[", r, "] = ", rows[r], " outside [0, ", n, ")");
}

}  // namespace llmopt
