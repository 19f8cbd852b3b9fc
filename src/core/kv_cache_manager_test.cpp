// KVCacheManager: every operation, refusals, and a randomized run of mixed
// operations checked against a shadow of the cache contents after each one.
#include <gtest/gtest.h>
#include <pagedattn/error.h>
#include <pagedattn/kv_cache_manager.h>
#include <pagedattn/metadata.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "testing/expect_error.h"

namespace pagedattn {
namespace {

using test::expect_invalid;

constexpr int kBlockSize = 16;

std::vector<std::int32_t> iota_tokens(int n, int first = 100) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

KVCacheManager make_manager(int num_blocks, std::optional<int> window = std::nullopt) {
  return KVCacheManager({num_blocks, kBlockSize, true, window});
}

TEST(BlockHashing, ChainsParentTokensAndExtraKeys) {
  const auto tokens = iota_tokens(kBlockSize);
  const BlockHash h = hash_block_tokens(kRootBlockHash, tokens);
  EXPECT_EQ(h, hash_block_tokens(kRootBlockHash, tokens));
  EXPECT_NE(h, hash_block_tokens(BlockHash{1, 0}, tokens));
  EXPECT_NE(h, hash_block_tokens(kRootBlockHash, iota_tokens(kBlockSize, 101)));
  const std::vector<std::int64_t> lora{7};
  EXPECT_NE(h, hash_block_tokens(kRootBlockHash, tokens, lora));
}

TEST(KVCacheManager, AllocateGrowsTheBlockTableAndFeedsMetadata) {
  KVCacheManager m = make_manager(8);
  m.add_request(1, iota_tokens(40));
  ASSERT_TRUE(m.allocate_slots(1, 20));  // chunked prefill: 20 of 40 tokens
  EXPECT_EQ(m.num_computed_tokens(1), 20);
  EXPECT_EQ(m.block_table(1).size(), 2U);
  ASSERT_TRUE(m.allocate_slots(1, 20));
  EXPECT_EQ(m.block_table(1).size(), 3U);
  EXPECT_EQ(m.pool().num_used_blocks(), 3);

  const std::vector<RequestSpec> specs{m.request_spec(1, 20)};
  const CommonAttentionMetadata md = make_common_metadata(specs, MetadataOptions{kBlockSize});
  EXPECT_EQ(md.seq_len(0), 40);
  EXPECT_EQ(md.query_len(0), 20);
  const auto table = m.block_table(1);
  const auto* slots = md.slot_mapping.data_as<std::int64_t>();
  EXPECT_EQ(slots[0], table[1] * kBlockSize + 4);   // position 20
  EXPECT_EQ(slots[19], table[2] * kBlockSize + 7);  // position 39

  m.append_tokens(1, std::vector<std::int32_t>{5});
  ASSERT_TRUE(m.allocate_slots(1, 1));  // decode
  EXPECT_EQ(m.num_computed_tokens(1), 41);
  EXPECT_EQ(m.num_tokens(1), 41);
}

TEST(KVCacheManager, RejectsBadInput) {
  KVCacheManager m = make_manager(8);
  expect_invalid([&] { m.allocate_slots(9, 1); }, "request");
  expect_invalid([&] { m.free(9); }, "request");
  expect_invalid([&] { m.preempt(9); }, "request");
  expect_invalid([&] { m.add_request(2, {}); }, "prompt");
  m.add_request(1, iota_tokens(10));
  expect_invalid([&] { m.add_request(1, iota_tokens(10)); }, "request");
  // Errors name the function called (allocate_slots once said num_blocks_needed).
  expect_invalid([&] { m.allocate_slots(1, -1); },
                 "KVCacheManager::allocate_slots: num_new_tokens must be >= 0");
  expect_invalid([&] { m.allocate_slots(1, 11); },
                 "KVCacheManager::allocate_slots: num_new_tokens must be <= 10");
  expect_invalid([&] { m.num_blocks_needed(1, -1); }, "KVCacheManager::num_blocks_needed: num_new_tokens");
  ASSERT_TRUE(m.allocate_slots(1, 4));
  expect_invalid([&] { m.get_computed_blocks(1); }, "request");
  expect_invalid([&] { m.request_spec(1, 5); }, "query_len");
  expect_invalid([&] { KVCacheManager({1, kBlockSize}); }, "num_blocks");
  expect_invalid([&] { KVCacheManager({8, 0}); }, "block_size");
  expect_invalid([&] { KVCacheManager({8, kBlockSize, true, 0}); }, "sliding_window");
}

TEST(KVCacheManager, CountsNearIntMaxAreRejectedNotWrapped) {
  constexpr int kIntMax = std::numeric_limits<int>::max();
  KVCacheManager m = make_manager(8);  // 7 usable blocks
  m.add_request(1, iota_tokens(10));
  ASSERT_TRUE(m.allocate_slots(1, 5));
  // 5 + INT_MAX wrapped to a negative total that passed the bound check.
  expect_invalid([&] { m.allocate_slots(1, kIntMax); }, "num_new_tokens");
  expect_invalid([&] { (void)m.num_blocks_needed(1, kIntMax); }, "num_new_tokens");
  EXPECT_EQ(m.num_computed_tokens(1), 5);
  EXPECT_EQ(m.block_table(1).size(), 1U);
  EXPECT_EQ(m.pool().num_free_blocks(), 6);
  // ceil(INT_MAX / 16) blocks, computed without wrapping.
  EXPECT_FALSE(m.can_fit(kIntMax));
  EXPECT_TRUE(KVCacheManager({2, kIntMax}).can_fit(kIntMax));
}

TEST(KVCacheManager, PoolBeyondMemoryIsOutOfMemory) {
  constexpr int kIntMax = std::numeric_limits<int>::max();
  const auto physical =
      static_cast<std::size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  if (BlockPool::bookkeeping_bytes(kIntMax) <= physical) {
    GTEST_SKIP() << "this machine's memory holds the bookkeeping of INT_MAX blocks";
  }
  // std::bad_alloc escaped before (or the process was killed where memory is overcommitted).
  test::expect_error(
      ErrorKind::OutOfMemory, [] { KVCacheManager({.num_blocks = kIntMax}); },
      "BlockPool: the bookkeeping of num_blocks 2147483647");
}

TEST(KVCacheManager, PrefixHitsOnFullBlocksOnlyAndNeverTheWholePrompt) {
  KVCacheManager m = make_manager(16);
  m.add_request(1, iota_tokens(40));
  ASSERT_TRUE(m.allocate_slots(1, 40));
  m.free(1);
  EXPECT_EQ(m.pool().num_used_blocks(), 0);

  m.add_request(2, iota_tokens(40));
  const ComputedBlocks hit = m.get_computed_blocks(2);
  EXPECT_EQ(hit.num_tokens, 32);  // the partial third block is not cached
  m.add_request(3, iota_tokens(32));
  EXPECT_EQ(m.get_computed_blocks(3).num_tokens, 16);  // the last token is recomputed
  ASSERT_TRUE(m.allocate_slots(2, 8, hit));
  EXPECT_EQ(m.num_computed_tokens(2), 40);
  EXPECT_EQ(std::vector<std::int32_t>(m.block_table(2).begin(), m.block_table(2).begin() + 2), hit.blocks);
  EXPECT_EQ(m.prefix_cache_stats().hits, 48);
  EXPECT_EQ(m.prefix_cache_stats().queries, 72);
}

TEST(KVCacheManager, SharedPrefixIsReferenceCounted) {
  KVCacheManager m = make_manager(16);
  m.add_request(1, iota_tokens(40));
  ASSERT_TRUE(m.allocate_slots(1, 40));
  std::vector<std::int32_t> fork = iota_tokens(32);
  fork.push_back(7);
  m.add_request(2, fork);
  const ComputedBlocks hit = m.get_computed_blocks(2);
  ASSERT_EQ(hit.blocks.size(), 2U);
  ASSERT_TRUE(m.allocate_slots(2, 1, hit));
  EXPECT_EQ(m.pool().ref_count(hit.blocks[0]), 2);
  EXPECT_EQ(m.pool().ref_count(hit.blocks[1]), 2);
  EXPECT_NE(m.block_table(2)[2], m.block_table(1)[2]);  // diverging tail
  m.free(1);
  EXPECT_EQ(m.pool().ref_count(hit.blocks[0]), 1);
  EXPECT_EQ(m.pool().num_used_blocks(), 3);
}

TEST(KVCacheManager, ExtraKeysSeparateCaches) {
  KVCacheManager m = make_manager(16);
  m.add_request(1, iota_tokens(40), {1});
  ASSERT_TRUE(m.allocate_slots(1, 40));
  m.add_request(2, iota_tokens(40), {2});
  EXPECT_EQ(m.get_computed_blocks(2).num_tokens, 0);
  m.add_request(3, iota_tokens(40), {1});
  EXPECT_EQ(m.get_computed_blocks(3).num_tokens, 32);
}

TEST(KVCacheManager, CachingOffNeverHits) {
  KVCacheManager m({16, kBlockSize, false});
  m.add_request(1, iota_tokens(40));
  ASSERT_TRUE(m.allocate_slots(1, 40));
  m.add_request(2, iota_tokens(40));
  EXPECT_TRUE(m.get_computed_blocks(2).blocks.empty());
  EXPECT_TRUE(m.pool().cached_blocks().empty());
}

TEST(KVCacheManager, RefusalAllocatesNothing) {
  KVCacheManager m = make_manager(4);  // 3 usable blocks
  m.add_request(1, iota_tokens(100));
  ASSERT_TRUE(m.allocate_slots(1, 20));
  const std::vector<std::int32_t> before(m.block_table(1).begin(), m.block_table(1).end());
  EXPECT_EQ(m.num_blocks_needed(1, 40), 2);
  EXPECT_FALSE(m.allocate_slots(1, 40));  // needs 2 more, 1 free
  EXPECT_EQ(std::vector<std::int32_t>(m.block_table(1).begin(), m.block_table(1).end()), before);
  EXPECT_EQ(m.num_computed_tokens(1), 20);
  EXPECT_EQ(m.pool().num_free_blocks(), 1);
  EXPECT_FALSE(m.can_fit(100));
  EXPECT_TRUE(m.can_fit(48));
  ASSERT_TRUE(m.allocate_slots(1, 28));
  EXPECT_EQ(m.pool().num_free_blocks(), 0);
}

TEST(KVCacheManager, AdmissionCountsCachedBlocksTakenFromTheFreeQueue) {
  KVCacheManager m = make_manager(4);
  m.add_request(1, iota_tokens(33));
  ASSERT_TRUE(m.allocate_slots(1, 33));
  m.free(1);  // 2 cached full blocks + 1 plain block, all free
  m.add_request(2, iota_tokens(48));
  const ComputedBlocks hit = m.get_computed_blocks(2);
  ASSERT_EQ(hit.num_tokens, 32);
  EXPECT_EQ(m.num_blocks_needed(2, 16, hit), 3);
  ASSERT_TRUE(m.allocate_slots(2, 16, hit));
  EXPECT_EQ(m.pool().num_free_blocks(), 0);
}

// A hit is only valid while its blocks still cache the request's prefix.
TEST(KVCacheManager, StaleOrForgedComputedBlocksAreRejected) {
  KVCacheManager m = make_manager(6);  // 5 usable blocks
  m.add_request(1, iota_tokens(33));
  ASSERT_TRUE(m.allocate_slots(1, 33));
  m.free(1);
  m.add_request(2, iota_tokens(48));
  const ComputedBlocks hit = m.get_computed_blocks(2);
  ASSERT_EQ(hit.blocks.size(), 2U);
  // Request 3 takes every block (evicting the hit's hashes) and writes its
  // own tokens; preempted, its blocks sit free, cached under its prefixes.
  m.add_request(3, iota_tokens(80, 5000));
  ASSERT_TRUE(m.allocate_slots(3, 80));
  m.preempt(3);
  ASSERT_EQ(m.pool().num_free_blocks(), 5);
  // Adopting the stale hit once put request 3's K/V into request 2's prefix.
  expect_invalid([&] { m.allocate_slots(2, 16, hit); },
                 "computed.blocks[0] must be a cached block of this prefix (none is cached now)");
  EXPECT_TRUE(m.block_table(2).empty());
  EXPECT_EQ(m.num_computed_tokens(2), 0);
  EXPECT_EQ(m.pool().num_free_blocks(), 5);

  // Forged hits: a block twice, a count that disagrees with the blocks.
  m.add_request(4, iota_tokens(80, 5000));
  const ComputedBlocks fresh = m.get_computed_blocks(4);
  ASSERT_EQ(fresh.blocks.size(), 4U);
  const ComputedBlocks twice{{fresh.blocks[0], fresh.blocks[0]}, 2 * kBlockSize};
  expect_invalid([&] { m.allocate_slots(4, 1, twice); }, "computed.blocks[1]");
  expect_invalid(
      [&] {
        m.allocate_slots(4, 1, ComputedBlocks{{}, 5});
      },
      "computed.num_tokens must be blocks * block_size (0), got 5");
  EXPECT_EQ(m.pool().num_free_blocks(), 5);
  ASSERT_TRUE(m.allocate_slots(4, 16, fresh));
  EXPECT_EQ(m.num_computed_tokens(4), 80);
}

TEST(KVCacheManager, PreemptReleasesAndRecomputesWithPrefixHits) {
  KVCacheManager m = make_manager(8);
  m.add_request(1, iota_tokens(40));
  ASSERT_TRUE(m.allocate_slots(1, 40));
  m.append_tokens(1, std::vector<std::int32_t>{1});
  m.preempt(1);
  EXPECT_EQ(m.num_computed_tokens(1), 0);
  EXPECT_TRUE(m.block_table(1).empty());
  EXPECT_EQ(m.num_tokens(1), 41);
  EXPECT_EQ(m.pool().num_used_blocks(), 0);
  const ComputedBlocks hit = m.get_computed_blocks(1);
  EXPECT_EQ(hit.num_tokens, 32);
  ASSERT_TRUE(m.allocate_slots(1, 9, hit));
  EXPECT_EQ(m.num_computed_tokens(1), 41);
}

TEST(KVCacheManager, FreeOrderEvictsTailBlocksFirst) {
  KVCacheManager m = make_manager(4);
  m.add_request(1, iota_tokens(48));
  ASSERT_TRUE(m.allocate_slots(1, 48));
  const std::vector<std::int32_t> table(m.block_table(1).begin(), m.block_table(1).end());
  m.free(1);
  EXPECT_EQ(m.pool().free_queue(), (std::vector<std::int32_t>{table[2], table[1], table[0]}));
  m.add_request(2, iota_tokens(16, 900));
  ASSERT_TRUE(m.allocate_slots(2, 16));  // evicts the last block of request 1
  m.add_request(3, iota_tokens(48));
  EXPECT_EQ(m.get_computed_blocks(3).num_tokens, 32);
}

TEST(KVCacheManager, EvictCachedBlocks) {
  KVCacheManager m = make_manager(8);
  m.add_request(1, iota_tokens(48));
  ASSERT_TRUE(m.allocate_slots(1, 48));
  EXPECT_EQ(m.evict_cached_blocks(8), 0);  // referenced blocks are not evicted
  m.free(1);
  EXPECT_EQ(m.evict_cached_blocks(8), 3);
  m.add_request(2, iota_tokens(48));
  EXPECT_EQ(m.get_computed_blocks(2).num_tokens, 0);
}

TEST(KVCacheManager, SlidingWindowReleasesBlocksOutsideTheWindow) {
  constexpr int kWindow = 20;
  KVCacheManager m = make_manager(16, kWindow);
  m.add_request(1, iota_tokens(100));
  ASSERT_TRUE(m.allocate_slots(1, 64));
  EXPECT_EQ(m.pool().num_used_blocks(), 4);
  ASSERT_TRUE(m.allocate_slots(1, 1));  // position 64 reads keys 45..64: blocks 2..4
  const auto table = m.block_table(1);
  ASSERT_EQ(table.size(), 5U);
  EXPECT_EQ(table[0], kNullBlockId);
  EXPECT_EQ(table[1], kNullBlockId);
  EXPECT_NE(table[2], kNullBlockId);
  EXPECT_EQ(m.pool().num_used_blocks(), 3);
  // Released blocks stay cached until reused.
  m.add_request(2, iota_tokens(40));
  EXPECT_EQ(m.get_computed_blocks(2).num_tokens, 32);
  // The metadata accepts the null entries.
  const std::vector<RequestSpec> specs{m.request_spec(1, 1)};
  EXPECT_NO_THROW(make_common_metadata(specs, MetadataOptions{kBlockSize}));
}

TEST(KVCacheManager, MoreThanThePoolHoldsIsRefusedNotCorrupting) {
  KVCacheManager m = make_manager(5);  // 4 usable blocks = 64 slots
  m.add_request(1, iota_tokens(1000));
  EXPECT_FALSE(m.can_fit(1000));
  EXPECT_FALSE(m.allocate_slots(1, 1000));
  EXPECT_EQ(m.pool().num_free_blocks(), 4);
  EXPECT_TRUE(m.block_table(1).empty());
  // It can still run in chunks until the pool is full, then is refused.
  ASSERT_TRUE(m.allocate_slots(1, 64));
  EXPECT_FALSE(m.allocate_slots(1, 1));
  m.add_request(2, iota_tokens(10, 5000));
  EXPECT_FALSE(m.allocate_slots(2, 10));
  // Preempting the hog makes room; the cache still serves its prefix.
  m.preempt(1);
  ASSERT_TRUE(m.allocate_slots(2, 10));
  EXPECT_EQ(m.pool().num_used_blocks(), 1);
  EXPECT_EQ(m.get_computed_blocks(1).num_tokens, 48);
}

// ----------------------------------------------------------- randomized ----

// Shadow of the cache: which token each slot holds (written when a step
// computes it), and the full token prefix every hash the test saw stands for.
class Harness {
 public:
  Harness(int num_blocks, int block_size, std::optional<int> window, std::uint32_t seed)
      : m_({num_blocks, block_size, true, window}),
        bs_(block_size),
        slot_token_(static_cast<std::size_t>(num_blocks * block_size), -1),
        rng_(seed) {}

