// make_local_attention_virtual_batches (metadata.h): chunked local attention
// as a metadata transform, so that no kernel has a chunk rule of its own.
#include <pagedattn/metadata.h>

#include <algorithm>
#include <vector>

namespace pagedattn {

CommonAttentionMetadata make_local_attention_virtual_batches(const CommonAttentionMetadata& common, int chunk_size) {
  constexpr std::string_view where = "make_local_attention_virtual_batches";
  common.validate(where);
  check_arg(common.block_size > 0, where, "metadata block_size", "> 0", common.block_size);
  check_arg(chunk_size > 0 && chunk_size % common.block_size == 0, where, "chunk_size",
            fmt::format("a positive multiple of the block size ({})", common.block_size), chunk_size);
  check_arg(!common.encoder_seq_lens_cpu.has_value(), where, "metadata", "decoder self-attention metadata",
            "cross-attention metadata");
  check_arg(common.local_chunk_size == 0, where, "metadata local_chunk_size", "0 (not yet split)",
            common.local_chunk_size);
  check_arg(!common.has_mm_prefix_ranges(), where, "metadata mm_prefix_ranges",
            "none (chunked local attention and PrefixLM ranges do not compose)", "set");
  const int bs = common.block_size;
  const int blocks_per_chunk = chunk_size / bs;
  std::vector<std::int32_t> query_start_loc{0};
  std::vector<std::int32_t> seq_lens;
  std::vector<std::int32_t> table;
  int max_query_len = 0;
  int max_seq_len = 0;
  // One virtual request per chunk a request's queries fall in; a request
  // without queries keeps one empty virtual request.
  const auto add = [&](std::span<const std::int32_t> row, int chunk, int queries, int keys) {
    query_start_loc.push_back(query_start_loc.back() + queries);
    seq_lens.push_back(keys);
    const int used = (keys + bs - 1) / bs;
    for (int j = 0; j < blocks_per_chunk; ++j) {
      table.push_back(j < used ? row[static_cast<std::size_t>(chunk * blocks_per_chunk + j)] : kNullBlockId);
    }
    max_query_len = std::max(max_query_len, queries);
    max_seq_len = std::max(max_seq_len, keys);
  };
  for (int r = 0; r < common.num_reqs; ++r) {
    const std::span<const std::int32_t> row = common.block_table_host_row(r);
    const int seq = common.seq_len(r);
    const int context = common.context_len(r);
    if (common.query_len(r) == 0) {
      add(row, 0, 0, 0);
      continue;
    }
    for (int chunk = context / chunk_size; chunk <= (seq - 1) / chunk_size; ++chunk) {
      const int start = chunk * chunk_size;
      const int end = std::min(seq, start + chunk_size);
      add(row, chunk, end - std::max(context, start), end - start);
    }
  }
  CommonAttentionMetadata out = common;
  set_requests(out, query_start_loc, seq_lens, table, blocks_per_chunk);
  out.max_query_len = max_query_len;
  out.max_seq_len = max_seq_len;
  out.local_chunk_size = chunk_size;
  return out;
}

}  // namespace pagedattn
