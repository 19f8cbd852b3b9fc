// fuzz_kv_cache_manager: fuzzer-chosen operation sequences on one
// KVCacheManager (add, prefix-cache lookup and adoption, chunked and decode
// allocation, append, free, preempt, eviction, admission queries, block
// tables fed to make_common_metadata), with stale and forged prefix hits
// and out-of-range arguments mixed in. After every operation the manager is
// checked against a shadow of which token each slot holds (the invariants of
// docs/kv_cache_manager.md), and every refused or rejected call must have
// changed nothing.
#include <fuzzer/FuzzedDataProvider.h>
#include <pagedattn/error.h>
#include <pagedattn/kv_cache_manager.h>
#include <pagedattn/metadata.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "fuzz_check.h"

namespace pagedattn::fuzz {
namespace {

constexpr int kIntMax = std::numeric_limits<int>::max();
// Small pools, prompts and vocabularies keep executions fast and make
// refusals, evictions and shared prefixes common.
constexpr int kMaxUsableBlocks = 48;
constexpr int kMaxOps = 128;
constexpr int kMaxPrompt = 32;
constexpr int kMaxAppend = 6;
constexpr int kMaxEvict = 6;
constexpr int kMaxWindow = 40;
constexpr std::int32_t kVocab = 3;
constexpr std::int64_t kExtraKey = 7;
constexpr int kBlockSizes[] = {1, 2, 3, 4, 5, 8, 16, kIntMax, 0, -1};
constexpr int kOddCounts[] = {-1, kIntMax, kIntMax - 1, std::numeric_limits<int>::min()};
constexpr RequestId kUnknownId = std::numeric_limits<RequestId>::max();

enum class Op {
  Add,
  Start,
  Schedule,
  Append,
  Free,
  Preempt,
  Evict,
  CanFit,
  StaleHit,
  ForgedHit,
  Spec,
  Unknown,
  kMaxValue = Unknown,  // FuzzedDataProvider::ConsumeEnum's bound
};

// Which token each slot holds, as the steps wrote them: a flat array for the
// small pools, a map when the block size makes the slot range huge.
class SlotShadow {
 public:
  SlotShadow(int num_blocks, int block_size) {
    const std::int64_t slots = static_cast<std::int64_t>(num_blocks) * block_size;
    if (slots <= kMaxDenseSlots) dense_.assign(static_cast<std::size_t>(slots), kUnwritten);
  }
  void set(std::int64_t slot, std::int32_t token) {
    if (dense_.empty()) {
      sparse_[slot] = token;
    } else {
      dense_[static_cast<std::size_t>(slot)] = token;
    }
  }
  std::int32_t get(std::int64_t slot) const {
    if (!dense_.empty()) return dense_[static_cast<std::size_t>(slot)];
    const auto it = sparse_.find(slot);
    return it == sparse_.end() ? kUnwritten : it->second;
  }

 private:
  static constexpr std::int64_t kMaxDenseSlots = 1 << 16;
  static constexpr std::int32_t kUnwritten = -1;  // tokens are >= 0
  std::vector<std::int32_t> dense_;
  std::unordered_map<std::int64_t, std::int32_t> sparse_;
};

// Everything a refused or rejected call must leave as it was, flattened into
// one vector (requests with their counts and tables, the free queue, every
// block's ref count and hash) so that taking it costs few allocations.
using Snapshot = std::vector<std::int64_t>;

class Harness {
 public:
  Harness(const KVCacheManagerOptions& options, FuzzedDataProvider& in)
      : m_(options),
        bs_(options.block_size),
        window_(options.sliding_window),
        in_(in),
        slot_token_(options.num_blocks, options.block_size) {}

  void run() {
    for (int op = 0; op < kMaxOps && in_.remaining_bytes() > 0; ++op) {
      step(in_.ConsumeEnum<Op>());
      check();
    }
  }

 private:
  // Into `s`, whose capacity is reused: under ASan every fresh allocation
  // costs page faults (freed memory waits in quarantine).
  void snapshot(Snapshot& s) const {
    s.clear();
    for (const RequestId id : m_.request_ids()) {
      const auto table = m_.block_table(id);
      s.insert(s.end(), {static_cast<std::int64_t>(id), m_.num_computed_tokens(id), m_.num_tokens(id),
                         std::ssize(table)});
      s.insert(s.end(), table.begin(), table.end());
    }
    const auto queue = m_.pool().free_queue();
    s.push_back(std::ssize(queue));
    s.insert(s.end(), queue.begin(), queue.end());
    for (std::int32_t b = 0; b < m_.pool().num_blocks(); ++b) {
      const auto hash = m_.pool().block_hash(b);
      s.insert(s.end(),
               {m_.pool().ref_count(b), hash.has_value(), static_cast<std::int64_t>(hash ? hash->low : 0),
                static_cast<std::int64_t>(hash ? hash->high : 0)});
    }
  }

