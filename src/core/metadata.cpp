// CommonAttentionMetadata: host accessors, validation, and the builders that
// turn per-request lengths and block lists into a step's metadata.
#include <pagedattn/error.h>
#include <pagedattn/metadata.h>

#include "core/mm_prefix.h"
#include "core/step_tensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <string>

namespace pagedattn {
namespace {

// query_start_loc, seq_lens and token positions are int32 (vLLM's dtypes):
// every token count and position of a step must fit.
constexpr std::int64_t kMaxTokens = std::numeric_limits<std::int32_t>::max();

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The slot mapping lives on the compute device and may be strided: f(i,
// slot) for each slot, read in place on the CPU (validation runs on every
// forward call, which allocates nothing there) and through a host copy for
// device tensors.
template <class F>
void for_each_slot(const TensorView& slot_mapping, F&& f) {
  const std::int64_t n = slot_mapping.size(0);
  if (slot_mapping.device().is_cpu()) {
    const auto* base = static_cast<const std::int64_t*>(slot_mapping.data());
    for (std::int64_t i = 0; i < n; ++i) f(i, base[i * slot_mapping.stride(0)]);
    return;
  }
  const std::vector<std::uint8_t> bytes = to_byte_vector(slot_mapping);
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t slot = 0;
    std::memcpy(&slot, bytes.data() + static_cast<std::size_t>(i) * sizeof(slot), sizeof(slot));
    f(i, slot);
  }
}

// Host copies are read through spans: 1-D ones whole, the block table row by
// row, so rows may be strided.
void check_host_tensor(std::string_view where, const Tensor& t, std::string_view name, int rank) {
  check_step_tensor(where, t, name, DType::I32, rank, Device::cpu());
  if (rank == 1) {
    check_contiguous(where, t, name);
  } else {
    check_last_dim_contiguous(t, where, name);
  }
}

void check_same_shape(std::string_view where, const Tensor& host, const Tensor& device_copy,
                      std::string_view host_name) {
  if (host.shape() != device_copy.shape()) {
    throw_invalid(where, fmt::format("{} shape", host_name), device_copy.shape().str(), host.shape().str());
  }
}

Tensor to_compute_device(const Tensor& host, Device device) {
  return device.is_cpu() ? host : host.to(device);
}

struct HostBatch {
  std::vector<std::int32_t> query_start_loc;
  std::vector<std::int32_t> seq_lens;
  std::vector<std::int32_t> block_table;  // row-major [B, max_blocks]
  std::vector<std::int64_t> slots;
  int max_blocks = 0;
};

void check_options(std::string_view where, const MetadataOptions& options) {
  check_arg(options.block_size > 0, where, "options.block_size", "> 0", options.block_size);
  check_arg(options.num_padded_slots >= 0, where, "options.num_padded_slots", ">= 0",
            options.num_padded_slots);
}

// Checks each request's lengths, that its blocks cover `key_lens[r]` tokens,
// and that the batch's query tokens fit int32; returns their total.
std::int64_t check_requests(std::string_view where, std::span<const RequestSpec> requests,
                            std::span<const int> key_lens, int block_size) {
  check_arg(!requests.empty(), where, "requests", "non-empty", "an empty list");
  check_arg(requests.size() <= static_cast<std::size_t>(kMaxTokens), where, "requests size",
            fmt::format("<= {}", kMaxTokens), requests.size());
  std::int64_t total_query_tokens = 0;
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const RequestSpec& req = requests[r];
    check_arg(req.query_len >= 0, where, fmt::format("requests[{}].query_len", r), ">= 0", req.query_len);
    check_arg(req.seq_len >= req.query_len, where, fmt::format("requests[{}].seq_len", r),
              fmt::format(">= query_len ({})", req.query_len), req.seq_len);
    // At most INT32_MAX requests of at most INT32_MAX tokens: no int64 overflow.
    total_query_tokens += req.query_len;
    check_arg(req.blocks.size() <= static_cast<std::size_t>(kMaxTokens), where,
              fmt::format("requests[{}].blocks size", r), fmt::format("<= {}", kMaxTokens),
              req.blocks.size());
    const std::int64_t needed = ceil_div(key_lens[r], block_size);
    check_arg(static_cast<std::int64_t>(req.blocks.size()) >= needed, where,
              fmt::format("requests[{}].blocks size", r),
              fmt::format(">= ceil({} / block_size {}) = {}", key_lens[r], block_size, needed),
              req.blocks.size());
    for (std::size_t b = 0; b < req.blocks.size(); ++b) {
      check_arg(req.blocks[b] >= 0, where, fmt::format("requests[{}].blocks[{}]", r, b), ">= 0",
                req.blocks[b]);
    }
  }
  check_arg(total_query_tokens <= kMaxTokens, where, "total query tokens", fmt::format("<= {}", kMaxTokens),
            total_query_tokens);
  return total_query_tokens;
}

// The slot mapping has one row per token row, padding included.
void check_total_slots(std::string_view where, std::string_view counted, std::int64_t tokens,
                       const MetadataOptions& options) {
  const std::int64_t total = tokens + options.num_padded_slots;
  check_arg(total <= kMaxTokens, where, fmt::format("total slots ({} + options.num_padded_slots)", counted),
            fmt::format("<= {}", kMaxTokens), total);
}

// The host arrays of a step are sized by the batch; a batch too large for
// host memory is an OutOfMemory error like any other allocation.
template <typename Build>
CommonAttentionMetadata translating_bad_alloc(std::string_view where, Build&& build) {
  try {
    return build();
  } catch (const std::bad_alloc&) {
    throw Error(ErrorKind::OutOfMemory, fmt::format("{}: cannot allocate the batch's host arrays", where));
  }
}

// The slot bound num_blocks * block_size as text, without overflowing int64.
std::string slot_bound(std::int64_t num_blocks, int block_size) {
  if (num_blocks <= std::numeric_limits<std::int64_t>::max() / block_size)
    return std::to_string(num_blocks * block_size);
  return fmt::format("{} * {}", num_blocks, block_size);
}

// Query offsets and the block table (unused columns hold the null block).
HostBatch host_batch(std::span<const RequestSpec> requests) {
  HostBatch batch;
  for (const RequestSpec& req : requests)
    batch.max_blocks = std::max(batch.max_blocks, static_cast<int>(req.blocks.size()));
  // A zero-width table cannot be allocated; one null column is harmless.
  batch.max_blocks = std::max(batch.max_blocks, 1);
  batch.query_start_loc.push_back(0);
  batch.block_table.assign(requests.size() * static_cast<std::size_t>(batch.max_blocks), kNullBlockId);
  for (std::size_t r = 0; r < requests.size(); ++r) {
    batch.query_start_loc.push_back(batch.query_start_loc.back() + requests[r].query_len);
    std::copy(requests[r].blocks.begin(), requests[r].blocks.end(),
              batch.block_table.begin() +
                  static_cast<std::ptrdiff_t>(r * static_cast<std::size_t>(batch.max_blocks)));
  }
  return batch;
}

CommonAttentionMetadata assemble(HostBatch& batch, const MetadataOptions& options, bool causal) {
  const auto num_reqs = static_cast<std::int64_t>(batch.seq_lens.size());
  batch.slots.insert(batch.slots.end(), static_cast<std::size_t>(options.num_padded_slots), kPadSlotId);

  CommonAttentionMetadata md;
  md.query_start_loc_cpu = Tensor::from_i32(batch.query_start_loc, {num_reqs + 1});
  md.seq_lens_cpu = Tensor::from_i32(batch.seq_lens, {num_reqs});
  md.block_table_cpu = Tensor::from_i32(batch.block_table, {num_reqs, batch.max_blocks});
  md.query_start_loc = to_compute_device(md.query_start_loc_cpu, options.device);
  md.seq_lens = to_compute_device(md.seq_lens_cpu, options.device);
  md.block_table = to_compute_device(md.block_table_cpu, options.device);
  md.slot_mapping =
      Tensor::from_i64(batch.slots, {static_cast<std::int64_t>(batch.slots.size())}, options.device);
  md.num_reqs = static_cast<int>(num_reqs);
  md.num_actual_tokens = batch.query_start_loc.back();
  for (std::int64_t r = 0; r < num_reqs; ++r) {
    const auto i = static_cast<std::size_t>(r);
    md.max_query_len = std::max(md.max_query_len, batch.query_start_loc[i + 1] - batch.query_start_loc[i]);
    md.max_seq_len = std::max(md.max_seq_len, batch.seq_lens[i]);
  }
  md.causal = causal;
  md.block_size = options.block_size;
  return md;
}

// The requests' PrefixLM ranges as the step's CSR arrays, when any has some.
void set_request_ranges(std::string_view where, CommonAttentionMetadata& md, std::span<const RequestSpec> requests) {
  std::int64_t total = 0;
  for (const RequestSpec& req : requests) total += static_cast<std::int64_t>(req.mm_prefix_ranges.size());
  if (total == 0) return;
  check_arg(total <= kMaxTokens, where, "total mm_prefix_ranges", fmt::format("<= {}", kMaxTokens), total);
  std::vector<std::int32_t> start_loc{0};
  std::vector<std::int32_t> ranges;
  for (const RequestSpec& req : requests) {
    for (const MmPrefixRange& range : req.mm_prefix_ranges) {
      ranges.push_back(range.start);
      ranges.push_back(range.end);
    }
    start_loc.push_back(static_cast<std::int32_t>(ranges.size() / 2));
  }
  assign_mm_prefix_ranges(where, md, start_loc, ranges);
}

}  // namespace

