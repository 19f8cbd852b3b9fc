#include <pagedattn/error.h>
#include <pagedattn/kv_cache_manager.h>

#include <algorithm>
#include <limits>

// Header-only xxHash; this is the one file that hashes.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace pagedattn {

BlockHash hash_block_tokens(const BlockHash& parent, std::span<const std::int32_t> tokens,
                            std::span<const std::int64_t> extra_keys) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset(&state);
  const std::uint64_t parent_words[2] = {parent.low, parent.high};
  XXH3_128bits_update(&state, parent_words, sizeof(parent_words));
  // The token count separates (tokens, extra keys) splits of the same bytes.
  const std::uint64_t num_tokens = tokens.size();
  XXH3_128bits_update(&state, &num_tokens, sizeof(num_tokens));
  XXH3_128bits_update(&state, tokens.data(), tokens.size_bytes());
  XXH3_128bits_update(&state, extra_keys.data(), extra_keys.size_bytes());
  const XXH128_hash_t h = XXH3_128bits_digest(&state);
  return BlockHash{h.low64, h.high64};
}

namespace {

// Token positions are int (RequestSpec, CommonAttentionMetadata): a request
// holds at most this many tokens.
constexpr std::size_t kMaxRequestTokens = std::numeric_limits<int>::max();

void check_options(const KVCacheManagerOptions& o) {
  constexpr const char* kWhere = "KVCacheManager";
  check_arg(o.num_blocks >= 2, kWhere, "num_blocks", ">= 2 (block 0 is the null block)", o.num_blocks);
  check_arg(o.block_size >= 1, kWhere, "block_size", ">= 1", o.block_size);
  if (o.sliding_window)
    check_arg(*o.sliding_window >= 1, kWhere, "sliding_window", ">= 1", *o.sliding_window);
}

}  // namespace

KVCacheManager::KVCacheManager(KVCacheManagerOptions options)
    : options_((check_options(options), options)), pool_(options.num_blocks, options.enable_prefix_caching) {}

KVCacheManager::RequestState& KVCacheManager::state(RequestId id, const char* where) {
  const auto it = requests_.find(id);
  if (it == requests_.end()) throw_invalid(where, "request", "a registered request id", std::to_string(id));
  return it->second;
}

const KVCacheManager::RequestState& KVCacheManager::state(RequestId id, const char* where) const {
  const auto it = requests_.find(id);
  if (it == requests_.end()) throw_invalid(where, "request", "a registered request id", std::to_string(id));
  return it->second;
}

int KVCacheManager::blocks_for(int num_tokens) const {
  // In int64: num_tokens + block_size - 1 overflows int near INT_MAX; the
  // quotient is at most num_tokens.
  const std::int64_t bs = options_.block_size;
  return static_cast<int>((num_tokens + bs - 1) / bs);
}

int KVCacheManager::first_useful_block(int num_computed) const {
  if (!options_.sliding_window) return 0;
  // The first query token at position num_computed reads keys from
  // num_computed - window + 1 on.
  return std::max(0, num_computed - *options_.sliding_window + 1) / options_.block_size;
}

void KVCacheManager::extend_hashes(RequestState& r, int num_full_blocks) const {
  const auto bs = static_cast<std::size_t>(options_.block_size);
  while (static_cast<int>(r.block_hashes.size()) < num_full_blocks) {
    const std::size_t i = r.block_hashes.size();
    const BlockHash parent = i == 0 ? kRootBlockHash : r.block_hashes.back();
    const std::span<const std::int32_t> block(r.tokens.data() + i * bs, bs);
    r.block_hashes.push_back(hash_block_tokens(parent, block, r.extra_keys));
  }
}

void KVCacheManager::add_request(RequestId id, std::vector<std::int32_t> prompt,
                                 std::vector<std::int64_t> extra_keys) {
  constexpr const char* kWhere = "KVCacheManager::add_request";
  check_arg(!requests_.contains(id), kWhere, "request", "an id not yet registered", id);
  check_arg(!prompt.empty(), kWhere, "prompt", "at least one token", 0);
  check_arg(prompt.size() <= kMaxRequestTokens, kWhere, "prompt size",
            fmt::format("<= {}", kMaxRequestTokens), prompt.size());
  RequestState r;
  r.tokens = std::move(prompt);
  r.extra_keys = std::move(extra_keys);
  requests_.emplace(id, std::move(r));
}

