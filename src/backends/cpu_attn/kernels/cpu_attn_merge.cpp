// The CPU_ATTN merge: combines one query tile's split-KV partials in split
// order (deterministic), then finishes each row (sinks, V scale, LSE, output
// dtype). Highway foreach_target unit.

#include "backends/cpu_attn/kernels/cpu_attn_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu_attn/kernels/cpu_attn_merge.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target must come first; the rest follows.
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>

#include "backends/cpu_attn/kernels/cpu_attn_common-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_dispatch.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {

// Combines split partials in split order (deterministic), then finishes each row.
void merge_splits(const AttentionParams& p, const MergeItem& item, const PartialState& partials) {
  const int d_size = p.head_size;
  const int group = p.num_heads / p.num_kv_heads;
  const int q_tokens = item.q_end - item.q_begin;
  const int rows = q_tokens * group;
  const std::size_t row_floats = partial_row_floats(d_size);
  const std::size_t split_floats = static_cast<std::size_t>(q_tokens) * group * row_floats;
  float* first = partials.data + static_cast<std::size_t>(item.first_partial_token) * group * row_floats;
  const float v_scale = dequant_scale(p, p.v_scale, item.kv_head);
  const int first_token = p.query_start_loc[item.request];
  // The first split's accumulator row is rescaled in place; partials are scratch.
  for (int r = 0; r < rows; ++r) {
    float m = neg_inf();
    for (int s = 0; s < item.num_splits; ++s)
      m = std::max(m, first[s * split_floats + r * row_floats + d_size]);
    float* acc = first + r * row_floats;
    // Also when m is -inf: a split whose visible scores were all NaN has
    // m = -inf and a NaN sum, which makes l NaN (finish_row).
    float l = 0.0f;
    for (int s = 0; s < item.num_splits; ++s) {
      const float* part = first + s * split_floats + r * row_floats;
      const float w = part[d_size] == neg_inf() ? 0.0f : std::exp(part[d_size] - m);
      l += part[d_size + 1] * w;
      if (s == 0) {
        for (int e = 0; e < d_size; ++e) acc[e] *= w;
      } else {
        for (int e = 0; e < d_size; ++e) acc[e] += part[e] * w;
      }
    }
    const int token = first_token + item.q_begin + r / group;
    const int head = item.kv_head * group + r % group;
    finish_row(p, token, head, m, l, acc, v_scale);
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pagedattn::cpu_attn {

RunMergeFn merge_entry_for(Isa isa) { return PAGEDATTN_CPU_ATTN_ENTRY(merge_splits, isa); }

bool isa_compiled(Isa isa) {
  switch (isa) {
    case Isa::Avx512Bf16:
    case Isa::Avx512:
      return (HWY_TARGETS & HWY_AVX3) != 0;
    case Isa::Avx2:
      return (HWY_TARGETS & HWY_AVX2) != 0;
    case Isa::Scalar:
      return (HWY_TARGETS & HWY_SCALAR) != 0;
  }
  return false;
}

}  // namespace pagedattn::cpu_attn
#endif  // HWY_ONCE