void check_step_tensor(std::string_view where, const Tensor& t, std::string_view name, DType dtype, int rank,
                       Device device, std::string_view defined_expected) {
  check_arg(t.defined(), where, name, defined_expected, "an undefined tensor");
  check_rank(t, where, name, rank);
  check_dtype(t, where, name, dtype);
  check_device(t, where, name, device);
}

void check_contiguous(std::string_view where, const Tensor& t, std::string_view name) {
  if (!t.is_contiguous()) throw_invalid(where, name, "contiguous", t.describe());
}

std::span<const std::int32_t> CommonAttentionMetadata::query_start_loc_host() const {
  return host_i32(query_start_loc_cpu);
}

std::span<const std::int32_t> CommonAttentionMetadata::seq_lens_host() const {
  return host_i32(seq_lens_cpu);
}

std::span<const std::int32_t> CommonAttentionMetadata::block_table_host_row(int r) const {
  check_arg(r >= 0 && r < num_reqs, "CommonAttentionMetadata::block_table_host_row", "r",
            fmt::format("in [0, {})", num_reqs), r);
  const auto* row = static_cast<const std::int32_t*>(block_table_cpu.data()) + r * block_table_cpu.stride(0);
  return {row, static_cast<std::size_t>(block_table_cpu.size(1))};
}