  void run(int num_ops) {
    for (int op = 0; op < num_ops; ++op) {
      step();
      check();
      if (::testing::Test::HasFailure()) {
        ADD_FAILURE() << "after op " << op;
        return;
      }
    }
  }

  std::map<std::string, int> counts;

 private:
  int pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }

  std::vector<std::int32_t> new_prompt() {
    std::vector<std::int32_t> p;
    const auto ids = m_.request_ids();
    if (!ids.empty() && pick(2) == 0) {  // fork: share a prefix of a live request
      const auto src = m_.tokens(ids[static_cast<std::size_t>(pick(static_cast<int>(ids.size())))]);
      p.assign(src.begin(), src.begin() + 1 + pick(static_cast<int>(src.size())));
    }
    const int extra = pick(kMaxPrompt) + (p.empty() ? 1 : 0);
    for (int i = 0; i < extra; ++i) p.push_back(pick(kVocab));
    return p;
  }

  void record_hashes(RequestId id) {
    const auto tokens = m_.tokens(id);
    BlockHash parent = kRootBlockHash;
    const int full = m_.num_computed_tokens(id) / bs_;
    for (int i = 0; i < full; ++i) {
      const auto block = tokens.subspan(static_cast<std::size_t>(i * bs_), static_cast<std::size_t>(bs_));
      parent = hash_block_tokens(parent, block);
      const std::vector<std::int32_t> prefix(tokens.begin(), tokens.begin() + (i + 1) * bs_);
      const auto [it, inserted] = prefix_of_.emplace(parent, prefix);
      if (!inserted) {
        ASSERT_EQ(it->second, prefix) << "hash collision between different prefixes";
      }
    }
  }

