// make_local_attention_virtual_batches: requests become one virtual request
// per chunk their queries fall in, with that chunk's block-table entries; and
// a layer with an attention_chunk_size refuses metadata that was not split.
#include <pagedattn/attention.h>
#include <pagedattn/backend/registry.h>
#include <pagedattn/metadata.h>

#include <gtest/gtest.h>

#include <vector>

#include "testing/expect_error.h"

namespace pagedattn {
namespace {

constexpr int kBlock = 2;
constexpr int kChunk = 4;

std::vector<std::int32_t> values(const Tensor& t) {
  const std::vector<float> f = to_float_vector(t);
  return {f.begin(), f.end()};
}

CommonAttentionMetadata step() {
  // Request 0: 3 queries at positions 7..9 of 10 keys; request 1: one decode
  // at position 4; request 2: a 9-token prefill from position 0.
  const std::vector<RequestSpec> requests{
      {3, 10, {10, 11, 12, 13, 14}}, {1, 5, {20, 21, 22}}, {9, 9, {30, 31, 32, 33, 34}}};
  return make_common_metadata(requests, {.block_size = kBlock});
}

TEST(LocalAttentionTest, RequestsSplitIntoOneVirtualRequestPerChunkOfTheirQueries) {
  const CommonAttentionMetadata common = step();
  const CommonAttentionMetadata local = make_local_attention_virtual_batches(common, kChunk);
  // Request 0: chunk 1 (keys 4..7) holds query 7, chunk 2 (keys 8, 9) queries 8 and 9.
  // Request 1: chunk 1 holds query 4 over key 4. Request 2: chunks 0, 1, 2.
  EXPECT_EQ(values(local.query_start_loc_cpu), (std::vector<std::int32_t>{0, 1, 3, 4, 8, 12, 13}));
  EXPECT_EQ(values(local.seq_lens_cpu), (std::vector<std::int32_t>{4, 2, 1, 4, 4, 1}));
  EXPECT_EQ(values(local.block_table_cpu),
            (std::vector<std::int32_t>{12, 13, 14, kNullBlockId, 22, kNullBlockId, 30, 31, 32, 33, 34,
                                       kNullBlockId}));
  EXPECT_EQ(local.num_reqs, 6);
  EXPECT_EQ(local.num_actual_tokens, common.num_actual_tokens);
  EXPECT_EQ(local.max_query_len, 4);
  EXPECT_EQ(local.max_seq_len, 4);
  EXPECT_EQ(local.local_chunk_size, kChunk);
  // The slots, and so the token order, are the step's own.
  EXPECT_EQ(local.slot_mapping.data(), common.slot_mapping.data());
  local.validate("test");
}

TEST(LocalAttentionTest, AChunkThatIsNotAMultipleOfTheBlockSizeOrASplitStepIsRejected) {
  const CommonAttentionMetadata common = step();
  test::expect_invalid([&] { make_local_attention_virtual_batches(common, 3); }, "chunk_size");
  const CommonAttentionMetadata local = make_local_attention_virtual_batches(common, kChunk);
  test::expect_invalid([&] { make_local_attention_virtual_batches(local, kChunk); }, "local_chunk_size");
}

TEST(LocalAttentionTest, AChunkedLayerRefusesAStepThatWasNotSplitAndBadChunkSizes) {
  ModelContext model({.dtype = DType::F32});
  AttentionOptions options;
  options.cache_config = CacheConfig{.block_size = kBlock};
  options.attn_backend = BackendRegistry::instance().find("CPU_ATTN");
  options.prefix = "odd";
  options.attention_chunk_size = 3;
  test::expect_invalid([&] { Attention(model, 4, 16, 0.25f, options); }, "attention_chunk_size");
  options.prefix = "local";
  options.attention_chunk_size = kChunk;
  Attention layer(model, 4, 16, 0.25f, options);
  allocate_kv_caches(model, {.num_blocks = 40});
  const Tensor q = Tensor::zeros({13, 4, 16}, DType::F32);
  ForwardContext context;
  auto builder = layer.backend().make_builder({kBlock, 4, 16, Device::cpu(), {"local"}, 4});
  context.metadata = builder->build(step());  // not split
  ForwardContextScope scope(std::move(context));
  test::expect_invalid([&] { layer.forward(q, q, q); }, "local_chunk_size");
}

}  // namespace
}  // namespace pagedattn