int CommonAttentionMetadata::query_len(int r) const {
  const auto loc = query_start_loc_host();
  return loc[static_cast<std::size_t>(r) + 1] - loc[static_cast<std::size_t>(r)];
}

StepFacts CommonAttentionMetadata::validate(std::string_view where, std::int64_t num_blocks) const {
  const auto fail = [&](std::string_view field, const std::string& expected, const std::string& actual) {
    throw_invalid(where, field, expected, actual);
  };
  if (num_reqs < 0) fail("num_reqs", ">= 0", std::to_string(num_reqs));
  if (block_size <= 0) fail("block_size", "> 0", std::to_string(block_size));
  if (num_blocks < 0) fail("num_blocks", ">= 0", std::to_string(num_blocks));
  const std::int64_t batch = num_reqs;

  // device() reads query_start_loc's device: checked defined first.
  check_arg(query_start_loc.defined(), where, "query_start_loc", "a defined tensor", "an undefined tensor");
  const Device dev = device();
  check_step_tensor(where, query_start_loc, "query_start_loc", DType::I32, 1, dev);
  check_size(query_start_loc, 0, where, "query_start_loc", batch + 1);
  check_step_tensor(where, seq_lens, "seq_lens", DType::I32, 1, dev);
  check_size(seq_lens, 0, where, "seq_lens", batch);
  check_step_tensor(where, block_table, "block_table", DType::I32, 2, dev);
  check_size(block_table, 0, where, "block_table", batch);
  check_step_tensor(where, slot_mapping, "slot_mapping", DType::I64, 1, dev);
  check_host_tensor(where, query_start_loc_cpu, "query_start_loc_cpu", 1);
  check_same_shape(where, query_start_loc_cpu, query_start_loc, "query_start_loc_cpu");
  check_host_tensor(where, seq_lens_cpu, "seq_lens_cpu", 1);
  check_same_shape(where, seq_lens_cpu, seq_lens, "seq_lens_cpu");
  check_host_tensor(where, block_table_cpu, "block_table_cpu", 2);
  check_same_shape(where, block_table_cpu, block_table, "block_table_cpu");
  const bool cross = encoder_seq_lens_cpu.has_value();
  if (cross) {
    check_host_tensor(where, *encoder_seq_lens_cpu, "encoder_seq_lens_cpu", 1);
    check_size(*encoder_seq_lens_cpu, 0, where, "encoder_seq_lens_cpu", batch);
  }

  StepFacts facts;
  const auto loc = query_start_loc_host();
  if (loc[0] != 0) fail("query_start_loc[0]", "0", std::to_string(loc[0]));
  int max_q = 0;
  int max_s = 0;
  const std::int64_t table_width = block_table_cpu.size(1);
  for (int r = 0; r < num_reqs; ++r) {
    const auto i = static_cast<std::size_t>(r);
    if (loc[i + 1] < loc[i]) {
      fail(fmt::format("query_start_loc[{}]", r + 1), fmt::format(">= query_start_loc[{}] ({})", r, loc[i]),
           std::to_string(loc[i + 1]));
    }
    const int q_len = loc[i + 1] - loc[i];
    const int s_len = seq_len(r);
    if (s_len < 0) fail(fmt::format("seq_lens[{}]", r), ">= 0", std::to_string(s_len));
    if (cross) {
      // Cross-attention keys are the encoder tokens: seq_lens holds their
      // count, which is independent of the decoder query length.
      const int enc_len = host_i32(*encoder_seq_lens_cpu)[i];
      if (s_len != enc_len) {
        fail(fmt::format("seq_lens[{}]", r), fmt::format("== encoder_seq_lens_cpu[{}] ({})", r, enc_len),
             std::to_string(s_len));
      }
    } else if (s_len < q_len) {
      fail(fmt::format("seq_lens[{}]", r), fmt::format(">= query_len ({})", q_len), std::to_string(s_len));
    }
    max_q = std::max(max_q, q_len);
    max_s = std::max(max_s, s_len);
    if (s_len != q_len && facts.first_seq_len_not_query_len < 0) facts.first_seq_len_not_query_len = r;

    const std::int64_t used_blocks = ceil_div(s_len, block_size);
    if (used_blocks > table_width) {
      fail(fmt::format("block_table row {} width", r),
           fmt::format(">= ceil(seq_len {} / block_size {}) = {}", s_len, block_size, used_blocks),
           std::to_string(table_width));
    }
    const auto row = used_blocks > 0 ? block_table_host_row(r) : std::span<const std::int32_t>{};
    for (std::int64_t b = 0; b < used_blocks; ++b) {
      const std::int32_t id = row[static_cast<std::size_t>(b)];
      if (num_blocks > 0 && (id < 0 || id >= num_blocks)) {
        fail(fmt::format("block_table[{}][{}]", r, b), fmt::format("in [0, {})", num_blocks), std::to_string(id));
      }
      if (!facts.lowest_block || id < facts.lowest_block->id) facts.lowest_block = BlockRef{id, r, b};
      if (!facts.highest_block || id > facts.highest_block->id) facts.highest_block = BlockRef{id, r, b};
    }
  }
  facts.longest_query = max_q;
  facts.longest_seq = max_s;
  if (num_actual_tokens != loc[static_cast<std::size_t>(batch)]) {
    fail("num_actual_tokens",
         fmt::format("query_start_loc[{}] ({})", batch, loc[static_cast<std::size_t>(batch)]),
         std::to_string(num_actual_tokens));
  }
  if (max_query_len < max_q)
    fail("max_query_len", fmt::format(">= the largest query length ({})", max_q),
         std::to_string(max_query_len));
  if (max_seq_len < max_s)
    fail("max_seq_len", fmt::format(">= the largest seq_len ({})", max_s), std::to_string(max_seq_len));

  // Cross-attention slots address encoder tokens, so their count is unrelated
  // to the decoder's num_actual_tokens.
  if (!cross && slot_mapping.size(0) < num_actual_tokens) {
    fail("slot_mapping size", fmt::format(">= num_actual_tokens ({})", num_actual_tokens),
         std::to_string(slot_mapping.size(0)));
  }
  if (num_blocks > 0) {
    for_each_slot(slot_mapping, [&](std::int64_t i, std::int64_t slot) {
      // Slot s lies in block s / block_size: comparing that block with
      // num_blocks cannot overflow, unlike num_blocks * block_size.
      if (slot != kPadSlotId && (slot < 0 || slot / block_size >= num_blocks)) {
        fail(fmt::format("slot_mapping[{}]", i),
             fmt::format("{} or in [0, {})", kPadSlotId, slot_bound(num_blocks, block_size)), std::to_string(slot));
      }
    });
  }
  check_mm_prefix_ranges(where, *this);
  return facts;
}

