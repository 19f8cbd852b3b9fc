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
namespace {

constexpr std::int32_t kNoLocalRow = -1;  // index_select fills such rows
constexpr float kNoKeyLse = -std::numeric_limits<float>::infinity();

// The leading elements of a flat workspace buffer, viewed as `shape`.
Tensor carve(const Tensor& flat, Dims shape) {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  return flat.slice(0, 0, n).view(shape);
}

// Masks and biases that need global positions, which the local requests do
// not carry, and the sink term, which every rank would add once.
void check_dcp_layer(const Attention& layer, std::string_view where) {
  if (layer.sliding_window()) throw_unsupported(where, "sliding windows with decode context parallelism");
  if (!layer.impl().params().alibi_slopes.empty())
    throw_unsupported(where, "ALiBi with decode context parallelism");
  if (layer.has_sink()) throw_unsupported(where, "sinks with decode context parallelism");
}

}  // namespace

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
  std::vector<std::int32_t> local_row(static_cast<std::size_t>(batch.num_tokens), kNoLocalRow);
  for (std::size_t i = 0; i < batch.token_rows.size(); ++i) {
    local_row[static_cast<std::size_t>(batch.token_rows[i])] = static_cast<std::int32_t>(i);
  }
  batch.local_row_index = Tensor::from_i32(local_row, {batch.num_tokens}).to(options.device);
  batch.token_rows_index =
      Tensor::from_i32(batch.token_rows, {static_cast<std::int64_t>(batch.token_rows.size())}).to(options.device);
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

  if (size == 1) {
    copy_tensor(output, gathered_output.select(0, 0));
    if (output_lse.defined()) copy_tensor(output_lse, gathered_lse.select(0, 0));
    return;
  }
  // Rank order on every rank, so every rank computes the same bits. The
  // first fold reads rank 0's state where it was gathered and the last one
  // writes the caller's LSE, so no copy is needed. In between, the running
  // LSE alternates between two buffers: merge_attn_states may not write the
  // LSE it reads (its CUDA kernel reads it from several threads).
  TensorView running_output = gathered_output.select(0, 0);
  TensorView running_lse = gathered_lse.select(0, 0);
  TensorView spare_lse = workspace.merged_lse;
  for (int r = 1; r < size; ++r) {
    const TensorView merged_lse = r == size - 1 && output_lse.defined() ? output_lse : spare_lse;
    merge_attn_states(output, running_output, running_lse, gathered_output.select(0, r), gathered_lse.select(0, r),
                      merged_lse);
    running_output = output;
    spare_lse = running_lse;
    running_lse = merged_lse;
  }
}

DcpWorkspace DcpWorkspace::allocate(const Attention& layer, int dcp_size, std::int64_t max_tokens, Device device) {
  constexpr std::string_view where = "DcpWorkspace::allocate";
  check_arg(dcp_size >= 1, where, "dcp_size", ">= 1", dcp_size);
  check_arg(max_tokens >= 1, where, "max_tokens", ">= 1", max_tokens);
  DcpWorkspace ws;
  ws.dcp_size = dcp_size;
  ws.max_tokens = max_tokens;
  ws.num_heads = layer.num_heads();
  ws.num_kv_heads = layer.num_kv_heads();
  ws.head_size = layer.head_size();
  ws.dtype = layer.dtype();
  ws.device = device;
  const std::int64_t q_rows = max_tokens * ws.num_heads * ws.head_size;
  const std::int64_t kv_rows = max_tokens * ws.num_kv_heads * ws.head_size;
  const std::int64_t lse = ws.num_heads * max_tokens;
  ws.local_query = Tensor::empty({q_rows}, ws.dtype, device);
  ws.local_key = Tensor::empty({kv_rows}, ws.dtype, device);
  ws.local_value = Tensor::empty({kv_rows}, ws.dtype, device);
  ws.local_output = Tensor::empty({q_rows}, ws.dtype, device);
  ws.local_lse = Tensor::empty({lse}, DType::F32, device);
  ws.partial_output = Tensor::empty({q_rows}, ws.dtype, device);
  ws.partial_lse = Tensor::empty({lse}, DType::F32, device);
  ws.gathered_output = Tensor::empty({dcp_size * q_rows}, ws.dtype, device);
  ws.gathered_lse = Tensor::empty({dcp_size * lse}, DType::F32, device);
  ws.merged_lse = Tensor::empty({lse}, DType::F32, device);
  return ws;
}

DcpMergeWorkspace DcpWorkspace::merge_workspace(std::int64_t num_tokens) const {
  check_arg(num_tokens <= max_tokens, "DcpWorkspace::merge_workspace", "num_tokens",
            fmt::format("<= {} (max_tokens)", max_tokens), num_tokens);
  DcpMergeWorkspace ws;
  ws.gathered_output = carve(gathered_output, {dcp_size, num_tokens, num_heads, head_size});
  ws.gathered_lse = carve(gathered_lse, {dcp_size, num_heads, num_tokens});
  ws.merged_lse = carve(merged_lse, {num_heads, num_tokens});
  return ws;
}