  // Schedules `n` tokens, with `hit` when starting; writes the shadow slots.
  bool schedule(RequestId id, int n, const ComputedBlocks& hit) {
    const int free_before = m_.pool().num_free_blocks();
    const std::vector<std::int32_t> table_before(m_.block_table(id).begin(), m_.block_table(id).end());
    const int computed_before = m_.num_computed_tokens(id);
    if (!m_.allocate_slots(id, n, hit)) {
      ++counts["refused"];
      EXPECT_EQ(m_.pool().num_free_blocks(), free_before);
      EXPECT_EQ(std::vector<std::int32_t>(m_.block_table(id).begin(), m_.block_table(id).end()),
                table_before);
      EXPECT_EQ(m_.num_computed_tokens(id), computed_before);
      return false;
    }
    const auto table = m_.block_table(id);
    const auto tokens = m_.tokens(id);
    const RequestSpec spec = m_.request_spec(id, n);
    const std::vector<std::int64_t> slots = slots_for_positions(spec.blocks, bs_, spec.seq_len - n, n);
    for (int i = 0; i < n; ++i) {
      const int pos = spec.seq_len - n + i;
      const std::int32_t block = table[static_cast<std::size_t>(pos / bs_)];
      EXPECT_NE(block, kNullBlockId);
      EXPECT_EQ(m_.pool().ref_count(block), 1) << "write into a shared block";
      slot_token_[static_cast<std::size_t>(slots[static_cast<std::size_t>(i)])] =
          tokens[static_cast<std::size_t>(pos)];
    }
    record_hashes(id);
    return true;
  }