void check_block_ids(std::string_view where, const StepFacts& facts, std::int64_t num_blocks) {
  for (const std::optional<BlockRef>& ref : {facts.lowest_block, facts.highest_block}) {
    if (ref && (ref->id < 0 || ref->id >= num_blocks)) {
      throw_invalid(where, fmt::format("block_table[{}][{}]", ref->request, ref->index),
                    fmt::format("in [0, {})", num_blocks), std::to_string(ref->id));
    }
  }
}

CommonAttentionMetadata CommonAttentionMetadata::with_own_host_arrays() const {
  CommonAttentionMetadata copy = *this;
  const bool on_cpu = device().is_cpu();
  for (auto [host, dev] : {std::pair{&copy.query_start_loc_cpu, &copy.query_start_loc},
                           std::pair{&copy.seq_lens_cpu, &copy.seq_lens},
                           std::pair{&copy.block_table_cpu, &copy.block_table},
                           std::pair{&copy.mm_prefix_range_start_loc_cpu, &copy.mm_prefix_range_start_loc},
                           std::pair{&copy.mm_prefix_ranges_cpu, &copy.mm_prefix_ranges}}) {
    if (!host->defined()) continue;
    const bool shared = host->data() == dev->data();
    *host = host->clone();
    if (on_cpu && shared) *dev = *host;
  }
  if (copy.encoder_seq_lens_cpu) copy.encoder_seq_lens_cpu = copy.encoder_seq_lens_cpu->clone();
  return copy;
}

