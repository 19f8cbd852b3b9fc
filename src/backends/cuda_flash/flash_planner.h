// The host half of CUDA_FLASH's plan: turns one step's batch (host copies of
// the metadata) into the work list the kernel walks, choosing split-KV
// (flash-decoding) from the batch shape and the multiprocessor count. Pure
// host code: tested without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/flash_params.h"

namespace pagedattn::cuda_flash {

// Requests with at most this many query tokens run as decode items (the 4
// warps split the keys); longer ones as prefill items of
// prefill_tokens_per_item(group) tokens.
inline constexpr int kDecodeMaxTokens = 4;
// Splits are at least this many keys, and at most kMaxSplits per item. A
// lone 8192-key decode runs in 16 splits, one CTA a multiprocessor, 18 % faster
// on an H100 than in 32 of 256 keys, two a multiprocessor: every split pays
// its prologue, its partial and its share of the merge
// (docs/perf-log/cuda_flash-issue-31.md).
inline constexpr int kMinKeysPerSplit = 512;
inline constexpr int kMaxSplits = 64;
// A cascade plan's shortest key chunk (cascade_chunk_keys picks among its
// powers of two): its prefix items hold 16 packed rows, so a short chunk
// spreads a short prefix over a wave.
inline constexpr int kMinCascadeChunkKeys = 256;
// A batch of more than a wave of CTAs is split (at most kMaxWaveFillSplits
// ways) only when that fills the last wave by at least kMinWaveFillGain of all
// the waves' slots more: a split costs partial outputs and the merge.
inline constexpr int kMaxWaveFillSplits = 4;
inline constexpr double kMinWaveFillGain = 0.05;
// Resident CTAs per multiprocessor the split heuristic aims to fill (mixed
// kernels; decode-only steps aim at their class's decode_only_ctas_per_sm).
inline constexpr int kTargetCtasPerSm = 2;
// Batch-invariant plans split a decode item into chunks of this many keys
// (more when kMaxSplits would be exceeded), whatever the batch; prefill items
// are not split. A multiple of kBlockN.
inline constexpr int kInvariantSplitKeys = 512;
// Cascade steps of at most this many query tokens are planned as one cascade
// plan (make_cascade_work_list). Its f32 partials hold every token at least
// twice (O of both passes), so longer steps, whose kernels outweigh the
// launches a cascade plan saves, take the generic passes (cascade.h).
inline constexpr int kCascadeMaxTokens = 1024;

struct PlanInputs {
  std::span<const std::int32_t> query_start_loc;  // [B + 1]
  std::span<const std::int32_t> seq_lens;         // [B]
  int num_kv_heads = 0;
  int num_sms = 0;
  int group = 1;  // query heads per KV head (the largest of the step's layers)
  int head_size = 0;  // 0 = unknown (plans as for the largest class)
  bool batch_invariant = false;  // splits from each request alone (kInvariantSplitKeys)
  bool causal = true;            // a query sees keys up to its position (the items' costs)
};

// The order of the work list (flash_planner.cpp, sort_heaviest_first): an
// item's cost is the keys its queries see
// (causal: up to its last query's position) times the rows that use each key
// plus kKeyReadRows, the cost of reading a key from memory in rows of math: a
// decode item reads as many bytes per key as a prefill item for a few rows.
inline constexpr std::int64_t kKeyReadRows = kPrefillRows;
std::int64_t item_cost(const WorkItem& w, int group, bool causal);

// Query tokens per prefill item: kPrefillRows packed rows (the G query heads
// of a token are rows of one item), so the work spreads over as many CTAs as
// it can; at least one token.
int prefill_tokens_per_item(int group);

struct WorkList {
  std::vector<WorkItem> items;       // in sort_heaviest_first's order (flash_planner.cpp)
  std::vector<CombineItem> combine;  // one per split group (cascade: per token run, below)
  std::int64_t partial_token_rows = 0;
  bool decode_only = false;   // every item is a decode item (choose_kernel: the decode-only kernels)
  bool prefill_only = false;  // there are items and every one is a prefill item
  bool batch_invariant = false;  // planned from each request alone; runs the mixed kernel
};

WorkList make_work_list(const PlanInputs& in);

// Query tokens per prefix item of a cascade plan: as many as fill one decode
// pass (kDecodeRows packed rows), at least one, so an item reads the prefix once.
int cascade_prefix_tokens(int group);

// The step as one cascade plan (cascade.h) over its first prefix_len keys,
// which every request shares and every query follows:
//   prefix items  the step's query tokens in runs of cascade_prefix_tokens,
//                 decode items over keys [0, prefix_len), positioned at
//                 prefix_len (so the step's causal mask shows them every
//                 prefix key); request: that of the run's first token (every
//                 block-table row starts with the prefix's blocks)
//   suffix items  each request's tokens, tiled as make_work_list does, over
//                 its keys [prefix_len, seq_len) at their own positions
// Every item writes partials; both passes' items split at one key chunk, the
// candidate whose CTAs finish soonest by waves times the largest piece. One
// combine item per run of tokens that lies in one prefix item and one suffix
// item merges the two split groups. Never batch-invariant (which requests
// share a prefix depends on the batch).
WorkList make_cascade_work_list(const PlanInputs& in, int prefix_len);

// Split count of an item over `kv_len` keys when the batch has `base_ctas`
// CTAs without splitting, on `num_sms` multiprocessors holding `ctas_per_sm`.
int choose_num_splits(std::int64_t base_ctas, int kv_len, int num_sms, int ctas_per_sm = kTargetCtasPerSm);

// Split count of a batch-invariant plan's decode item over `kv_len` keys.
int invariant_num_splits(int kv_len);

// Item slots of a launch's grid for a plan of `count` items (or combine
// items), num_kv_heads CTAs each. A step captured in a CUDA graph is replayed
// with later plans, whose kernels read their counts on the device and stride
// over the recorded grid: captured with fewer slots than a wave of
// `ctas_per_sm` CTAs a multiprocessor, a later plan with more items (longer
// contexts split more) would run only as wide as the captured one. So a
// capture records at least a wave; the extra CTAs find no item and exit.
int launch_item_slots(int count, int num_kv_heads, int num_sms, int ctas_per_sm, bool capturing);
// The wave a capture records: one CTA a multiprocessor. With a wave of two, a
// lone decode captured on its own plan (1q1s8k: 16 splits x 8 heads of 264
// CTAs) ran 20 % slower, its working CTAs sharing multiprocessors two by two
// (docs/perf-log/cuda_flash-issue-31.md).
inline constexpr int kCaptureCtasPerSm = 1;

// Entries each workspace region holds.
struct WorkspaceEntries {
  std::size_t items = 0;
  std::size_t combine = 0;
  std::size_t mm_prefix_offsets = 0;  // i32 PrefixLM range offsets, [B + 1]
  std::size_t mm_prefix_elems = 0;    // i32 PrefixLM (start, end) pairs, [2 R]
  std::size_t block_table = 0;        // i32 elements
  std::int64_t partial_token_rows = 0;
};

// Byte offsets of the workspace regions (header, items, combine, PrefixLM
// range offsets and pairs, block table, partial outputs, partial LSEs), each
// aligned to kWorkspaceAlign.
struct WorkspaceLayout {
  std::size_t items = 0;
  std::size_t combine = 0;
  std::size_t mm_prefix_offsets = 0;
  std::size_t mm_prefix_ranges = 0;
  std::size_t block_table = 0;
  std::size_t upload_bytes = 0;  // everything above: the one host-to-device copy
  std::size_t partial_out = 0;
  std::size_t partial_lse = 0;
  std::size_t total_bytes = 0;
};

// `partial_heads`: query heads the partial region is sized for.
WorkspaceLayout workspace_layout(const WorkspaceEntries& entries, int partial_heads, int head_size);

}  // namespace pagedattn::cuda_flash