  // Runs a call that may be rejected: a rejection is an InvalidArgument that
  // changed nothing. Returns whether it went through.
  template <typename Call>
  bool attempt(std::string_view where, Call&& call) {
    snapshot(before_call_);
    try {
      call();
      return true;
    } catch (const Error& e) {
      require_error(e, ErrorKind::InvalidArgument, where);
      snapshot(after_call_);
      require(after_call_ == before_call_, "the rejected call '{}' changed the manager", e.what());
      return false;
    }
  }

  RequestId pick_request() {
    const std::vector<RequestId> ids = m_.request_ids();
    if (ids.empty()) return kUnknownId;
    return ids[in_.ConsumeIntegralInRange<std::size_t>(0, ids.size() - 1)];
  }

  // A count: in range most of the time, sometimes just past it or extreme.
  int pick_count(int in_range_max) {
    switch (in_.ConsumeIntegralInRange(0, 7)) {
      case 0:
        return in_range_max + 1;
      case 1:
        return in_.PickValueInArray(kOddCounts);
      default:
        return in_.ConsumeIntegralInRange(0, std::max(0, in_range_max));
    }
  }

  std::vector<std::int32_t> new_prompt() {
    std::vector<std::int32_t> p;
    const RequestId src = pick_request();
    if (src != kUnknownId && in_.ConsumeBool()) {  // fork: share a prefix of a live request
      const auto tokens = m_.tokens(src);
      p.assign(tokens.begin(),
               tokens.begin() + in_.ConsumeIntegralInRange<std::ptrdiff_t>(0, std::ssize(tokens)));
    }
    const int extra = in_.ConsumeIntegralInRange(0, kMaxPrompt);
    for (int i = 0; i < extra; ++i) p.push_back(in_.ConsumeIntegralInRange<std::int32_t>(0, kVocab - 1));
    return p;
  }

  // Records, for every full computed block, the prefix its hash stands for
  // (a request's full blocks never change, so each is hashed once).
  void record_hashes(RequestId id) {
    const auto tokens = m_.tokens(id);
    std::vector<BlockHash>& hashes = hashes_[id];
    const std::int64_t full = m_.num_computed_tokens(id) / bs_;
    for (auto i = std::ssize(hashes); i < full; ++i) {
      const auto block = tokens.subspan(static_cast<std::size_t>(i * bs_), static_cast<std::size_t>(bs_));
      hashes.push_back(hash_block_tokens(i == 0 ? kRootBlockHash : hashes.back(), block, extra_keys_[id]));
      const std::span<const std::int32_t> prefix = tokens.first(static_cast<std::size_t>((i + 1) * bs_));
      const auto it = prefix_of_.find(hashes.back());
      if (it == prefix_of_.end()) {
        prefix_of_.emplace(hashes.back(), std::vector<std::int32_t>(prefix.begin(), prefix.end()));
      } else {
        require(std::equal(prefix.begin(), prefix.end(), it->second.begin(), it->second.end()),
                "one hash for two different prefixes");
      }
    }
  }

  // allocate_slots with the shadow kept: returns whether it allocated.
  bool allocate(RequestId id, int n, const ComputedBlocks& hit) {
    const int free_before = m_.pool().num_free_blocks();
    std::optional<int> needed;
    attempt("KVCacheManager::num_blocks_needed", [&] { needed = m_.num_blocks_needed(id, n, hit); });
    bool allocated = false;
    snapshot(before_allocate_);
    const int start = hit.blocks.empty() ? m_.num_computed_tokens(id) : hit.num_tokens;
    const bool accepted =
        attempt("KVCacheManager::allocate_slots", [&] { allocated = m_.allocate_slots(id, n, hit); });
    require(accepted == needed.has_value(), "allocate_slots and num_blocks_needed disagree on the arguments");
    if (!accepted) return false;
    require(allocated == (*needed <= free_before),
            "allocate_slots returned {} with {} blocks needed, {} free", allocated, *needed, free_before);
    if (!allocated) {
      snapshot(after_call_);
      require(after_call_ == before_allocate_, "a refused allocate_slots changed the manager");
      return false;
    }
    require(m_.num_computed_tokens(id) == start + n, "{} computed tokens after {} + {}",
            m_.num_computed_tokens(id), start, n);
    const auto table = m_.block_table(id);
    const auto tokens = m_.tokens(id);
    for (int pos = start; pos < start + n; ++pos) {
      const std::int32_t b = table[static_cast<std::size_t>(pos / bs_)];
      require(b != kNullBlockId, "position {} of request {} is written into the null block", pos, id);
      require(m_.pool().ref_count(b) == 1, "position {} of request {} is written into shared block {}", pos,
              id, b);
      slot_token_.set(static_cast<std::int64_t>(b) * bs_ + pos % bs_, tokens[static_cast<std::size_t>(pos)]);
    }
    step_start_[id] = start;
    record_hashes(id);
    return true;
  }