  void start(RequestId id) {
    const ComputedBlocks hit = m_.get_computed_blocks(id);
    if (!hit.blocks.empty()) ++counts["prefix hit"];
    const int remaining = m_.num_tokens(id) - hit.num_tokens;
    if (schedule(id, 1 + pick(remaining), hit)) running_.insert(id);
  }

  void step() {
    const auto ids = m_.request_ids();
    const int kind = ids.empty() ? 0 : pick(kNumOpKinds);
    if (kind == 0 || ids.size() < 2) {
      if (static_cast<int>(ids.size()) < kMaxRequests) {
        ++counts["add"];
        const RequestId id = next_id_++;
        m_.add_request(id, new_prompt());
        start(id);
        return;
      }
    }
    const RequestId id = ids[static_cast<std::size_t>(pick(static_cast<int>(ids.size())))];
    switch (kind) {
      case 1:
        ++counts["free"];
        m_.free(id);
        running_.erase(id);
        return;
      case 2:
        ++counts["preempt"];
        m_.preempt(id);
        running_.erase(id);
        return;
      case 3:
        ++counts["evict"];
        m_.evict_cached_blocks(pick(kMaxEvict));
        return;
      default:
        break;
    }
    if (!running_.contains(id)) {  // waiting or preempted: resume
      ++counts["resume"];
      start(id);
      return;
    }
    if (m_.num_tokens(id) >= kMaxTokens) {
      ++counts["finish"];
      m_.free(id);
      running_.erase(id);
      return;
    }
    int remaining = m_.num_tokens(id) - m_.num_computed_tokens(id);
    if (remaining == 0) {  // decode: the sampled token joins, then is computed
      ++counts["append"];
      m_.append_tokens(id, std::vector<std::int32_t>{pick(kVocab)});
      remaining = 1;
    } else {
      ++counts["chunk"];
    }
    if (!schedule(id, 1 + pick(remaining), {})) {
      ++counts["preempt on refusal"];
      m_.preempt(id);
      running_.erase(id);
    }
  }

