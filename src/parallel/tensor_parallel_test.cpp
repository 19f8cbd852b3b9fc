// Tensor-parallel head sharding and the per-rank KV-cache size.
#include <gtest/gtest.h>
#include <pagedattn/parallel.h>

#include <functional>
#include <string>
#include <utility>

#include "testing/expect_error.h"

namespace pagedattn {
namespace {

using test::expect_invalid;

TEST(TensorParallelShard, SplitsQueryAndKVHeads) {
  // Llama-3-8B (32 query heads, 8 KV heads) on 4 ranks.
  for (int rank = 0; rank < 4; ++rank) {
    const TensorParallelShard s = shard_heads(32, 8, 4, rank);
    EXPECT_EQ(s.num_heads, 8);
    EXPECT_EQ(s.num_kv_heads, 2);
    EXPECT_EQ(s.first_head, 8 * rank);
    EXPECT_EQ(s.end_head(), 8 * rank + 8);
    EXPECT_EQ(s.first_kv_head, 2 * rank);
    EXPECT_EQ(s.kv_head_replicas, 1);
  }
}

TEST(TensorParallelShard, ReplicatesKVHeadsWhenTpExceedsThem) {
  // 32 query heads, 2 KV heads, 8 ranks: ranks 0-3 hold KV head 0, 4-7 KV head 1.
  for (int rank = 0; rank < 8; ++rank) {
    const TensorParallelShard s = shard_heads(32, 2, 8, rank);
    EXPECT_EQ(s.num_heads, 4);
    EXPECT_EQ(s.num_kv_heads, 1);
    EXPECT_EQ(s.kv_head_replicas, 4);
    EXPECT_EQ(s.first_kv_head, rank / 4);
  }
  // MQA: every rank holds the one KV head.
  const TensorParallelShard mqa = shard_heads(16, 1, 4, 3);
  EXPECT_EQ(mqa.num_kv_heads, 1);
  EXPECT_EQ(mqa.first_kv_head, 0);
  EXPECT_EQ(mqa.kv_head_replicas, 4);
}

TEST(TensorParallelShard, EveryQueryHeadReadsItsGlobalKVHead) {
  // The rank's local GQA mapping (h / (H_local / Hkv_local)) names the same KV
  // head as the global one (g / (H / Hkv)), for every valid tp.
  for (const auto& [heads, kv_heads] :
       {std::pair{32, 8}, std::pair{32, 2}, std::pair{12, 12}, std::pair{8, 1}}) {
    for (int tp = 1; tp <= heads; ++tp) {
      if (heads % tp != 0 || (kv_heads % tp != 0 && tp % kv_heads != 0)) continue;
      int covered = 0;
      for (int rank = 0; rank < tp; ++rank) {
        const TensorParallelShard s = shard_heads(heads, kv_heads, tp, rank);
        EXPECT_EQ(s.first_head, covered);
        covered = s.end_head();
        for (int h = 0; h < s.num_heads; ++h) {
          const int global_kv = (s.first_head + h) / (heads / kv_heads);
          const int local_kv = h / (s.num_heads / s.num_kv_heads);
          EXPECT_EQ(s.first_kv_head + local_kv, global_kv) << heads << "/" << kv_heads << " tp " << tp;
        }
      }
      EXPECT_EQ(covered, heads);
    }
  }
}

TEST(TensorParallelShard, ErrorsNameTheArgument) {
  expect_invalid([] { shard_heads(32, 8, 3, 0); },
                 "shard_heads: tp_size must be a divisor of num_heads (32), got 3");
  expect_invalid([] { shard_heads(48, 12, 8, 0); },
                 "shard_heads: tp_size must be a divisor or a multiple of num_kv_heads (12), got 8");
  expect_invalid([] { shard_heads(32, 8, 4, 4); }, "shard_heads: tp_rank must be in [0, 4) (tp_size), got 4");
  expect_invalid([] { shard_heads(32, 8, 4, -1); }, "tp_rank must be in [0, 4) (tp_size), got -1");
  expect_invalid([] { shard_heads(32, 8, 0, 0); }, "tp_size must be >= 1, got 0");
  expect_invalid([] { shard_heads(0, 8, 1, 0); }, "num_heads must be >= 1, got 0");
  expect_invalid([] { shard_heads(32, 0, 1, 0); }, "num_kv_heads must be >= 1, got 0");
  expect_invalid([] { shard_heads(30, 8, 1, 0); },
                 "num_heads must be a multiple of num_kv_heads (8), got 30");
}

TEST(TensorParallelShard, KVCacheBytesPerBlock) {
  // Llama-3-8B, bf16, BS 16: 64 KiB per block on one rank, 16 KiB on each of 4.
  const FullAttentionSpec full{.block_size = 16, .num_kv_heads = 8, .head_size = 128, .dtype = DType::BF16};
  const KVCacheSpec local = shard_kv_cache_spec(full, shard_heads(32, 8, 4, 1));
  EXPECT_EQ(page_size_bytes(full), 65536u);
  EXPECT_EQ(page_size_bytes(local), 16384u);
  EXPECT_EQ(std::get<FullAttentionSpec>(local).num_kv_heads, 2);
  // Replicated KV heads: each of 8 ranks stores one of the 2 heads.
  const SlidingWindowSpec window{
      .block_size = 16, .num_kv_heads = 2, .head_size = 64, .dtype = DType::F16, .sliding_window = 128};
  const KVCacheSpec local_window = shard_kv_cache_spec(window, shard_heads(16, 2, 8, 5));
  EXPECT_EQ(page_size_bytes(local_window), 2u * 16 * 1 * 64 * 2);
  EXPECT_EQ(std::get<SlidingWindowSpec>(local_window).sliding_window, 128);
  expect_invalid([&] { shard_kv_cache_spec(full, shard_heads(32, 4, 4, 0)); },
                 "shard_kv_cache_spec: spec.num_kv_heads must be 4 (the shard's total_num_kv_heads), got 8");
}

}  // namespace
}  // namespace pagedattn
