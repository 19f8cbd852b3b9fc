// Decode context parallelism: which rank stores which token (vLLM's
// interleaved layout), each rank's share of a step, and the LSE merge of the
// ranks' partial results after an all-gather.
#include <fmt/format.h>
#include <pagedattn/ops.h>
#include <pagedattn/parallel.h>

#include <algorithm>
#include <limits>
#include <utility>

namespace pagedattn {

void validate_dcp_config(const DcpConfig& dcp, std::string_view where, int block_size) {
  check_arg(dcp.size >= 1, where, "dcp.size", ">= 1", dcp.size);
  check_arg(dcp.rank >= 0 && dcp.rank < dcp.size, where, "dcp.rank",
            fmt::format("in [0, {}) (dcp.size)", dcp.size), dcp.rank);
  check_arg(dcp.interleave >= 1, where, "dcp.interleave", ">= 1", dcp.interleave);
  if (block_size > 0) {
    check_arg(block_size % dcp.interleave == 0, where, "dcp.interleave",
              fmt::format("a divisor of block_size ({})", block_size), dcp.interleave);
  }
}

int dcp_owner_rank(std::int64_t position, const DcpConfig& dcp) {
  return static_cast<int>((position / dcp.interleave) % dcp.size);
}

std::int64_t dcp_local_position(std::int64_t position, const DcpConfig& dcp) {
  const std::int64_t round = static_cast<std::int64_t>(dcp.interleave) * dcp.size;
  return position / round * dcp.interleave + position % dcp.interleave;
}

int dcp_local_seq_len(int seq_len, const DcpConfig& dcp) {
  // Whole rounds of interleave * size tokens give every rank `interleave`;
  // the last partial round fills the ranks in order.
  const int full = seq_len / (dcp.interleave * dcp.size) * dcp.interleave;
  const int rest = seq_len - full * dcp.size;
  return full + std::clamp(rest - dcp.rank * dcp.interleave, 0, dcp.interleave);
}

std::vector<std::int64_t> dcp_slots_for_positions(std::span<const std::int32_t> blocks, int block_size,
                                                  int first, int count, const DcpConfig& dcp) {
  constexpr std::string_view where = "dcp_slots_for_positions";
  validate_dcp_config(dcp, where, block_size);
  check_arg(first >= 0, where, "first", ">= 0", first);
  check_arg(count >= 0, where, "count", ">= 0", count);
  const std::int64_t positions_per_block = static_cast<std::int64_t>(block_size) * dcp.size;
  const std::int64_t blocks_needed = count == 0 ? 0 : (first + count - 1) / positions_per_block + 1;
  check_arg(static_cast<std::int64_t>(blocks.size()) >= blocks_needed, where, "blocks size",
            fmt::format(">= {} (positions up to {} at {} per block)", blocks_needed, first + count,
                        positions_per_block),
            blocks.size());
  std::vector<std::int64_t> slots(static_cast<std::size_t>(count), kPadSlotId);
  for (int i = 0; i < count; ++i) {
    const std::int64_t p = first + i;
    if (dcp_owner_rank(p, dcp) != dcp.rank) continue;
    const std::int64_t block = blocks[static_cast<std::size_t>(p / positions_per_block)];
    slots[static_cast<std::size_t>(i)] = block * block_size + dcp_local_position(p, dcp) % block_size;
  }
  return slots;
}

DcpLocalBatch make_dcp_local_batch(std::span<const RequestSpec> requests, const MetadataOptions& options,
                                   const DcpConfig& dcp) {
  constexpr std::string_view where = "make_dcp_local_batch";
  validate_dcp_config(dcp, where, options.block_size);
  check_arg(options.num_padded_slots == 0, where, "options.num_padded_slots", 0, options.num_padded_slots);
  // Validates the step as the engine describes it: one block id per
  // block_size * size positions.
  MetadataOptions global_options = options;
  global_options.block_size = options.block_size * dcp.size;
  const CommonAttentionMetadata global = make_common_metadata(requests, global_options);

  DcpLocalBatch batch;
  batch.dcp = dcp;
  batch.num_tokens = global.num_actual_tokens;
  std::vector<RequestSpec> local_requests;
  std::vector<std::int64_t> local_slots;
  int row = 0;
  for (const RequestSpec& req : requests) {
    const int context = req.seq_len - req.query_len;
    const std::vector<std::int64_t> slots =
        dcp_slots_for_positions(req.blocks, options.block_size, context, req.query_len, dcp);
    for (int i = 0; i < req.query_len; ++i, ++row) {
      const int visible =
          options.causal ? dcp_local_seq_len(context + i + 1, dcp) : dcp_local_seq_len(req.seq_len, dcp);
      if (visible == 0) continue;
      local_requests.push_back(RequestSpec{.query_len = 1, .seq_len = visible, .blocks = req.blocks});
      local_slots.push_back(slots[static_cast<std::size_t>(i)]);
      batch.token_rows.push_back(row);
    }
  }
  if (local_requests.empty()) return batch;  // nothing to attend to or store here
  batch.metadata = make_common_metadata(local_requests, options);
  batch.metadata.slot_mapping =
      Tensor::from_i64(local_slots, {static_cast<std::int64_t>(local_slots.size())}).to(options.device);
  return batch;
}

DcpMergeWorkspace DcpMergeWorkspace::allocate(int size, std::int64_t num_tokens, std::int64_t num_heads,
                                              std::int64_t head_size, DType dtype, Device device) {
  check_arg(size >= 1, "DcpMergeWorkspace::allocate", "size", ">= 1", size);
  DcpMergeWorkspace ws;
  ws.gathered_output = Tensor::empty({size, num_tokens, num_heads, head_size}, dtype, device);
  ws.gathered_lse = Tensor::empty({size, num_heads, num_tokens}, DType::F32, device);
  ws.merged_lse = Tensor::empty({num_heads, num_tokens}, DType::F32, device);
  return ws;
}

void dcp_merge(Communicator& comm, const TensorView& local_output, const TensorView& local_lse,
               const DcpMergeWorkspace& workspace, const TensorView& output, const TensorView& output_lse) {
  constexpr std::string_view where = "dcp_merge";
  check_rank(local_output, where, "local_output", 3);
  check_rank(local_lse, where, "local_lse", 2);
  check_dtype(local_lse, where, "local_lse", DType::F32);
  const std::int64_t num_tokens = local_output.size(0);
  const std::int64_t num_heads = local_output.size(1);
  check_size(local_lse, 0, where, "local_lse", num_heads);
  check_size(local_lse, 1, where, "local_lse", num_tokens);
  check_rank(output, where, "output", 3);
  for (int d = 0; d < 3; ++d) check_size(output, d, where, "output", local_output.size(d));
  check_dtype(output, where, "output", local_output.dtype());
  if (output_lse.defined()) {
    check_rank(output_lse, where, "output_lse", 2);
    check_size(output_lse, 0, where, "output_lse", num_heads);
    check_size(output_lse, 1, where, "output_lse", num_tokens);
  }
  const int size = comm.size();
  const Tensor& gathered_output = workspace.gathered_output;
  const Tensor& gathered_lse = workspace.gathered_lse;
  check_rank(gathered_output, where, "workspace.gathered_output", 4);
  check_size(gathered_output, 0, where, "workspace.gathered_output", size);
  check_rank(workspace.merged_lse, where, "workspace.merged_lse", 2);
  check_size(workspace.merged_lse, 0, where, "workspace.merged_lse", num_heads);
  check_size(workspace.merged_lse, 1, where, "workspace.merged_lse", num_tokens);
  check_dtype(workspace.merged_lse, where, "workspace.merged_lse", DType::F32);

  comm.all_gather(local_output, gathered_output);
  comm.all_gather(local_lse, gathered_lse);

  // Rank order on every rank, so every rank computes the same bits. The
  // running LSE alternates between two buffers: merge_attn_states may not
  // write the LSE it reads (its CUDA kernel reads it from several threads).
  copy_tensor(output, gathered_output.select(0, 0));
  TensorView running_lse = gathered_lse.select(0, 0);
  TensorView next_lse = workspace.merged_lse;
  for (int r = 1; r < size; ++r) {
    merge_attn_states(output, output, running_lse, gathered_output.select(0, r), gathered_lse.select(0, r),
                      next_lse);
    std::swap(running_lse, next_lse);
  }
  if (output_lse.defined()) copy_tensor(output_lse, running_lse);
}

void dcp_attention_forward(Attention& layer, const DcpLocalBatch& batch, Communicator& comm,
                           const TensorView& query, const TensorView& key, const TensorView& value,
                           const TensorView& output, const TensorView& lse) {
  constexpr std::string_view where = "dcp_attention_forward";
  check_arg(comm.size() == batch.dcp.size, where, "comm.size()",
            fmt::format("{} (batch.dcp.size)", batch.dcp.size), comm.size());
  check_arg(comm.rank() == batch.dcp.rank, where, "comm.rank()",
            fmt::format("{} (batch.dcp.rank)", batch.dcp.rank), comm.rank());
  if (layer.sliding_window()) throw_unsupported(where, "sliding windows with decode context parallelism");
  if (!layer.impl().params().alibi_slopes.empty())
    throw_unsupported(where, "ALiBi with decode context parallelism");
  if (layer.has_sink()) throw_unsupported(where, "sinks with decode context parallelism");
  const std::int64_t num_tokens = batch.num_tokens;
  const std::int64_t num_heads = layer.num_heads();
  const std::int64_t num_kv_heads = layer.num_kv_heads();
  const std::int64_t head_size = layer.head_size();
  const std::pair<const TensorView*, std::string_view> rows[] = {
      {&query, "query"}, {&key, "key"}, {&value, "value"}, {&output, "output"}};
  for (const auto& [t, name] : rows) {
    check_rank(*t, where, name, 3);
    check_size(*t, 0, where, name, num_tokens);
    check_size(*t, 1, where, name, t == &key || t == &value ? num_kv_heads : num_heads);
    check_size(*t, 2, where, name, head_size);
  }

  const Device device = query.device();
  const DType dtype = query.dtype();
  const Tensor partial_output = Tensor::zeros({num_tokens, num_heads, head_size}, dtype, device);
  const Tensor partial_lse = Tensor::empty({num_heads, num_tokens}, DType::F32, device);
  fill_tensor(partial_lse, -std::numeric_limits<float>::infinity());

  const auto num_local = static_cast<std::int64_t>(batch.token_rows.size());
  if (num_local > 0) {
    const Tensor local_query = Tensor::empty({num_local, num_heads, head_size}, dtype, device);
    const Tensor local_key = Tensor::empty({num_local, num_kv_heads, head_size}, key.dtype(), device);
    const Tensor local_value = Tensor::empty({num_local, num_kv_heads, head_size}, value.dtype(), device);
    for (std::int64_t i = 0; i < num_local; ++i) {
      const std::int64_t row = batch.token_rows[static_cast<std::size_t>(i)];
      copy_tensor(local_query.select(0, i), query.select(0, row));
      copy_tensor(local_key.select(0, i), key.select(0, row));
      copy_tensor(local_value.select(0, i), value.select(0, row));
    }
    const Tensor local_output = Tensor::empty({num_local, num_heads, head_size}, dtype, device);
    const Tensor local_lse = Tensor::empty({num_heads, num_local}, DType::F32, device);
    layer.forward(local_query, local_key, local_value, local_output, local_lse);
    for (std::int64_t i = 0; i < num_local; ++i) {
      const std::int64_t row = batch.token_rows[static_cast<std::size_t>(i)];
      copy_tensor(partial_output.select(0, row), local_output.select(0, i));
      copy_tensor(partial_lse.select(1, row), local_lse.select(1, i));
    }
  }

  const DcpMergeWorkspace workspace =
      DcpMergeWorkspace::allocate(comm.size(), num_tokens, num_heads, head_size, dtype, device);
  dcp_merge(comm, partial_output, partial_lse, workspace, output, lse);
}

}  // namespace pagedattn