  void forget(RequestId id) {
    step_start_.erase(id);
    saved_hits_.erase(id);
    hashes_.erase(id);
    extra_keys_.erase(id);
  }

  void step(Op op) {
    const RequestId id = pick_request();
    switch (op) {
      case Op::Add: {
        const RequestId new_id = in_.ConsumeBool() || id == kUnknownId ? next_id_++ : id;
        std::vector<std::int32_t> prompt = new_prompt();
        std::vector<std::int64_t> keys;
        if (in_.ConsumeBool()) keys.push_back(kExtraKey);
        const bool duplicate = m_.has_request(new_id);
        const bool added =
            attempt("KVCacheManager::add_request", [&] { m_.add_request(new_id, prompt, keys); });
        require(added == (!duplicate && !prompt.empty()), "add_request (duplicate: {}, {} tokens): added {}",
                duplicate, prompt.size(), added);
        if (added) extra_keys_[new_id] = keys;
        return;
      }
      case Op::Start: {
        if (id == kUnknownId) return;
        ComputedBlocks hit;
        const bool holds = !m_.block_table(id).empty();
        const bool looked_up =
            attempt("KVCacheManager::get_computed_blocks", [&] { hit = m_.get_computed_blocks(id); });
        require(looked_up != holds, "get_computed_blocks on a request {}holding blocks", holds ? "" : "not ");
        if (!looked_up) return;
        require(hit.num_tokens == std::ssize(hit.blocks) * bs_ && hit.num_tokens < m_.num_tokens(id),
                "a hit of {} blocks / {} tokens for {} tokens", hit.blocks.size(), hit.num_tokens,
                m_.num_tokens(id));
        saved_hits_[id] = hit;
        allocate(id, pick_count(m_.num_tokens(id) - hit.num_tokens), hit);
        return;
      }
      case Op::Schedule:
        if (id != kUnknownId) allocate(id, pick_count(m_.num_tokens(id) - m_.num_computed_tokens(id)), {});
        return;
      case Op::Append: {
        if (id == kUnknownId) return;
        std::vector<std::int32_t> tokens(in_.ConsumeIntegralInRange<std::size_t>(0, kMaxAppend));
        for (std::int32_t& t : tokens) t = in_.ConsumeIntegralInRange<std::int32_t>(0, kVocab - 1);
        require(attempt("KVCacheManager::append_tokens", [&] { m_.append_tokens(id, tokens); }),
                "append_tokens rejected {} tokens", tokens.size());
        return;
      }
      case Op::Free:
        if (id == kUnknownId) return;
        m_.free(id);
        forget(id);
        return;
      case Op::Preempt:
        if (id == kUnknownId) return;
        m_.preempt(id);
        step_start_.erase(id);
        return;
      case Op::Evict: {
        const int n = in_.ConsumeIntegralInRange(-1, kMaxEvict);
        int evicted = 0;
        const bool ok =
            attempt("BlockPool::evict_cached_blocks", [&] { evicted = m_.evict_cached_blocks(n); });
        require(ok == (n >= 0) && evicted >= 0 && evicted <= std::max(n, 0), "evict_cached_blocks({}) = {}",
                n, evicted);
        return;
      }
      case Op::CanFit: {
        const int n = pick_count(static_cast<int>(
            std::min<std::int64_t>(static_cast<std::int64_t>(kMaxUsableBlocks) * bs_, kIntMax - 1)));
        bool fits = false;
        const bool ok = attempt("KVCacheManager::can_fit", [&] { fits = m_.can_fit(n); });
        const std::int64_t blocks = (static_cast<std::int64_t>(n) + bs_ - 1) / bs_;
        require(ok == (n >= 0) && (!ok || fits == (blocks <= m_.pool().num_usable_blocks())),
                "can_fit({}) = {} with {} usable blocks of {}", n, fits, m_.pool().num_usable_blocks(), bs_);
        return;
      }
      case Op::StaleHit: {
        // A hit looked up earlier, possibly evicted, reused or adopted since:
        // allocate_slots either rejects it or adopts blocks that still hold
        // the request's prefix (check() reads every position back).
        const auto it = saved_hits_.find(id);
        if (it != saved_hits_.end()) allocate(id, pick_count(1), it->second);
        return;
      }
      case Op::ForgedHit: {
        if (id == kUnknownId) return;
        ComputedBlocks forged;
        const int n = in_.ConsumeIntegralInRange(1, 3);
        for (int i = 0; i < n; ++i) {
          forged.blocks.push_back(in_.ConsumeIntegralInRange<std::int32_t>(-1, m_.pool().num_blocks()));
        }
        forged.num_tokens = in_.ConsumeBool() ? n * std::min(bs_, kIntMax / n) : in_.ConsumeIntegral<int>();
        allocate(id, pick_count(1), forged);
        return;
      }
      case Op::Spec: {
        if (id == kUnknownId) return;
        const int computed = m_.num_computed_tokens(id);
        const int q = pick_count(computed);
        std::optional<RequestSpec> spec;
        const bool ok = attempt("KVCacheManager::request_spec", [&] { spec = m_.request_spec(id, q); });
        require(ok == (q >= 0 && q <= computed), "request_spec({}) with {} computed tokens", q, computed);
        if (ok && q > 0) check_metadata(id, *spec);
        return;
      }
      case Op::Unknown: {
        const auto reject = [&](std::string_view where, auto&& call) {
          require(!attempt(where, call), "{} accepted an unknown request", where);
        };
        reject("KVCacheManager::allocate_slots", [&] { (void)m_.allocate_slots(kUnknownId, 1); });
        reject("KVCacheManager::num_blocks_needed", [&] { (void)m_.num_blocks_needed(kUnknownId, 1); });
        reject("KVCacheManager::free", [&] { m_.free(kUnknownId); });
        reject("KVCacheManager::preempt", [&] { m_.preempt(kUnknownId); });
        reject("KVCacheManager::get_computed_blocks", [&] { (void)m_.get_computed_blocks(kUnknownId); });
        return;
      }
    }
  }