  void check() {
    const BlockPool& pool = m_.pool();
    const int nb = pool.num_blocks();
    std::vector<int> owners(static_cast<std::size_t>(nb), 0);
    for (const RequestId id : m_.request_ids()) {
      const auto table = m_.block_table(id);
      const auto tokens = m_.tokens(id);
      const int computed = m_.num_computed_tokens(id);
      ASSERT_EQ(static_cast<int>(table.size()), (computed + bs_ - 1) / bs_) << "request " << id;
      std::set<std::int32_t> mine;
      for (const std::int32_t b : table) {
        if (b == kNullBlockId) continue;
        ASSERT_TRUE(mine.insert(b).second) << "block " << b << " twice in request " << id;
        ++owners[static_cast<std::size_t>(b)];
      }
      for (int pos = 0; pos < computed; ++pos) {
        const std::int32_t b = table[static_cast<std::size_t>(pos / bs_)];
        if (b == kNullBlockId) continue;
        ASSERT_EQ(slot_token_[static_cast<std::size_t>(b * bs_ + pos % bs_)],
                  tokens[static_cast<std::size_t>(pos)])
            << "request " << id << " position " << pos;
      }
    }
    int used = 0;
    for (std::int32_t b = 1; b < nb; ++b) {
      ASSERT_EQ(pool.ref_count(b), owners[static_cast<std::size_t>(b)]) << "block " << b;
      if (owners[static_cast<std::size_t>(b)] > 0) ++used;
    }
    const auto queue = pool.free_queue();
    ASSERT_EQ(static_cast<int>(queue.size()), pool.num_free_blocks());
    ASSERT_EQ(static_cast<int>(queue.size()) + used, pool.num_usable_blocks()) << "free + used != pool";
    std::set<std::int32_t> queued;
    for (const std::int32_t b : queue) {
      ASSERT_NE(b, kNullBlockId);
      ASSERT_TRUE(queued.insert(b).second) << "block " << b << " twice in the free queue";
      ASSERT_EQ(owners[static_cast<std::size_t>(b)], 0) << "owned block " << b << " in the free queue";
    }
    int hashed = 0;
    for (std::int32_t b = 1; b < nb; ++b) hashed += pool.block_hash(b) ? 1 : 0;
    const auto cached = pool.cached_blocks();
    ASSERT_EQ(static_cast<int>(cached.size()), hashed);
    for (const auto& [hash, b] : cached) {
      ASSERT_EQ(pool.block_hash(b), hash);
      const auto it = prefix_of_.find(hash);
      ASSERT_NE(it, prefix_of_.end()) << "block " << b << " cached under a hash never computed";
      const std::vector<std::int32_t>& prefix = it->second;
      for (int i = 0; i < bs_; ++i) {
        ASSERT_EQ(slot_token_[static_cast<std::size_t>(b * bs_ + i)],
                  prefix[prefix.size() - static_cast<std::size_t>(bs_ - i)])
            << "cached block " << b << " slot " << i;
      }
    }
  }

