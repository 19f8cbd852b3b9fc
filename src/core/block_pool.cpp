#include <pagedattn/block_pool.h>
#include <pagedattn/error.h>
#include <pagedattn/metadata.h>

#include <algorithm>
#include <new>
#if defined(__unix__)
#include <unistd.h>
#endif

namespace pagedattn {

namespace {

constexpr std::string_view kPoolWhere = "BlockPool";

// The machine's physical memory, where the system reports it.
std::optional<std::size_t> physical_memory_bytes() {
#if defined(__unix__)
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0)
    return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page_size);
#endif
  return std::nullopt;
}

[[noreturn]] void throw_out_of_memory(int num_blocks, std::string_view why) {
  throw Error(ErrorKind::OutOfMemory,
              fmt::format("{}: the bookkeeping of num_blocks {} ({} bytes) {}", kPoolWhere, num_blocks,
                          BlockPool::bookkeeping_bytes(num_blocks), why));
}

}  // namespace

std::size_t BlockPool::bookkeeping_bytes(int num_blocks) {
  constexpr std::size_t kBytesPerBlock =
      sizeof(int) + sizeof(std::optional<BlockHash>) + 2 * sizeof(std::int32_t);
  // At most INT_MAX blocks of a few dozen bytes: no size_t overflow.
  return static_cast<std::size_t>(std::max(num_blocks, 0)) * kBytesPerBlock;
}

BlockPool::BlockPool(int num_blocks, bool enable_caching) : enable_caching_(enable_caching) {
  check_arg(num_blocks >= 2, kPoolWhere, "num_blocks", ">= 2 (block 0 is the null block)", num_blocks);
  // Every byte is written below, so more than the machine holds would not be
  // refused by an overcommitting allocator but end the process when touched.
  if (const auto physical = physical_memory_bytes(); physical && bookkeeping_bytes(num_blocks) > *physical) {
    throw_out_of_memory(num_blocks, fmt::format("exceeds the physical memory ({} bytes)", *physical));
  }
  const auto n = static_cast<std::size_t>(num_blocks);
  try {
    ref_count_.assign(n, 0);
    hash_.assign(n, std::nullopt);
    prev_.assign(n, kNone);
    next_.assign(n, kNone);
  } catch (const std::bad_alloc&) {
    throw_out_of_memory(num_blocks, "cannot be allocated");
  }
  for (std::int32_t b = kNullBlockId + 1; b < num_blocks; ++b) queue_push_back(b);
}

double BlockPool::usage() const {
  return static_cast<double>(num_used_blocks()) / static_cast<double>(num_usable_blocks());
}

void BlockPool::check_block(std::int32_t block, const char* where) const {
  // Called per block on every allocation and lookup: the message is only
  // formatted on failure.
  if (block < 0 || block >= num_blocks()) {
    throw_invalid(where, "block", fmt::format("in [0, {})", num_blocks()), std::to_string(block));
  }
}

void BlockPool::queue_remove(std::int32_t block) {
  const auto b = static_cast<std::size_t>(block);
  const std::int32_t p = prev_[b];
  const std::int32_t n = next_[b];
  if (p == kNone) {
    head_ = n;
  } else {
    next_[static_cast<std::size_t>(p)] = n;
  }
  if (n == kNone) {
    tail_ = p;
  } else {
    prev_[static_cast<std::size_t>(n)] = p;
  }
  prev_[b] = kNone;
  next_[b] = kNone;
  --num_free_;
}

void BlockPool::queue_push_back(std::int32_t block) {
  const auto b = static_cast<std::size_t>(block);
  prev_[b] = tail_;
  next_[b] = kNone;
  if (tail_ == kNone) {
    head_ = block;
  } else {
    next_[static_cast<std::size_t>(tail_)] = block;
  }
  tail_ = block;
  ++num_free_;
}

void BlockPool::drop_hash(std::int32_t block) {
  auto& h = hash_[static_cast<std::size_t>(block)];
  if (!h) return;
  cached_.erase(*h);
  h.reset();
  ++num_evictions_;
}