  // The request's step metadata addresses the slots its tokens were written
  // to (positions a window released read the null block: skipped).
  void check_metadata(RequestId id, const RequestSpec& spec) {
    const std::vector<RequestSpec> specs{spec};
    MetadataOptions options;
    options.block_size = bs_;
    const CommonAttentionMetadata md = make_common_metadata(specs, options);
    md.validate("fuzz_kv_cache_manager", m_.pool().num_blocks());
    const auto* slots = md.slot_mapping.data_as<std::int64_t>();
    const auto tokens = m_.tokens(id);
    for (int i = 0; i < spec.query_len; ++i) {
      const int pos = spec.seq_len - spec.query_len + i;
      if (spec.blocks[static_cast<std::size_t>(pos / bs_)] == kNullBlockId) continue;
      require(slot_token_.get(slots[i]) == tokens[static_cast<std::size_t>(pos)],
              "metadata slot {} of request {} position {} does not hold its token", slots[i], id, pos);
    }
  }

  void check() {
    const BlockPool& pool = m_.pool();
    const int nb = pool.num_blocks();
    std::vector<int> owners(static_cast<std::size_t>(nb), 0);
    std::vector<RequestId> owner_of(static_cast<std::size_t>(nb), kUnknownId);  // last table seen holding it
    for (const RequestId id : m_.request_ids()) {
      const auto table = m_.block_table(id);
      const auto tokens = m_.tokens(id);
      const int computed = m_.num_computed_tokens(id);
      require(computed >= 0 && computed <= std::ssize(tokens), "request {}: {} of {} tokens computed", id,
              computed, tokens.size());
      require(std::ssize(table) == (static_cast<std::int64_t>(computed) + bs_ - 1) / bs_,
              "request {}: {} blocks for {} tokens", id, table.size(), computed);
      for (const std::int32_t b : table) {
        require(b >= 0 && b < nb, "request {} holds block {}", id, b);
        if (b == kNullBlockId) continue;
        const auto i = static_cast<std::size_t>(b);
        require(owner_of[i] != id, "block {} twice in request {}", b, id);
        owner_of[i] = id;
        ++owners[i];
      }
      // The last step read keys from its start - window + 1 on: not released.
      const auto start = step_start_.find(id);
      const int first_read =
          start == step_start_.end() || !window_ ? computed : std::max(0, start->second - *window_ + 1);
      for (int pos = 0; pos < computed; ++pos) {
        const std::int32_t b = table[static_cast<std::size_t>(pos / bs_)];
        if (b == kNullBlockId) {
          require(pos < first_read, "request {} position {} was released while still in the window", id, pos);
          continue;
        }
        require(slot_token_.get(static_cast<std::int64_t>(b) * bs_ + pos % bs_) ==
                    tokens[static_cast<std::size_t>(pos)],
                "request {} position {} (block {}) does not hold its token", id, pos, b);
      }
    }
    require(pool.ref_count(kNullBlockId) == 0, "the null block is referenced");
    int used = 0;
    for (std::int32_t b = 1; b < nb; ++b) {
      require(pool.ref_count(b) == owners[static_cast<std::size_t>(b)], "block {}: ref count {}, {} tables",
              b, pool.ref_count(b), owners[static_cast<std::size_t>(b)]);
      if (owners[static_cast<std::size_t>(b)] > 0) ++used;
    }
    const auto queue = pool.free_queue();
    require(std::ssize(queue) == pool.num_free_blocks() &&
                pool.num_free_blocks() + used == pool.num_usable_blocks(),
            "{} queued, {} free, {} used, {} usable", queue.size(), pool.num_free_blocks(), used,
            pool.num_usable_blocks());
    std::vector<char> queued(static_cast<std::size_t>(nb), 0);
    for (const std::int32_t b : queue) {
      const auto i = static_cast<std::size_t>(b);
      require(b != kNullBlockId && queued[i] == 0 && owners[i] == 0,
              "block {} in the free queue is null, queued twice or owned", b);
      queued[i] = 1;
    }
    int hashed = 0;
    for (std::int32_t b = 0; b < nb; ++b) hashed += pool.block_hash(b) ? 1 : 0;
    const auto cached = pool.cached_blocks();
    require(std::ssize(cached) == hashed, "{} cached hashes, {} hashed blocks", cached.size(), hashed);
    for (const auto& [hash, b] : cached) {
      require(b != kNullBlockId && pool.block_hash(b) == hash, "cached block {} does not hold its hash", b);
      const auto it = prefix_of_.find(hash);
      require(it != prefix_of_.end(), "block {} cached under a hash never computed", b);
      const std::vector<std::int32_t>& prefix = it->second;
      for (int i = 0; i < bs_; ++i) {
        require(slot_token_.get(static_cast<std::int64_t>(b) * bs_ + i) ==
                    prefix[prefix.size() - static_cast<std::size_t>(bs_ - i)],
                "cached block {} slot {} does not hold its prefix's token", b, i);
      }
    }
  }

