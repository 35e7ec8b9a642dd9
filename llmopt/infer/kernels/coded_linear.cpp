// Coded linears: validation of the tile layout built by llmopt/infer/fast/tiles.py, and one
// weight row dequantized (embedding lookups from a tied coded head).
#include "coded.h"

namespace llmopt {

Linear make_coded_linear(int64_t n, int64_t k, int64_t bits, int64_t group, at::Tensor codes,
                         at::Tensor scales, c10::optional<at::Tensor> mins, double zero,
                         c10::optional<at::Tensor> bias, c10::optional<at::Tensor> super_scales,
                         c10::optional<at::Tensor> super_mins) {
  Linear l;
  l.kind = CODED;
  l.n = n;
  l.k = k;
  l.bits = bits;
  l.group = group;
  l.zero = static_cast<float>(zero);
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "coded linear: bits must be 4, 6 or 8, got ",
              bits);
  TORCH_CHECK(n > 0 && k > 0 && k % kBlock == 0, "coded linear: in_features ", k,
              " must be a positive multiple of ", kBlock);
  TORCH_CHECK(group == 16 || (group >= kBlock && group % kBlock == 0), "coded linear: group ",
              group, " must be 16 or a multiple of ", kBlock);
  const int64_t line_bytes = block_bytes(bits);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 &&
                  codes.size(0) == l.tiles() && codes.size(1) == l.blocks() &&
                  codes.size(2) == line_bytes,
              "coded linear: codes must be uint8 [", l.tiles(), ", ", l.blocks(), ", ",
              line_bytes, "], got ", codes.sizes());
  l.codes = codes.contiguous();
  auto check_vec = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == l.tiles() && t.size(1) == l.groups() &&
                    t.size(2) == kTile,
                "coded linear: ", what, " must be [", l.tiles(), ", ", l.groups(), ", 16], got ",
                t.sizes());
    TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kFloat ||
                    t.scalar_type() == at::kByte || t.scalar_type() == at::kChar,
                "coded linear: ", what,
                " must be float16, float32, or uint8/int8 K-quant sub-scales");
  };
  check_vec(scales, "scales");
  l.scales = scales.contiguous();
  l.scale_f16 = scales.scalar_type() == at::kHalf;
  l.min_kind = MIN_ZERO;
  if (mins.has_value() && mins->defined() && mins->numel() > 0) {
    check_vec(*mins, "mins");
    l.mins = mins->contiguous();
    l.min_kind = mins->scalar_type() == at::kHalf ? MIN_F16 : MIN_F32;
  }
  if (scales.scalar_type() == at::kByte) {  // Q4_K: sub-scales/mins x fp16 super-scales
    const bool ok = bits == 4 && group == kBlock && k % 256 == 0 && l.mins.defined() &&
                    l.mins.scalar_type() == at::kByte && super_scales.has_value() &&
                    super_mins.has_value();
    TORCH_CHECK(ok, "coded linear: uint8 sub-scales need 4-bit codes, 32-column groups, uint8 "
                "sub-mins and fp16 super-scales and super-mins");
    for (const auto* t : {&*super_scales, &*super_mins})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 3 && t->size(0) == l.tiles() &&
                      t->size(1) == k / 256 && t->size(2) == kTile,
                  "coded linear: super-scales must be float16 [", l.tiles(), ", ", k / 256,
                  ", 16], got ", t->sizes());
    l.super_scales = super_scales->contiguous();
    l.super_mins = super_mins->contiguous();
    l.min_kind = MIN_KQ;
  } else {
    TORCH_CHECK(!l.mins.defined() || l.mins.scalar_type() != at::kByte,
                "coded linear: uint8 mins need uint8 sub-scales");
  }
  const bool q6 = bits == 6 || group == 16;
  TORCH_CHECK(!q6 || (bits == 6 && group == 16 && k % 256 == 0 && !l.mins.defined() &&
                      scales.scalar_type() == at::kChar && super_scales.has_value()),
              "coded linear: 6-bit codes (Q6_K) need 16-column groups, int8 sub-scales, fp16 "
              "super-scales and a zero point");
  TORCH_CHECK(scales.scalar_type() != at::kChar || q6, "coded linear: int8 scales are Q6_K's");
  if (q6) {
    TORCH_CHECK(super_scales->scalar_type() == at::kHalf && super_scales->dim() == 3 &&
                    super_scales->size(0) == l.tiles() && super_scales->size(1) == k / 256 &&
                    super_scales->size(2) == kTile,
                "coded linear: super-scales must be float16 [", l.tiles(), ", ", k / 256, ", 16]");
    l.super_scales = super_scales->contiguous();
  }
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    l.bias = bias->contiguous().to(at::kFloat);
    TORCH_CHECK(l.bias.numel() == n, "bias has ", l.bias.numel(), " values, want ", n);
  }
  return l;
}

void weight_row(const Linear& l, int64_t row, float* out) {
  TORCH_CHECK(row >= 0 && row < l.n, "row ", row, " outside [0, ", l.n, ")");
  if (l.kind == F32) {
    std::memcpy(out, l.w.data_ptr<float>() + row * l.k, l.k * sizeof(float));
    return;
  }
  if (l.kind == BF16) {
    auto* w = reinterpret_cast<const uint16_t*>(l.w.data_ptr<at::BFloat16>()) + row * l.k;
    for (int64_t i = 0; i < l.k; ++i) out[i] = bf16_to_f32(w[i]);
    return;
  }
  const int64_t tile = row / kTile, i = row % kTile, nb = l.blocks();
  const int64_t line_bytes = block_bytes(l.bits);
  const uint8_t* wp = l.codes.data_ptr<uint8_t>() + tile * nb * line_bytes;
  float ws[kTile], wm[kTile];
  int64_t loaded = -1;
  for (int64_t b = 0; b < nb; ++b, wp += line_bytes) {
    for (int m = 0; m < 8; ++m) {
      const int64_t g = (b * kBlock + 4 * m) / l.group;
      if (g != loaded && l.min_kind == MIN_KQ) {
        kq_lanes(l, tile, g, ws, wm);
        loaded = g;
      } else if (g != loaded && l.bits == 6) {
        q6_lanes(l, tile, g, ws);
        for (int j = 0; j < kTile; ++j) wm[j] = ws[j] * -l.zero;
        loaded = g;
      } else if (g != loaded) {
        if (l.scale_f16)
          lanes<true>(l.scales.data_ptr(), tile, l.groups(), g, ws);
        else
          lanes<false>(l.scales.data_ptr(), tile, l.groups(), g, ws);
        if (l.min_kind == MIN_ZERO)
          for (int j = 0; j < kTile; ++j) wm[j] = ws[j] * -l.zero;
        else if (l.min_kind == MIN_F16)
          lanes<true>(l.mins.data_ptr(), tile, l.groups(), g, wm);
        else
          lanes<false>(l.mins.data_ptr(), tile, l.groups(), g, wm);
        loaded = g;
      }
      for (int j = 0; j < 4; ++j) {
        const int code = code_of(wp, static_cast<int>(l.bits), m, 4 * static_cast<int>(i) + j);
        out[b * kBlock + 4 * m + j] = static_cast<float>(code) * ws[i] + wm[i];
      }
    }
  }
}

int64_t Linear::nbytes() const {
  int64_t total = 0;
  for (const at::Tensor* t : {&w, &codes, &scales, &mins, &bias, &super_scales, &super_mins})
    if (t->defined()) total += t->numel() * t->element_size();
  return total;
}

}  // namespace llmopt
