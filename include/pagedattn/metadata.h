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

  int num_reqs = 0;
  int num_actual_tokens = 0;  // = query_start_loc[B]
  int max_query_len = 0;
  int max_seq_len = 0;
  bool causal = true;
  int block_size = 0;  // KV-cache block size the block table addresses

  Device device() const { return query_start_loc.device(); }
  std::span<const std::int32_t> query_start_loc_host() const;
  std::span<const std::int32_t> seq_lens_host() const;
  std::span<const std::int32_t> block_table_host_row(int r) const;
  int query_len(int r) const;
  int seq_len(int r) const { return seq_lens_host()[static_cast<std::size_t>(r)]; }
  int context_len(int r) const { return seq_len(r) - query_len(r); }

  // Checks the internal consistency of every field (monotonic query_start_loc,
  // seq_len >= q_len, shapes, dtypes, devices, block ids < num_blocks when
  // num_blocks > 0) and throws InvalidArgument naming the first offending field.
  void validate(std::string_view where, std::int64_t num_blocks = 0) const;
};

// Describes one request of a batch for make_common_metadata.
struct RequestSpec {
  int query_len = 0;
  int seq_len = 0;                  // context + query tokens
  std::vector<std::int32_t> blocks;  // physical block ids, at least ceil(seq_len / block_size)
};

struct MetadataOptions {
  int block_size = 16;
  bool causal = true;
  Device device = Device::cpu();
  // Extra trailing token rows in the slot mapping, set to kPadSlotId.
  int num_padded_slots = 0;
};

// Builds the metadata and the slot mapping of the query tokens
// (slot = block_table[r][pos / BS] * BS + pos % BS). Throws InvalidArgument on
// a query_len > seq_len, a negative length, or too few blocks for seq_len.
CommonAttentionMetadata make_common_metadata(std::span<const RequestSpec> requests, const MetadataOptions& options);

// Cross-attention metadata for a decoder step: queries as in `requests`, keys
// are each request's encoder tokens (non-causal). When `write_encoder_kv` the
// slot mapping addresses every encoder token (first decoder step, the encoder
// K/V are written once); otherwise it is empty and nothing is written.
CommonAttentionMetadata make_cross_attention_metadata(std::span<const RequestSpec> requests,
                                                      std::span<const int> encoder_lens,
                                                      bool write_encoder_kv, const MetadataOptions& options);

// Slot mapping of positions [first, first + count) of one request.
std::vector<std::int64_t> slots_for_positions(std::span<const std::int32_t> blocks, int block_size, int first,
                                              int count);

}  // namespace pagedattn
