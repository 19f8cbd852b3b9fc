// BlockPool: null block, reference counts, free-queue order, prefix cache, eviction.
#include <gtest/gtest.h>
#include <pagedattn/block_pool.h>
#include <pagedattn/error.h>

#include <vector>

namespace pagedattn {
namespace {

constexpr BlockHash kHashA{1, 2};
constexpr BlockHash kHashB{3, 4};

TEST(BlockPool, NullBlockIsNeverHandedOut) {
  BlockPool pool(4);
  EXPECT_EQ(pool.num_usable_blocks(), 3);
  EXPECT_EQ(pool.num_free_blocks(), 3);
  EXPECT_EQ(pool.free_queue(), (std::vector<std::int32_t>{1, 2, 3}));
  EXPECT_EQ(pool.get_new_blocks(3), (std::vector<std::int32_t>{1, 2, 3}));
  EXPECT_EQ(pool.num_free_blocks(), 0);
  EXPECT_DOUBLE_EQ(pool.usage(), 1.0);
}

TEST(BlockPool, RejectsBadArguments) {
  EXPECT_THROW(BlockPool(1), Error);
  BlockPool pool(3);
  EXPECT_THROW(pool.get_new_blocks(-1), Error);
  try {
    pool.get_new_blocks(3);
    ADD_FAILURE() << "expected OutOfMemory";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::OutOfMemory);
  }
  EXPECT_EQ(pool.num_free_blocks(), 2);  // the failed call took nothing
  EXPECT_THROW(pool.touch(std::vector<std::int32_t>{7}), Error);
  EXPECT_THROW(pool.free_blocks(std::vector<std::int32_t>{1}), Error);  // not referenced
  EXPECT_EQ(pool.num_free_blocks(), 2);
}

TEST(BlockPool, FreedBlocksGoToTheTail) {
  BlockPool pool(5);
  const auto blocks = pool.get_new_blocks(3);  // 1 2 3
  pool.free_blocks(std::vector<std::int32_t>{3, 1});
  EXPECT_EQ(pool.free_queue(), (std::vector<std::int32_t>{4, 3, 1}));
  EXPECT_EQ(pool.get_new_blocks(2), (std::vector<std::int32_t>{4, 3}));
  EXPECT_EQ(blocks.size(), 3U);
}

TEST(BlockPool, RefCountsAndTouch) {
  BlockPool pool(4);
  const auto b = pool.get_new_blocks(1)[0];
  pool.touch(std::vector<std::int32_t>{b, 0});  // the null block is ignored
  EXPECT_EQ(pool.ref_count(b), 2);
  pool.free_blocks(std::vector<std::int32_t>{b});
  EXPECT_EQ(pool.ref_count(b), 1);
  EXPECT_EQ(pool.num_free_blocks(), 2);
  pool.free_blocks(std::vector<std::int32_t>{b});
  EXPECT_EQ(pool.num_free_blocks(), 3);
  pool.touch(std::vector<std::int32_t>{b});  // leaves the free queue
  EXPECT_EQ(pool.num_free_blocks(), 2);
  EXPECT_EQ(pool.ref_count(b), 1);
}

TEST(BlockPool, CachedBlockSurvivesFreeUntilReused) {
  BlockPool pool(3);
  const auto b = pool.get_new_blocks(1)[0];
  EXPECT_TRUE(pool.cache_full_block(b, kHashA));
  EXPECT_FALSE(pool.cache_full_block(b, kHashB));  // already hashed
  pool.free_blocks(std::vector<std::int32_t>{b});
  ASSERT_TRUE(pool.get_cached_block(kHashA));
  EXPECT_EQ(*pool.get_cached_block(kHashA), b);
  // The other free block is handed out first; then b, evicting its hash.
  EXPECT_NE(pool.get_new_blocks(1)[0], b);
  EXPECT_EQ(pool.get_new_blocks(1)[0], b);
  EXPECT_FALSE(pool.get_cached_block(kHashA));
  EXPECT_FALSE(pool.block_hash(b));
  EXPECT_EQ(pool.num_evictions(), 1);
}

TEST(BlockPool, OneBlockPerHash) {
  BlockPool pool(4);
  const auto blocks = pool.get_new_blocks(2);
  EXPECT_TRUE(pool.cache_full_block(blocks[0], kHashA));
  EXPECT_FALSE(pool.cache_full_block(blocks[1], kHashA));
  EXPECT_EQ(pool.cached_blocks().size(), 1U);
  EXPECT_THROW(pool.cache_full_block(0, kHashB), Error);
  EXPECT_THROW(pool.cache_full_block(3, kHashB), Error);  // not referenced
}

TEST(BlockPool, EvictLeastRecentlyFreedFirst) {
  BlockPool pool(4);
  const auto blocks = pool.get_new_blocks(3);
  pool.cache_full_block(blocks[0], kHashA);
  pool.cache_full_block(blocks[1], kHashB);
  pool.free_blocks(std::vector<std::int32_t>{blocks[1], blocks[0]});
  EXPECT_EQ(pool.evict_cached_blocks(1), 1);
  EXPECT_FALSE(pool.get_cached_block(kHashB));
  EXPECT_TRUE(pool.get_cached_block(kHashA));
  EXPECT_EQ(pool.num_free_blocks(), 2);
}

TEST(BlockPool, CachingOff) {
  BlockPool pool(3, false);
  const auto b = pool.get_new_blocks(1)[0];
  EXPECT_FALSE(pool.cache_full_block(b, kHashA));
  EXPECT_FALSE(pool.get_cached_block(kHashA));
}

}  // namespace
}  // namespace pagedattn