void KVCacheManager::append_tokens(RequestId id, std::span<const std::int32_t> tokens) {
  constexpr const char* kWhere = "KVCacheManager::append_tokens";
  RequestState& r = state(id, kWhere);
  const std::size_t room = kMaxRequestTokens - r.tokens.size();
  check_arg(tokens.size() <= room, kWhere, "tokens size",
            fmt::format("<= {} (a request holds at most {} tokens)", room, kMaxRequestTokens), tokens.size());
  r.tokens.insert(r.tokens.end(), tokens.begin(), tokens.end());
}

ComputedBlocks KVCacheManager::get_computed_blocks(RequestId id) {
  constexpr const char* kWhere = "KVCacheManager::get_computed_blocks";
  RequestState& r = state(id, kWhere);
  check_arg(r.blocks.empty(), kWhere, "request", "a request holding no blocks (new or preempted)",
            fmt::format("{} holding {} blocks", id, r.blocks.size()));
  ComputedBlocks out;
  if (!pool_.caching_enabled()) return out;
  const int num_tokens = static_cast<int>(r.tokens.size());
  // Full blocks only, and never the last token: its logits must be computed.
  const int max_blocks = (num_tokens - 1) / options_.block_size;
  extend_hashes(r, max_blocks);
  for (int i = 0; i < max_blocks; ++i) {
    const auto block = pool_.get_cached_block(r.block_hashes[static_cast<std::size_t>(i)]);
    if (!block) break;
    out.blocks.push_back(*block);
  }
  out.num_tokens = static_cast<int>(out.blocks.size()) * options_.block_size;
  stats_.queries += num_tokens;
  stats_.hits += out.num_tokens;
  return out;
}

int KVCacheManager::num_blocks_needed(RequestId id, int num_new_tokens,
                                      const ComputedBlocks& computed) const {
  constexpr const char* kWhere = "KVCacheManager::num_blocks_needed";
  return blocks_needed(state(id, kWhere), num_new_tokens, computed, kWhere);
}

int KVCacheManager::blocks_needed(const RequestState& r, int num_new_tokens, const ComputedBlocks& computed,
                                  const char* where) const {
  // Every step of every request comes through here: messages are only
  // formatted on failure.
  if (num_new_tokens < 0) throw_invalid(where, "num_new_tokens", ">= 0", std::to_string(num_new_tokens));
  // In int64: blocks * block_size overflows int for a forged `computed`.
  const std::int64_t computed_tokens =
      static_cast<std::int64_t>(computed.blocks.size()) * options_.block_size;
  if (computed.num_tokens != computed_tokens) {
    throw_invalid(where, "computed.num_tokens", fmt::format("blocks * block_size ({})", computed_tokens),
                  std::to_string(computed.num_tokens));
  }
  const bool adopting = !computed.blocks.empty();
  if (adopting) {
    check_arg(r.blocks.empty(), where, "computed", "empty for a request holding blocks",
              fmt::format("{} blocks", computed.blocks.size()));
    check_adoptable(r, computed, where);
  }
  const int num_computed = adopting ? computed.num_tokens : r.num_computed;
  // tokens.size() <= INT_MAX (add_request, append_tokens) and num_computed <=
  // it, so neither the difference nor the total below overflows.
  const int uncomputed = static_cast<int>(r.tokens.size()) - num_computed;
  if (num_new_tokens > uncomputed) {
    throw_invalid(where, "num_new_tokens", fmt::format("<= {} (tokens not yet computed)", uncomputed),
                  std::to_string(num_new_tokens));
  }
  const int total = num_computed + num_new_tokens;
  const int held = adopting ? static_cast<int>(computed.blocks.size()) : static_cast<int>(r.blocks.size());
  int needed = std::max(0, blocks_for(total) - held);
  // Cached blocks nobody references sit in the free queue: adopting takes them out.
  for (const std::int32_t b : computed.blocks) {
    if (pool_.ref_count(b) == 0) ++needed;
  }
  return needed;
}

void KVCacheManager::check_adoptable(const RequestState& r, const ComputedBlocks& computed,
                                     const char* where) const {
  // Block i must still be the cached block of the request's prefix block i,
  // as get_computed_blocks returned it: an evicted (and possibly reused)
  // block, a block of another prefix or an id out of the pool would put
  // another request's K/V, or a block twice, into this request's table.
  check_arg(computed.blocks.size() <= r.block_hashes.size(), where, "computed.blocks size",
            fmt::format("<= {} (the request's hashed full blocks, from get_computed_blocks)",
                        r.block_hashes.size()),
            computed.blocks.size());
  for (std::size_t i = 0; i < computed.blocks.size(); ++i) {
    const auto cached = pool_.get_cached_block(r.block_hashes[i]);
    if (cached && *cached == computed.blocks[i]) continue;
    throw_invalid(where, fmt::format("computed.blocks[{}]", i),
                  cached ? fmt::format("{} (the block caching this prefix)", *cached)
                         : std::string("a cached block of this prefix (none is cached now)"),
                  std::to_string(computed.blocks[i]));
  }
}