void set_requests(CommonAttentionMetadata& md, std::span<const std::int32_t> query_start_loc,
                  std::span<const std::int32_t> seq_lens, std::span<const std::int32_t> block_table,
                  std::int64_t stride) {
  constexpr std::string_view where = "set_requests";
  const auto num_reqs = static_cast<std::int64_t>(seq_lens.size());
  check_arg(static_cast<std::int64_t>(query_start_loc.size()) == num_reqs + 1, where, "query_start_loc size",
            num_reqs + 1, query_start_loc.size());
  check_arg(stride >= 0 && static_cast<std::int64_t>(block_table.size()) == num_reqs * stride, where,
            "block_table size", fmt::format("{} * {}", num_reqs, stride), block_table.size());
  check_arg(num_reqs <= kMaxTokens, where, "number of requests", fmt::format("<= {}", kMaxTokens), num_reqs);
  const Device device = md.device();
  md.query_start_loc_cpu = Tensor::from_i32(query_start_loc, {num_reqs + 1});
  md.seq_lens_cpu = Tensor::from_i32(seq_lens, {num_reqs});
  md.block_table_cpu = Tensor::from_i32(block_table, {num_reqs, stride});
  md.query_start_loc = device.is_cpu() ? md.query_start_loc_cpu : md.query_start_loc_cpu.to(device);
  md.seq_lens = device.is_cpu() ? md.seq_lens_cpu : md.seq_lens_cpu.to(device);
  md.block_table = device.is_cpu() ? md.block_table_cpu : md.block_table_cpu.to(device);
  md.num_reqs = static_cast<int>(num_reqs);
}

