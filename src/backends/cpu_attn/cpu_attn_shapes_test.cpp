// CPU_ATTN on the GQA groups and MQA shapes of real models, against REFERENCE
// on every ISA: prefill tiles whose rows (query tokens x query heads per KV
// head) outnumber the head size many times over, which is what the kernel's
// per-item scratch must hold.
#include <gtest/gtest.h>

#include <vector>

#include "backends/cpu_attn/cpu_attn_backend.h"
#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cpu_attn/cpu_attn_test_problem.h"

namespace pagedattn {
namespace {

using cpu_attn_test::for_each_isa;
using cpu_attn_test::LayerSpec;
using cpu_attn_test::PagedProblem;

const CpuAttnBackend kBackend;

struct GroupShape {
  int heads;
  int kv_heads;
  int head_size;
  int query_tokens;
};

// Keys before the prefill's first token: a few key tiles per item.
constexpr int kContext = 130;

// Each shape once with bf16 (the AVX512-BF16 prefill path: bf16 queries and
// keys) and once with f32, as one prefill request after a context.
void expect_shapes_match_reference(const std::vector<GroupShape>& shapes) {
  std::uint32_t seed = 1;
  for (const GroupShape& s : shapes) {
    for (const DType dtype : {DType::BF16, DType::F32}) {
      LayerSpec spec;
      spec.heads = s.heads;
      spec.kv_heads = s.kv_heads;
      spec.head_size = s.head_size;
      spec.dtype = dtype;
      spec.layout = KVCacheLayout::HND;
      const PagedProblem problem(spec, {{s.query_tokens, kContext + s.query_tokens}}, seed++);
      const cpu_attn_test::ForwardResult want = problem.run(cpu_attn_test::reference_backend());
      for_each_isa([&](cpu_attn::Isa isa) {
        const auto failure = compare_with_reference(want, problem.run(kBackend), problem);
        EXPECT_FALSE(failure.has_value())
            << cpu_attn::isa_name(isa) << " " << problem.describe() << ": " << failure.value_or("");
      });
    }
  }
}

// A prefill tile of kQueryTileTokens tokens has 16 G rows for a group of G:
// 17 / 1 at head size 128 and 33 / 1 at 256 are the first groups past 2 D
// rows, 15 / 1 one below; MQA and Llama-style 64 / 8 at the sizes models use.
TEST(CpuAttnLargeGroups, PrefillTilesMatchReferenceOnEveryIsa) {
  static_assert(cpu_attn::kQueryTileTokens == 16, "the shapes straddle 2 D rows of a 16-token tile");
  expect_shapes_match_reference({{15, 1, 128, 16},
                                 {17, 1, 128, 16},
                                 {33, 1, 256, 16},
                                 {32, 1, 128, 16},
                                 {48, 1, 128, 20},
                                 {64, 8, 128, 16},
                                 {64, 8, 256, 17}});
}

// MQA with 64 query heads: 1024 rows per tile, a partial last tile.
TEST(CpuAttnLargeGroups, MqaLongPrefillMatchesReferenceOnEveryIsa) {
  expect_shapes_match_reference({{64, 1, 128, 100}});
}

// Decodes and speculative steps long enough to be split: with a large group
// their items have many rows (the prefill paths) and their partial states
// hold a row per query head.
TEST(CpuAttnLargeGroups, SplitDecodesMatchReferenceOnEveryIsa) {
  constexpr int kKeys = cpu_attn::kSplitKeys + 200;
  std::uint32_t seed = 100;
  for (const GroupShape& s :
       {GroupShape{17, 1, 128, 1}, GroupShape{64, 1, 128, 1}, GroupShape{64, 8, 256, 1}}) {
    LayerSpec spec;
    spec.heads = s.heads;
    spec.kv_heads = s.kv_heads;
    spec.head_size = s.head_size;
    const PagedProblem problem(spec, {{1, kKeys}, {cpu_attn::kSplitMaxQueryTokens, kKeys}}, seed++);
    const cpu_attn_test::ForwardResult want = problem.run(cpu_attn_test::reference_backend());
    for_each_isa([&](cpu_attn::Isa isa) {
      const auto failure = compare_with_reference(want, problem.run(kBackend), problem);
      EXPECT_FALSE(failure.has_value())
          << cpu_attn::isa_name(isa) << " " << problem.describe() << ": " << failure.value_or("");
    });
  }
}

}  // namespace
}  // namespace pagedattn
