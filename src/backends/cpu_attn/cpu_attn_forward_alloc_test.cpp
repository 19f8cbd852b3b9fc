// CPU_ATTN's forward allocates nothing once the builder ran: the workspace
// lives in the step's metadata. Allocations are counted by the test binary's
// replaced operator new (testing/counting_allocator.h).
#include <gtest/gtest.h>
#include <pagedattn/backend/backend.h>
#include <pagedattn/metadata.h>
#include <pagedattn/tensor.h>

#include <utility>
#include <vector>

#include "backends/cpu_attn/cpu_attn_backend.h"
#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cpu_attn/cpu_attn_test_problem.h"
#include "backends/cpu_attn/kernels/cpu_attn_isa.h"
#include "testing/counting_allocator.h"

namespace pagedattn {
namespace {

const CpuAttnBackend kBackend;

constexpr int kHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadSize = 64;
constexpr int kBlockSize = 16;

AttentionImplParams layer_params(AttentionType type) {
  AttentionImplParams params = cpu_attn_test::bf16_layer(kHeads, kKvHeads, kHeadSize, CacheDType::Auto);
  params.attn_type = type;
  return params;
}

std::unique_ptr<AttentionMetadataBuilder> builder() {
  return kBackend.make_builder(cpu_attn_test::builder_params(kBlockSize, kKvHeads, kHeadSize, kHeads));
}

// (query_len, seq_len) per request, each request on its own blocks.
CommonAttentionMetadata step(const std::vector<std::pair<int, int>>& requests, bool causal, int& blocks) {
  std::vector<RequestSpec> specs;
  blocks = 0;
  for (const auto& [query_len, seq_len] : requests) {
    RequestSpec spec{query_len, seq_len, {}};
    for (int b = 0; b < (seq_len + kBlockSize - 1) / kBlockSize; ++b) spec.blocks.push_back(blocks++);
    specs.push_back(spec);
  }
  MetadataOptions options;
  options.block_size = kBlockSize;
  options.causal = causal;
  return make_common_metadata(specs, options);
}

// Counts the allocations of a decoder step's forward call over a paged cache
// (the builder ran), on every ISA.
void expect_no_allocation(const std::vector<std::pair<int, int>>& requests) {
  int blocks = 0;
  const CommonAttentionMetadata common = step(requests, true, blocks);
  const auto md = builder()->build(common);
  const Tensor cache = Tensor::zeros(
      kBackend.kv_cache_shape(blocks, kBlockSize, kKvHeads, kHeadSize, CacheDType::Auto), DType::BF16);
  const KVCacheView kv = kBackend.unbind_kv_cache(cache);
  const auto impl = kBackend.make_impl(layer_params(AttentionType::Decoder));
  const Tensor query = Tensor::zeros({common.num_actual_tokens, kHeads, kHeadSize}, DType::BF16);
  const Tensor out = Tensor::zeros({common.num_actual_tokens, kHeads, kHeadSize}, DType::BF16);
  const Tensor lse = Tensor::zeros({kHeads, common.num_actual_tokens}, DType::F32);
  cpu_attn_test::for_each_isa([&](cpu_attn::Isa isa) {
    const auto forward = [&] { impl->forward({}, query, {}, {}, kv, *md, out, lse); };
    EXPECT_EQ(test::allocations_during(forward), 0) << cpu_attn::isa_name(isa);
  });
}

TEST(CpuAttnForwardAllocTest, DecodeAllocatesNothing) { expect_no_allocation({{1, 300}, {1, 40}}); }

TEST(CpuAttnForwardAllocTest, PrefillAllocatesNothing) { expect_no_allocation({{40, 100}, {17, 17}}); }

TEST(CpuAttnForwardAllocTest, SplitDecodeAllocatesNothing) {
  expect_no_allocation({{1, cpu_attn::kSplitKeys * 2 + 100}, {3, cpu_attn::kSplitKeys + 1}});
}

TEST(CpuAttnForwardAllocTest, EncoderAllocatesNothing) {
  int blocks = 0;
  const CommonAttentionMetadata common = step({{30, 30}, {12, 12}}, false, blocks);
  const auto md = builder()->build(common);
  const auto impl = kBackend.make_impl(layer_params(AttentionType::Encoder));
  const int tokens = common.num_actual_tokens;
  const Tensor query = Tensor::zeros({tokens, kHeads, kHeadSize}, DType::BF16);
  const Tensor key = Tensor::zeros({tokens, kKvHeads, kHeadSize}, DType::BF16);
  const Tensor value = Tensor::zeros({tokens, kKvHeads, kHeadSize}, DType::BF16);
  const Tensor out = Tensor::zeros({tokens, kHeads, kHeadSize}, DType::BF16);
  cpu_attn_test::for_each_isa([&](cpu_attn::Isa isa) {
    const auto forward = [&] { impl->forward({}, query, key, value, {}, *md, out, {}); };
    EXPECT_EQ(test::allocations_during(forward), 0) << cpu_attn::isa_name(isa);
  });
}

// The counter sees what runs in its span: a builder run allocates (the tests
// above would otherwise pass vacuously).
TEST(CpuAttnForwardAllocTest, CounterSeesTheBuilder) {
  int blocks = 0;
  const CommonAttentionMetadata common = step({{1, 40}}, true, blocks);
  const auto step_builder = builder();
  EXPECT_GT(test::allocations_during([&] { static_cast<void>(step_builder->build(common)); }), 0);
}

}  // namespace
}  // namespace pagedattn
