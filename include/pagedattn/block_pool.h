// The pool of KV-cache blocks behind the KV cache manager (vLLM v1's
// BlockPool): a fixed set of block ids with block 0 reserved as the null
// block, reference counts, a free queue ordered least-recently-freed first,
// and the prefix cache (block hash -> block) of full blocks.
//
// A block whose reference count drops to 0 goes to the tail of the free
// queue but keeps its hash: it stays reusable by a prefix-cache hit until it
// reaches the head and is handed out again (evicted).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace pagedattn {

// A 128-bit chained block hash (XXH3_128 of parent hash, token ids and extra keys).
struct BlockHash {
  std::uint64_t low = 0;
  std::uint64_t high = 0;
  friend bool operator==(const BlockHash&, const BlockHash&) = default;
};

struct BlockHashHasher {
  std::size_t operator()(const BlockHash& h) const noexcept {
    return static_cast<std::size_t>(h.low ^ h.high);
  }
};

class BlockPool {
 public:
  // `num_blocks` counts the null block: ids 1 .. num_blocks-1 are usable.
  // Throws InvalidArgument on num_blocks < 2, OutOfMemory when the
  // bookkeeping (bookkeeping_bytes) exceeds physical memory or cannot be
  // allocated.
  explicit BlockPool(int num_blocks, bool enable_caching = true);

  // Host bytes the pool keeps per block (ref count, hash, free-queue links)
  // times `num_blocks`; all of it is written at construction.
  static std::size_t bookkeeping_bytes(int num_blocks);

  int num_blocks() const { return static_cast<int>(ref_count_.size()); }
  int num_usable_blocks() const { return num_blocks() - 1; }
  // Blocks in the free queue (including cached blocks nobody references).
  int num_free_blocks() const { return num_free_; }
  int num_used_blocks() const { return num_usable_blocks() - num_free_; }
  // Fraction of the usable blocks referenced by some request.
  double usage() const;
  bool caching_enabled() const { return enable_caching_; }

  // Takes `count` blocks from the head of the free queue (ref count 1 each),
  // evicting their cached hashes. Throws OutOfMemory when fewer are free: the
  // manager checks num_free_blocks() first and refuses instead.
  std::vector<std::int32_t> get_new_blocks(int count);

  // The cached block holding `hash`, if any.
  std::optional<std::int32_t> get_cached_block(const BlockHash& hash) const;

  // Adds a reference to each block (a prefix-cache hit); a block at ref count
  // 0 leaves the free queue. The null block is ignored.
  void touch(std::span<const std::int32_t> blocks);

  // Drops one reference from each block, in order; blocks reaching 0 go to the
  // tail of the free queue (so the first ones listed are evicted first). The
  // null block is ignored. Throws InvalidArgument on a block that is not
  // referenced.
  void free_blocks(std::span<const std::int32_t> blocks);

  // Records `hash` for a full, referenced block. Returns false (and changes
  // nothing) when caching is off, the block already has a hash, or another
  // block already holds this hash.
  bool cache_full_block(std::int32_t block, const BlockHash& hash);

  // Evicts up to `max_blocks` cached blocks nobody references, least recently
  // freed first; they stay in the free queue without a hash. Returns how many.
  int evict_cached_blocks(int max_blocks);

  // ------------------------------------------------------------ inspection
  int ref_count(std::int32_t block) const;
  std::optional<BlockHash> block_hash(std::int32_t block) const;
  // Head (next handed out) to tail.
  std::vector<std::int32_t> free_queue() const;
  std::vector<std::pair<BlockHash, std::int32_t>> cached_blocks() const;
  std::int64_t num_evictions() const { return num_evictions_; }

 private:
  static constexpr std::int32_t kNone = -1;
  void check_block(std::int32_t block, const char* where) const;
  void queue_remove(std::int32_t block);
  void queue_push_back(std::int32_t block);
  void drop_hash(std::int32_t block);

  bool enable_caching_;
  std::vector<int> ref_count_;
  std::vector<std::optional<BlockHash>> hash_;
  // Intrusive doubly linked free queue: O(1) removal on a cache hit.
  std::vector<std::int32_t> prev_;
  std::vector<std::int32_t> next_;
  std::int32_t head_ = kNone;
  std::int32_t tail_ = kNone;
  int num_free_ = 0;
  std::unordered_map<BlockHash, std::int32_t, BlockHashHasher> cached_;
  std::int64_t num_evictions_ = 0;
};

}  // namespace pagedattn