  KVCacheManager m_;
  int bs_;
  std::optional<int> window_;
  FuzzedDataProvider& in_;
  SlotShadow slot_token_;
  std::unordered_map<BlockHash, std::vector<std::int32_t>, BlockHashHasher> prefix_of_;
  std::map<RequestId, std::vector<std::int64_t>> extra_keys_;
  std::map<RequestId, std::vector<BlockHash>> hashes_;  // of the request's full computed blocks
  std::map<RequestId, ComputedBlocks> saved_hits_;
  std::map<RequestId, int> step_start_;  // first position of the request's last step
  RequestId next_id_ = 0;
  Snapshot before_call_;
  Snapshot after_call_;
  Snapshot before_allocate_;
};

// Options from the input; invalid ones must be rejected by the constructor.
std::optional<KVCacheManagerOptions> make_options(FuzzedDataProvider& in) {
  KVCacheManagerOptions o;
  o.num_blocks = in.ConsumeIntegralInRange(0, kMaxUsableBlocks + 1);
  o.block_size = in.PickValueInArray(kBlockSizes);
  o.enable_prefix_caching = in.ConsumeBool();
  if (in.ConsumeBool()) o.sliding_window = in.ConsumeIntegralInRange(0, kMaxWindow);
  const bool valid = o.num_blocks >= 2 && o.block_size >= 1 && (!o.sliding_window || *o.sliding_window >= 1);
  try {
    const KVCacheManager probe(o);
    require(valid, "KVCacheManager accepted num_blocks {}, block_size {}", o.num_blocks, o.block_size);
    return o;
  } catch (const Error& e) {
    require_error(e, ErrorKind::InvalidArgument, "KVCacheManager");
    require(!valid, "KVCacheManager rejected valid options: {}", e.what());
    return std::nullopt;
  }
}

}  // namespace
}  // namespace pagedattn::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const auto options = pagedattn::fuzz::make_options(in);
  if (!options) return 0;
  pagedattn::fuzz::Harness(*options, in).run();
  return 0;
}