bool KVCacheManager::can_fit(int num_tokens) const {
  check_arg(num_tokens >= 0, "KVCacheManager::can_fit", "num_tokens", ">= 0", num_tokens);
  return blocks_for(num_tokens) <= pool_.num_usable_blocks();
}

bool KVCacheManager::allocate_slots(RequestId id, int num_new_tokens, const ComputedBlocks& computed) {
  constexpr const char* kWhere = "KVCacheManager::allocate_slots";
  RequestState& r = state(id, kWhere);
  const int needed = blocks_needed(r, num_new_tokens, computed, kWhere);
  if (needed > pool_.num_free_blocks()) return false;
  if (!computed.blocks.empty()) {
    pool_.touch(computed.blocks);
    r.blocks = computed.blocks;
    r.num_computed = computed.num_tokens;
    r.num_cached_blocks = static_cast<int>(computed.blocks.size());
  }
  release_out_of_window(r);
  const int total = r.num_computed + num_new_tokens;
  const int new_blocks = blocks_for(total) - static_cast<int>(r.blocks.size());
  if (new_blocks > 0) {
    const std::vector<std::int32_t> fresh = pool_.get_new_blocks(new_blocks);
    r.blocks.insert(r.blocks.end(), fresh.begin(), fresh.end());
  }
  r.num_computed = total;
  const int full = total / options_.block_size;
  if (pool_.caching_enabled() && full > r.num_cached_blocks) {
    extend_hashes(r, full);
    for (int i = r.num_cached_blocks; i < full; ++i) {
      const std::int32_t b = r.blocks[static_cast<std::size_t>(i)];
      if (b != kNullBlockId) pool_.cache_full_block(b, r.block_hashes[static_cast<std::size_t>(i)]);
    }
  }
  r.num_cached_blocks = std::max(r.num_cached_blocks, full);
  return true;
}

void KVCacheManager::release_out_of_window(RequestState& r) {
  const int first = std::min(first_useful_block(r.num_computed), static_cast<int>(r.blocks.size()));
  std::vector<std::int32_t> released;
  for (int i = 0; i < first; ++i) {
    std::int32_t& b = r.blocks[static_cast<std::size_t>(i)];
    if (b == kNullBlockId) continue;
    released.push_back(b);
    b = kNullBlockId;
  }
  pool_.free_blocks(released);
}

void KVCacheManager::release_all(RequestState& r) {
  // Tail blocks first: they go to the free queue ahead of the prefix, so a
  // prefix other requests may share is evicted last.
  std::vector<std::int32_t> ordered(r.blocks.rbegin(), r.blocks.rend());
  pool_.free_blocks(ordered);
  r.blocks.clear();
  r.num_computed = 0;
  r.num_cached_blocks = 0;
}

void KVCacheManager::free(RequestId id) {
  release_all(state(id, "KVCacheManager::free"));
  requests_.erase(id);
}

void KVCacheManager::preempt(RequestId id) { release_all(state(id, "KVCacheManager::preempt")); }

RequestSpec KVCacheManager::request_spec(RequestId id, int query_len) const {
  constexpr const char* kWhere = "KVCacheManager::request_spec";
  const RequestState& r = state(id, kWhere);
  check_arg(query_len >= 0 && query_len <= r.num_computed, kWhere, "query_len",
            fmt::format("in [0, {}]", r.num_computed), query_len);
  return RequestSpec{query_len, r.num_computed, r.blocks};
}

std::vector<RequestId> KVCacheManager::request_ids() const {
  std::vector<RequestId> ids;
  ids.reserve(requests_.size());
  for (const auto& [id, r] : requests_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::span<const std::int32_t> KVCacheManager::block_table(RequestId id) const {
  return state(id, "KVCacheManager::block_table").blocks;
}

std::span<const std::int32_t> KVCacheManager::tokens(RequestId id) const {
  return state(id, "KVCacheManager::tokens").tokens;
}

int KVCacheManager::num_tokens(RequestId id) const {
  return static_cast<int>(state(id, "KVCacheManager::num_tokens").tokens.size());
}

int KVCacheManager::num_computed_tokens(RequestId id) const {
  return state(id, "KVCacheManager::num_computed_tokens").num_computed;
}

}  // namespace pagedattn