std::vector<std::int32_t> BlockPool::get_new_blocks(int count) {
  check_arg(count >= 0, "BlockPool::get_new_blocks", "count", ">= 0", count);
  if (count > num_free_) {
    throw Error(ErrorKind::OutOfMemory,
                fmt::format("BlockPool::get_new_blocks: {} blocks requested, {} free", count, num_free_));
  }
  std::vector<std::int32_t> out;
  out.reserve(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) {
    const std::int32_t b = head_;
    queue_remove(b);
    drop_hash(b);
    ref_count_[static_cast<std::size_t>(b)] = 1;
    out.push_back(b);
  }
  return out;
}

std::optional<std::int32_t> BlockPool::get_cached_block(const BlockHash& hash) const {
  const auto it = cached_.find(hash);
  if (it == cached_.end()) return std::nullopt;
  return it->second;
}

void BlockPool::touch(std::span<const std::int32_t> blocks) {
  for (const std::int32_t block : blocks) check_block(block, "BlockPool::touch");
  for (const std::int32_t block : blocks) {
    if (block == kNullBlockId) continue;
    const auto b = static_cast<std::size_t>(block);
    if (ref_count_[b] == 0) queue_remove(block);
    ++ref_count_[b];
  }
}

void BlockPool::free_blocks(std::span<const std::int32_t> blocks) {
  // Validate first so a bad list changes nothing.
  std::unordered_map<std::int32_t, int> drops;
  for (const std::int32_t block : blocks) {
    check_block(block, "BlockPool::free_blocks");
    if (block == kNullBlockId) continue;
    const int refs = ref_count_[static_cast<std::size_t>(block)];
    check_arg(++drops[block] <= refs, "BlockPool::free_blocks", fmt::format("block {}", block),
              "a referenced block", fmt::format("ref count {}", refs));
  }
  for (const std::int32_t block : blocks) {
    if (block == kNullBlockId) continue;
    const auto b = static_cast<std::size_t>(block);
    if (--ref_count_[b] == 0) queue_push_back(block);
  }
}

bool BlockPool::cache_full_block(std::int32_t block, const BlockHash& hash) {
  check_block(block, "BlockPool::cache_full_block");
  check_arg(block != kNullBlockId, "BlockPool::cache_full_block", "block", "not the null block", block);
  const auto b = static_cast<std::size_t>(block);
  check_arg(ref_count_[b] > 0, "BlockPool::cache_full_block", "block", "a referenced block",
            fmt::format("block {} with ref count 0", block));
  if (!enable_caching_ || hash_[b] || cached_.contains(hash)) return false;
  hash_[b] = hash;
  cached_.emplace(hash, block);
  return true;
}

int BlockPool::evict_cached_blocks(int max_blocks) {
  check_arg(max_blocks >= 0, "BlockPool::evict_cached_blocks", "max_blocks", ">= 0", max_blocks);
  int evicted = 0;
  for (std::int32_t b = head_; b != kNone && evicted < max_blocks; b = next_[static_cast<std::size_t>(b)]) {
    if (!hash_[static_cast<std::size_t>(b)]) continue;
    drop_hash(b);
    ++evicted;
  }
  return evicted;
}

int BlockPool::ref_count(std::int32_t block) const {
  check_block(block, "BlockPool::ref_count");
  return ref_count_[static_cast<std::size_t>(block)];
}

std::optional<BlockHash> BlockPool::block_hash(std::int32_t block) const {
  check_block(block, "BlockPool::block_hash");
  return hash_[static_cast<std::size_t>(block)];
}

std::vector<std::int32_t> BlockPool::free_queue() const {
  std::vector<std::int32_t> out;
  out.reserve(static_cast<std::size_t>(num_free_));
  for (std::int32_t b = head_; b != kNone; b = next_[static_cast<std::size_t>(b)]) out.push_back(b);
  return out;
}

std::vector<std::pair<BlockHash, std::int32_t>> BlockPool::cached_blocks() const {
  return {cached_.begin(), cached_.end()};
}

}  // namespace pagedattn