DcpPartial dcp_local_attention(Attention& layer, const DcpLocalBatch& batch, const DcpWorkspace& workspace,
                               const TensorView& query, const TensorView& key, const TensorView& value) {
  constexpr std::string_view where = "dcp_local_attention";
  check_dcp_layer(layer, where);
  const std::int64_t num_tokens = batch.num_tokens;
  const std::int64_t num_heads = layer.num_heads();
  const std::int64_t num_kv_heads = layer.num_kv_heads();
  const std::int64_t head_size = layer.head_size();
  const DcpWorkspace& ws = workspace;
  check_arg(ws.num_heads == num_heads && ws.num_kv_heads == num_kv_heads && ws.head_size == head_size, where,
            "workspace heads (H, Hkv, D)", fmt::format("({}, {}, {}) (the layer's)", num_heads, num_kv_heads, head_size),
            fmt::format("({}, {}, {})", ws.num_heads, ws.num_kv_heads, ws.head_size));
  check_arg(num_tokens <= ws.max_tokens, where, "batch.num_tokens",
            fmt::format("<= {} (workspace.max_tokens)", ws.max_tokens), num_tokens);
  const std::pair<const TensorView*, std::string_view> rows[] = {
      {&query, "query"}, {&key, "key"}, {&value, "value"}};
  for (const auto& [t, name] : rows) {
    check_rank(*t, where, name, 3);
    check_size(*t, 0, where, name, num_tokens);
    check_size(*t, 1, where, name, t == &query ? num_heads : num_kv_heads);
    check_size(*t, 2, where, name, head_size);
    check_dtype(*t, where, name, ws.dtype);
    check_device(*t, where, name, ws.device);
  }
  const auto num_local = static_cast<std::int64_t>(batch.token_rows.size());
  check_rank(batch.token_rows_index, where, "batch.token_rows_index", 1);
  check_size(batch.token_rows_index, 0, where, "batch.token_rows_index", num_local);
  check_rank(batch.local_row_index, where, "batch.local_row_index", 1);
  check_size(batch.local_row_index, 0, where, "batch.local_row_index", num_tokens);

  const Tensor local_output = carve(ws.local_output, {num_local, num_heads, head_size});
  const Tensor local_lse = carve(ws.local_lse, {num_heads, num_local});
  if (num_local > 0) {
    const Tensor local_query = carve(ws.local_query, {num_local, num_heads, head_size});
    const Tensor local_key = carve(ws.local_key, {num_local, num_kv_heads, head_size});
    const Tensor local_value = carve(ws.local_value, {num_local, num_kv_heads, head_size});
    index_select(local_query, query, 0, batch.token_rows_index);
    index_select(local_key, key, 0, batch.token_rows_index);
    index_select(local_value, value, 0, batch.token_rows_index);
    layer.forward(local_query, local_key, local_value, local_output, local_lse);
  }
  // Tokens without a local row get a zero output (never garbage: the merge
  // weighs it by exp(-inf) = 0, and 0 * NaN would poison the sum) and -inf.
  const DcpPartial partial{carve(ws.partial_output, {num_tokens, num_heads, head_size}),
                           carve(ws.partial_lse, {num_heads, num_tokens})};
  index_select(partial.output, local_output, 0, batch.local_row_index, 0.0f);
  index_select(partial.lse, local_lse, 1, batch.local_row_index, kNoKeyLse);
  return partial;
}

void dcp_attention_forward(Attention& layer, const DcpLocalBatch& batch, Communicator& comm,
                           const DcpWorkspace& workspace, const TensorView& query, const TensorView& key,
                           const TensorView& value, const TensorView& output, const TensorView& lse) {
  constexpr std::string_view where = "dcp_attention_forward";
  check_arg(comm.size() == batch.dcp.size, where, "comm.size()",
            fmt::format("{} (batch.dcp.size)", batch.dcp.size), comm.size());
  check_arg(comm.rank() == batch.dcp.rank, where, "comm.rank()",
            fmt::format("{} (batch.dcp.rank)", batch.dcp.rank), comm.rank());
  check_arg(workspace.dcp_size == comm.size(), where, "workspace.dcp_size",
            fmt::format("{} (comm.size())", comm.size()), workspace.dcp_size);
  check_dcp_layer(layer, where);
  // The output is checked before the cache is written.
  check_rank(output, where, "output", 3);
  check_size(output, 0, where, "output", batch.num_tokens);
  check_size(output, 1, where, "output", layer.num_heads());
  check_size(output, 2, where, "output", layer.head_size());
  const DcpPartial partial = dcp_local_attention(layer, batch, workspace, query, key, value);
  dcp_merge(comm, partial.output, partial.lse, workspace.merge_workspace(batch.num_tokens), output, lse);
}

void dcp_attention_forward(Attention& layer, const DcpLocalBatch& batch, Communicator& comm,
                           const TensorView& query, const TensorView& key, const TensorView& value,
                           const TensorView& output, const TensorView& lse) {
  const DcpWorkspace workspace =
      DcpWorkspace::allocate(layer, comm.size(), std::max<std::int64_t>(batch.num_tokens, 1), query.device());
  dcp_attention_forward(layer, batch, comm, workspace, query, key, value, output, lse);
}

}  // namespace pagedattn
