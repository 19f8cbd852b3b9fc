// Per-step attention metadata shared by every layer of a KV-cache group
// (vLLM's CommonAttentionMetadata), and the helper that builds it.
#pragma once

#include <pagedattn/tensor.h>

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace pagedattn {

// Slot value that means "do not write this token" (vLLM's PAD_SLOT_ID).
inline constexpr std::int64_t kPadSlotId = -1;
// Block 0 may be reserved as the null block (vLLM's NULL_BLOCK_ID).
inline constexpr std::int32_t kNullBlockId = 0;

// A block-table entry: the id and where it sits.
struct BlockRef {
  std::int32_t id = 0;
  int request = 0;
  std::int64_t index = 0;  // position in the request's row
};

// What CommonAttentionMetadata::validate establishes beyond consistency, kept
// so that each layer's forward checks its own cache and attention type
// against the step in O(1) instead of walking the batch again.
struct StepFacts {
  // The smallest and largest block id any request reads (its first
  // ceil(seq_len / block_size) entries); unset when no request reads one.
  std::optional<BlockRef> lowest_block;
  std::optional<BlockRef> highest_block;
  // The first request whose seq_len differs from its query length (encoder
  // attention requires equal ones); -1 when none does.
  int first_seq_len_not_query_len = -1;
  // The largest query length and seq_len of any request (max_query_len and
  // max_seq_len are only upper bounds).
  int longest_query = 0;
  int longest_seq = 0;
};

// A PrefixLM range (vLLM's mm_prefix_range, e.g. one image's tokens):
// positions [start, end) of a request whose queries see every key of the
// range, future ones included (docs/semantics.md). vLLM's (first, last)
// pairs are inclusive: [first, last + 1) here.
struct MmPrefixRange {
  std::int32_t start = 0;
  std::int32_t end = 0;
};

// For request r: q_len = query_start_loc[r+1] - query_start_loc[r]; its query
// tokens are the last q_len positions of its seq_lens[r] tokens. Tokens at
// index >= num_actual_tokens (padding) are neither attended nor written.
struct CommonAttentionMetadata {
  Tensor query_start_loc;  // [B+1] i32, on the compute device
  Tensor seq_lens;         // [B] i32, on the compute device
  Tensor block_table;      // [B, max_blocks_per_seq] i32, on the compute device
  Tensor slot_mapping;     // [num_slots] i64 (num_slots may exceed num_actual_tokens: padding, -1)
  // Host copies (the same tensors when the compute device is the CPU).
  Tensor query_start_loc_cpu;  // [B+1] i32
  Tensor seq_lens_cpu;         // [B] i32
  Tensor block_table_cpu;      // [B, max_blocks_per_seq] i32
  // Cross-attention only: encoder lengths per request (keys of the layer).
  std::optional<Tensor> encoder_seq_lens_cpu;  // [B] i32
  // PrefixLM ranges (set_mm_prefix_ranges), causal decoder steps only, all
  // four defined or none: request r's ranges are rows
  // [mm_prefix_range_start_loc[r], mm_prefix_range_start_loc[r + 1]) of
  // mm_prefix_ranges, sorted, disjoint and within [0, seq_lens[r]].
  Tensor mm_prefix_range_start_loc;      // [B + 1] i32, on the compute device
  Tensor mm_prefix_ranges;               // [R, 2] i32 (start, end), on the compute device
  Tensor mm_prefix_range_start_loc_cpu;  // [B + 1] i32
  Tensor mm_prefix_ranges_cpu;           // [R, 2] i32

  int num_reqs = 0;
  int num_actual_tokens = 0;  // = query_start_loc[B]
  int max_query_len = 0;
  int max_seq_len = 0;
  bool causal = true;
  int block_size = 0;  // KV-cache block size the block table addresses
  // Chunked local attention (make_local_attention_virtual_batches): the chunk
  // size the requests were split by, 0 for a step that was not.
  int local_chunk_size = 0;

  Device device() const { return query_start_loc.device(); }
  std::span<const std::int32_t> query_start_loc_host() const;
  std::span<const std::int32_t> seq_lens_host() const;
  std::span<const std::int32_t> block_table_host_row(int r) const;
  int query_len(int r) const;
  int seq_len(int r) const { return seq_lens_host()[static_cast<std::size_t>(r)]; }
  int context_len(int r) const { return seq_len(r) - query_len(r); }
  bool has_mm_prefix_ranges() const { return mm_prefix_ranges_cpu.defined(); }
  // Request r's PrefixLM ranges as (start, end) pairs, [2 n] (empty without ranges).
  std::span<const std::int32_t> mm_prefix_ranges_host(int r) const;

  // Checks the internal consistency of every field (monotonic query_start_loc,
  // seq_len >= q_len, shapes, dtypes, devices, block ids and slots within
  // num_blocks when num_blocks > 0, PrefixLM ranges sorted, disjoint and
  // within their sequences) and throws InvalidArgument naming the first
  // offending field. Returns what it learned about the block ids and
  // lengths (check_block_ids compares those with a cache in O(1)).
  StepFacts validate(std::string_view where, std::int64_t num_blocks = 0) const;

  // A copy whose host arrays (and, on the CPU, the device arrays, which are
  // the same tensors there) are its own: a plan built from it cannot be
  // changed by later writes to the caller's tensors.
  CommonAttentionMetadata with_own_host_arrays() const;
};

// Throws what validate(where, num_blocks) throws for a block id outside
// [0, num_blocks), in O(1) from the step's facts.
void check_block_ids(std::string_view where, const StepFacts& facts, std::int64_t num_blocks);

// Describes one request of a batch for make_common_metadata.
struct RequestSpec {
  int query_len = 0;
  int seq_len = 0;                  // context + query tokens
  std::vector<std::int32_t> blocks;  // physical block ids, at least ceil(seq_len / block_size)
  // PrefixLM ranges: sorted, disjoint, within [0, seq_len]; causal decoder
  // steps only (set_mm_prefix_ranges).
  std::vector<MmPrefixRange> mm_prefix_ranges{};
};

struct MetadataOptions {
  int block_size = 16;
  bool causal = true;
  Device device = Device::cpu();
  // Extra trailing token rows in the slot mapping, set to kPadSlotId.
  int num_padded_slots = 0;
};

// Builds the metadata and the slot mapping of the query tokens
// (slot = block_table[r][pos / BS] * BS + pos % BS), and the PrefixLM ranges
// when any request has some. Throws InvalidArgument on a query_len >
// seq_len, a negative length, too few blocks for seq_len, or ranges
// set_mm_prefix_ranges rejects.
CommonAttentionMetadata make_common_metadata(std::span<const RequestSpec> requests, const MetadataOptions& options);

// Cross-attention metadata for a decoder step: queries as in `requests`, keys
// are each request's encoder tokens (non-causal). When `write_encoder_kv` the
// slot mapping addresses every encoder token (first decoder step, the encoder
// K/V are written once); otherwise it is empty and nothing is written.
CommonAttentionMetadata make_cross_attention_metadata(std::span<const RequestSpec> requests,
                                                      std::span<const int> encoder_lens,
                                                      bool write_encoder_kv, const MetadataOptions& options);

// Replaces the step's requests: the host arrays and their copies on the
// metadata's device, and num_reqs (the rest, the slot mapping and the
// token counts included, stays as it is). Used by the step transforms below
// and by cascade.h.
//   block_table  [B, stride] row-major
void set_requests(CommonAttentionMetadata& md, std::span<const std::int32_t> query_start_loc,
                  std::span<const std::int32_t> seq_lens, std::span<const std::int32_t> block_table,
                  std::int64_t stride);

// Sets the step's PrefixLM ranges (host arrays and their copies on the
// metadata's device) from CSR arrays: request r's ranges are pairs
// [start_loc[r], start_loc[r + 1]) of `ranges`, each [start, end) with
// 0 <= start < end <= seq_lens[r], sorted and disjoint. Throws
// InvalidArgument naming the first bad entry, leaving `md` unchanged, also
// on a non-causal or cross-attention step.
//   start_loc  [B + 1]
//   ranges     [R * 2] row-major (start, end) pairs
void set_mm_prefix_ranges(CommonAttentionMetadata& md, std::span<const std::int32_t> start_loc,
                          std::span<const std::int32_t> ranges);

// Chunked local attention (Llama 4's attention_chunk_size, vLLM's
// make_local_attention_virtual_batches): a query at position p sees only
// keys j with floor(j / C) == floor(p / C) (and j <= p when causal). Each
// request becomes one virtual request per chunk its queries fall in, whose
// keys are that chunk's first tokens up to its last query: the same token
// order, slots and outputs, so every backend runs it unchanged. Positions
// within a virtual request are shifted by the chunk start, which no
// semantics depend on (window, ALiBi and sinks are translation invariant).
// Validates `common` first; throws InvalidArgument unless chunk_size is a
// positive multiple of common.block_size, and on cross-attention metadata or
// metadata with PrefixLM ranges (the two do not compose).
//   result.block_table  [B', chunk_size / block_size]: each row the chunk's
//                       entries of its request's row (0 past its keys)
CommonAttentionMetadata make_local_attention_virtual_batches(const CommonAttentionMetadata& common, int chunk_size);

// Slot mapping of positions [first, first + count) of one request.
std::vector<std::int64_t> slots_for_positions(std::span<const std::int32_t> blocks, int block_size, int first,
                                              int count);

}  // namespace pagedattn
