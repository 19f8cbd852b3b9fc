// The KV cache manager (vLLM v1's KVCacheManager with one KV-cache group):
// per-request block tables over a BlockPool, prefix caching by chained block
// hashes, a sliding-window policy, admission and preemption. Its block tables
// feed make_common_metadata (metadata.h) through request_spec().
//
// A serving step, per request: get_computed_blocks() once when the request
// (re)starts, then allocate_slots() with the tokens scheduled this step; a
// refusal (false) allocates nothing, and the scheduler preempts or waits.
// Output tokens join the request with append_tokens(); free() when done.
#pragma once

#include <pagedattn/block_pool.h>
#include <pagedattn/metadata.h>

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace pagedattn {

using RequestId = std::uint64_t;

// The hash of the first block's parent.
inline constexpr BlockHash kRootBlockHash{};

// vLLM's hash_block_tokens: XXH3_128 over the parent hash, the block's token
// ids and the extra keys (LoRA id, cache salt, multimodal hashes, ...).
BlockHash hash_block_tokens(const BlockHash& parent, std::span<const std::int32_t> tokens,
                            std::span<const std::int64_t> extra_keys = {});

struct KVCacheManagerOptions {
  int num_blocks = 0;  // including the null block 0
  int block_size = 16;
  bool enable_prefix_caching = true;
  // Keys older than the window are never read again: their blocks are
  // released and replaced by the null block in the table.
  std::optional<int> sliding_window{};
};

// The longest cached prefix of full blocks of a request.
struct ComputedBlocks {
  std::vector<std::int32_t> blocks;
  int num_tokens = 0;  // blocks.size() * block_size
};

struct PrefixCacheStats {
  std::int64_t queries = 0;  // tokens looked up by get_computed_blocks
  std::int64_t hits = 0;     // tokens found cached
  double hit_rate() const {
    return queries == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(queries);
  }
};

class KVCacheManager {
 public:
  // Throws InvalidArgument on num_blocks < 2, block_size < 1, sliding_window < 1.
  explicit KVCacheManager(KVCacheManagerOptions options);

  // Registers a request with its prompt. `extra_keys` go into every block
  // hash, so requests with different keys never share blocks. Throws on a
  // duplicate id, an empty prompt or one of more than INT_MAX tokens.
  void add_request(RequestId id, std::vector<std::int32_t> prompt, std::vector<std::int64_t> extra_keys = {});
  // Appends sampled tokens (known, not yet computed). Throws when the request
  // would hold more than INT_MAX tokens.
  void append_tokens(RequestId id, std::span<const std::int32_t> tokens);

  // The longest prefix of full blocks already cached, never the whole
  // request: at least its last token is recomputed (its logits are needed).
  // Only for a request holding no blocks (new or preempted). Counts toward
  // prefix_cache_stats(); takes no reference (allocate_slots does).
  ComputedBlocks get_computed_blocks(RequestId id);

  // Reserves KV slots for the next `num_new_tokens` tokens of the request
  // (positions num_computed_tokens .. + num_new_tokens - 1), first adopting
  // `computed` (from get_computed_blocks, only while the request holds no
  // blocks). Returns false and changes nothing when the pool is short;
  // otherwise the tokens count as computed, and full blocks are cached.
  // Throws InvalidArgument on a negative count, more tokens than the request
  // has, or `computed` that is not (any longer) the request's cached prefix.
  bool allocate_slots(RequestId id, int num_new_tokens, const ComputedBlocks& computed = {});

  // Blocks allocate_slots would need from the free queue (computed blocks
  // nobody references count as taken from it).
  int num_blocks_needed(RequestId id, int num_new_tokens, const ComputedBlocks& computed = {}) const;
  // Whether a request of `num_tokens` tokens could ever fit in an empty pool.
  bool can_fit(int num_tokens) const;

  // Releases every block (tail blocks first to the free queue, so a shared
  // prefix outlives them in the cache) and forgets the request.
  void free(RequestId id);
  // Releases every block and resets the computed count: the request keeps
  // its tokens and is recomputed (prefix hits included) when resumed.
  void preempt(RequestId id);
  // Drops up to `max_blocks` unreferenced cached blocks, least recently freed first.
  int evict_cached_blocks(int max_blocks) { return pool_.evict_cached_blocks(max_blocks); }

  // The request's query rows for make_common_metadata: the last `query_len`
  // computed tokens (those allocate_slots just reserved) and its block table.
  RequestSpec request_spec(RequestId id, int query_len) const;

  bool has_request(RequestId id) const { return requests_.contains(id); }
  std::vector<RequestId> request_ids() const;
  std::span<const std::int32_t> block_table(RequestId id) const;
  std::span<const std::int32_t> tokens(RequestId id) const;
  int num_tokens(RequestId id) const;
  int num_computed_tokens(RequestId id) const;

  const BlockPool& pool() const { return pool_; }
  int block_size() const { return options_.block_size; }
  std::optional<int> sliding_window() const { return options_.sliding_window; }
  const PrefixCacheStats& prefix_cache_stats() const { return stats_; }

 private:
  struct RequestState {
    std::vector<std::int32_t> tokens;
    std::vector<std::int64_t> extra_keys;
    std::vector<std::int32_t> blocks;     // table; null block for released window blocks
    std::vector<BlockHash> block_hashes;  // of its full blocks, computed on demand
    int num_computed = 0;
    int num_cached_blocks = 0;  // blocks [0, this) are hashed into the pool (or skipped)
  };
  RequestState& state(RequestId id, const char* where);
  const RequestState& state(RequestId id, const char* where) const;
  void extend_hashes(RequestState& r, int num_full_blocks) const;
  // num_blocks_needed's arguments checked and counted; errors name `where`.
  int blocks_needed(const RequestState& r, int num_new_tokens, const ComputedBlocks& computed,
                    const char* where) const;
  // Throws InvalidArgument unless `computed` is the request's cached prefix
  // as get_computed_blocks returns it.
  void check_adoptable(const RequestState& r, const ComputedBlocks& computed, const char* where) const;
  int blocks_for(int num_tokens) const;
  // Index of the first block still inside the window for a step starting at
  // `num_computed`; 0 without a window.
  int first_useful_block(int num_computed) const;
  void release_out_of_window(RequestState& r);
  void release_all(RequestState& r);

  KVCacheManagerOptions options_;
  BlockPool pool_;
  std::unordered_map<RequestId, RequestState> requests_;
  PrefixCacheStats stats_;
};

}  // namespace pagedattn