  static constexpr int kNumOpKinds = 8;  // add, free, preempt, evict, and 4 x step
  static constexpr int kMaxRequests = 12;
  static constexpr int kMaxPrompt = 40;
  static constexpr int kMaxTokens = 90;
  static constexpr int kMaxEvict = 4;
  static constexpr int kVocab = 3;  // tiny: unrelated prompts still share blocks

  KVCacheManager m_;
  int bs_;
  std::vector<std::int32_t> slot_token_;
  std::unordered_map<BlockHash, std::vector<std::int32_t>, BlockHashHasher> prefix_of_;
  std::set<RequestId> running_;
  RequestId next_id_ = 0;
  std::mt19937 rng_;
};

constexpr int kRandomOps = 100'000;
constexpr int kRandomBlocks = 48;  // tight: refusals and evictions are common
constexpr int kRandomBlockSize = 4;

TEST(KVCacheManagerRandomized, InvariantsHoldAfterEveryOperation) {
  Harness h(kRandomBlocks, kRandomBlockSize, std::nullopt, 1);
  h.run(kRandomOps);
  for (const char* op :
       {"add", "free", "preempt", "evict", "chunk", "append", "refused", "prefix hit", "resume"}) {
    EXPECT_GT(h.counts[op], 0) << op << " never happened";
    RecordProperty(op, h.counts[op]);
  }
}

TEST(KVCacheManagerRandomized, SlidingWindowInvariants) {
  constexpr int kWindow = 10;
  constexpr int kWindowOps = 30'000;
  Harness h(kRandomBlocks, kRandomBlockSize, kWindow, 2);
  h.run(kWindowOps);
  EXPECT_GT(h.counts["prefix hit"], 0);
}

}  // namespace
}  // namespace pagedattn