std::vector<std::int64_t> slots_for_positions(std::span<const std::int32_t> blocks, int block_size, int first,
                                              int count) {
  constexpr std::string_view where = "slots_for_positions";
  check_arg(block_size > 0, where, "block_size", "> 0", block_size);
  check_arg(first >= 0, where, "first", ">= 0", first);
  check_arg(count >= 0, where, "count", ">= 0", count);
  const std::int64_t end = static_cast<std::int64_t>(first) + count;
  check_arg(end <= kMaxTokens, where, "first + count", fmt::format("<= {}", kMaxTokens), end);
  const std::int64_t needed = ceil_div(end, block_size);
  check_arg(static_cast<std::int64_t>(blocks.size()) >= needed, where, "blocks size",
            fmt::format(">= ceil(({} + {}) / {}) = {}", first, count, block_size, needed), blocks.size());
  std::vector<std::int64_t> slots;
  slots.reserve(static_cast<std::size_t>(count));
  for (int pos = first; pos < first + count; ++pos) {
    const std::int64_t block = blocks[static_cast<std::size_t>(pos / block_size)];
    slots.push_back(block * block_size + pos % block_size);
  }
  return slots;
}

CommonAttentionMetadata make_common_metadata(std::span<const RequestSpec> requests,
                                             const MetadataOptions& options) {
  constexpr std::string_view where = "make_common_metadata";
  return translating_bad_alloc(where, [&] {
    check_options(where, options);
    std::vector<int> seq_lens;
    for (const RequestSpec& req : requests) seq_lens.push_back(req.seq_len);
    const std::int64_t tokens = check_requests(where, requests, seq_lens, options.block_size);
    check_total_slots(where, "query tokens", tokens, options);

    HostBatch batch = host_batch(requests);
    batch.slots.reserve(static_cast<std::size_t>(tokens + options.num_padded_slots));
    for (const RequestSpec& req : requests) {
      batch.seq_lens.push_back(req.seq_len);
      // The query tokens are the last query_len positions of the sequence.
      const std::vector<std::int64_t> slots =
          slots_for_positions(req.blocks, options.block_size, req.seq_len - req.query_len, req.query_len);
      batch.slots.insert(batch.slots.end(), slots.begin(), slots.end());
    }
    CommonAttentionMetadata md = assemble(batch, options, options.causal);
    set_request_ranges(where, md, requests);
    return md;
  });
}

CommonAttentionMetadata make_cross_attention_metadata(std::span<const RequestSpec> requests,
                                                      std::span<const int> encoder_lens,
                                                      bool write_encoder_kv, const MetadataOptions& options) {
  constexpr std::string_view where = "make_cross_attention_metadata";
  return translating_bad_alloc(where, [&] {
    check_options(where, options);
    check_arg(encoder_lens.size() == requests.size(), where, "encoder_lens size",
              fmt::format("requests size ({})", requests.size()), encoder_lens.size());
    std::int64_t encoder_tokens = 0;
    for (std::size_t r = 0; r < encoder_lens.size(); ++r) {
      check_arg(encoder_lens[r] >= 0, where, fmt::format("encoder_lens[{}]", r), ">= 0", encoder_lens[r]);
      encoder_tokens += encoder_lens[r];
    }
    check_requests(where, requests, encoder_lens, options.block_size);
    for (std::size_t r = 0; r < requests.size(); ++r) {
      check_arg(requests[r].mm_prefix_ranges.empty(), where, fmt::format("requests[{}].mm_prefix_ranges", r),
                "empty (PrefixLM ranges are for decoder self-attention)",
                fmt::format("{} ranges", requests[r].mm_prefix_ranges.size()));
    }
    const std::int64_t written = write_encoder_kv ? encoder_tokens : 0;
    check_total_slots(where, "encoder tokens", written, options);

    HostBatch batch = host_batch(requests);
    batch.slots.reserve(static_cast<std::size_t>(written + options.num_padded_slots));
    for (std::size_t r = 0; r < requests.size(); ++r) {
      batch.seq_lens.push_back(encoder_lens[r]);
      if (write_encoder_kv) {
        const std::vector<std::int64_t> slots =
            slots_for_positions(requests[r].blocks, options.block_size, 0, encoder_lens[r]);
        batch.slots.insert(batch.slots.end(), slots.begin(), slots.end());
      }
    }
    CommonAttentionMetadata md = assemble(batch, options, /*causal=*/false);
    md.encoder_seq_lens_cpu =
        Tensor::from_i32(batch.seq_lens, {static_cast<std::int64_t>(batch.seq_lens.size())});
    return md;
  });
}

}  // namespace pagedattn
