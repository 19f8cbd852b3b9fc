// fuzz_metadata: the step-metadata builders and their validation
// (make_common_metadata, make_cross_attention_metadata,
// CommonAttentionMetadata::validate) and the CPU backends' metadata builders,
// on fuzzer-chosen request lists with small and extreme lengths.
//
// Each builder call either throws an InvalidArgument or returns metadata that
// describes exactly the requests (offsets, lengths, table, slots) and passes
// validate; the verdict must agree with the contract in metadata.h,
// evaluated here in int64. validate() also runs on corrupted copies of valid
// metadata, and its verdict must agree with the consistency rules it
// documents. Valid metadata then goes through the REFERENCE and CPU_ATTN
// builders; CPU_ATTN's work plan must cover every (request, KV head, query
// token) exactly once, split requests by key ranges that tile the sequence.
#include <fuzzer/FuzzedDataProvider.h>
#include <pagedattn/backend/backend.h>
#include <pagedattn/error.h>
#include <pagedattn/metadata.h>
#include <pagedattn/backend/registry.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "backends/cpu_attn/cpu_attn_metadata.h"
#include "fuzz_check.h"

namespace pagedattn::fuzz {
namespace {

constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
constexpr std::string_view kWhere = "fuzz_metadata";
constexpr int kMaxRequests = 6;
constexpr int kMaxBlocksPerRequest = 48;
constexpr std::int32_t kMaxBlockId = 64;
constexpr int kMaxSmallLength = 40;
constexpr int kMaxPadding = 8;
constexpr int kMaxKvHeads = 8;
constexpr int kMaxGroup = 8;  // query heads per KV head
constexpr int kMaxMutations = 3;
// Valid batches larger than this are not built: their slot mappings and
// tables would cost more memory and time than they can find.
constexpr std::int64_t kMaxBuiltSlots = 1 << 14;
// CPU_ATTN's plan makes one work item per 1536 keys of a decode and per 16
// query tokens of a prefill: plans are only made below these, so they stay
// cheap. (This also keeps the target off a reported CPU_ATTN defect: for a
// decode of more than INT_MAX - 1535 keys, make_work_list's split count
// overflows int.)
constexpr std::int64_t kMaxPlannedKeys = 1 << 14;
constexpr std::int64_t kMaxPlannedTokens = 1 << 14;
constexpr int kBlockSizes[] = {1, 2, 3, 4, 7, 16, 1 << 20, static_cast<int>(kIntMax), 0, -1};
constexpr int kExtremeLengths[] = {
    -1,      static_cast<int>(kIntMax),      static_cast<int>(kIntMax) - 1, 1'000'000'000,
    1 << 30, std::numeric_limits<int>::min()};
constexpr int kExtremePaddings[] = {-1, static_cast<int>(kIntMax), static_cast<int>(kIntMax) - 1};

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------- builders --

struct Batch {
  std::vector<RequestSpec> requests;
  std::vector<int> encoder_lens;  // cross-attention only
  MetadataOptions options;
  bool cross = false;
  bool write_encoder_kv = false;
};

int pick_length(FuzzedDataProvider& in) {
  return in.ConsumeIntegralInRange(0, 7) == 0 ? in.PickValueInArray(kExtremeLengths)
                                              : in.ConsumeIntegralInRange(0, kMaxSmallLength);
}

Batch make_batch(FuzzedDataProvider& in) {
  Batch b;
  b.options.block_size = in.PickValueInArray(kBlockSizes);
  b.options.causal = in.ConsumeBool();
  b.options.num_padded_slots = in.ConsumeIntegralInRange(0, 7) == 0
                                   ? in.PickValueInArray(kExtremePaddings)
                                   : in.ConsumeIntegralInRange(0, kMaxPadding);
  b.cross = in.ConsumeBool();
  b.write_encoder_kv = in.ConsumeBool();
  const int n = in.ConsumeIntegralInRange(0, kMaxRequests);
  for (int r = 0; r < n; ++r) {
    RequestSpec req;
    req.query_len = pick_length(in);
    // Mostly a context on top of the query, sometimes anything.
    req.seq_len = in.ConsumeBool() && req.query_len >= 0
                      ? static_cast<int>(std::min<std::int64_t>(
                            kIntMax, static_cast<std::int64_t>(req.query_len) + pick_length(in)))
                      : pick_length(in);
    const int encoder_len = pick_length(in);
    if (b.cross) b.encoder_lens.push_back(encoder_len);
    const int key_len = b.cross ? encoder_len : req.seq_len;
    const std::int64_t needed =
        b.options.block_size > 0 && key_len > 0 ? ceil_div(key_len, b.options.block_size) : 0;
    // The blocks needed, one more or one fewer, or a fuzzer-chosen count.
    const std::int64_t count =
        in.ConsumeBool() ? needed + in.ConsumeIntegralInRange(-1, 1) : in.ConsumeIntegralInRange(0, 4);
    for (std::int64_t i = 0; i < std::clamp<std::int64_t>(count, 0, kMaxBlocksPerRequest); ++i) {
      req.blocks.push_back(in.ConsumeIntegralInRange<std::int32_t>(-1, kMaxBlockId));
    }
    b.requests.push_back(std::move(req));
  }
  if (b.cross && in.ConsumeIntegralInRange(0, 7) == 0) {  // a length list of the wrong size
    if (in.ConsumeBool() || b.encoder_lens.empty()) {
      b.encoder_lens.push_back(1);
    } else {
      b.encoder_lens.pop_back();
    }
  }
  return b;
}

// The contract of make_common_metadata / make_cross_attention_metadata, in
// int64: nullopt when the batch must be rejected, else its slot count.
std::optional<std::int64_t> expected_slots(const Batch& b) {
  const MetadataOptions& o = b.options;
  if (o.block_size <= 0 || o.num_padded_slots < 0 || b.requests.empty()) return std::nullopt;
  if (b.cross && b.encoder_lens.size() != b.requests.size()) return std::nullopt;
  std::int64_t tokens = 0;
  std::int64_t encoder_tokens = 0;
  for (std::size_t r = 0; r < b.requests.size(); ++r) {
    const RequestSpec& req = b.requests[r];
    const int key_len = b.cross ? b.encoder_lens[r] : req.seq_len;
    if (req.query_len < 0 || req.seq_len < req.query_len || key_len < 0) return std::nullopt;
    if (std::ssize(req.blocks) < ceil_div(key_len, o.block_size)) return std::nullopt;
    if (std::any_of(req.blocks.begin(), req.blocks.end(), [](std::int32_t id) { return id < 0; })) {
      return std::nullopt;
    }
    tokens += req.query_len;
    encoder_tokens += key_len;
  }
  const std::int64_t slots =
      (b.cross ? (b.write_encoder_kv ? encoder_tokens : 0) : tokens) + o.num_padded_slots;
  if (tokens > kIntMax || slots > kIntMax) return std::nullopt;
  return slots;
}

std::vector<std::int32_t> host_i32(const Tensor& t) {
  const auto* p = static_cast<const std::int32_t*>(t.data());
  return {p, p + t.numel()};
}

// The metadata describes exactly the batch.
void check_built(const Batch& b, const CommonAttentionMetadata& md, std::int64_t num_slots) {
  const auto n = std::ssize(b.requests);
  require(md.num_reqs == n, "num_reqs {} for {} requests", md.num_reqs, n);
  require(md.causal == (b.options.causal && !b.cross) && md.block_size == b.options.block_size,
          "causal {} / block_size {}", md.causal, md.block_size);
  require(md.encoder_seq_lens_cpu.has_value() == b.cross, "encoder_seq_lens_cpu present: {}",
          md.encoder_seq_lens_cpu.has_value());
  const std::vector<std::int32_t> loc = host_i32(md.query_start_loc_cpu);
  const std::vector<std::int32_t> seq = host_i32(md.seq_lens_cpu);
  require(std::ssize(loc) == n + 1 && std::ssize(seq) == n && loc[0] == 0, "offsets or lengths mis-sized");
  require(md.slot_mapping.size(0) == num_slots, "{} slots, expected {}", md.slot_mapping.size(0), num_slots);
  const auto* slots = md.slot_mapping.data_as<std::int64_t>();
  std::int64_t next_slot = 0;
  int max_q = 0;
  int max_s = 0;
  for (std::ptrdiff_t r = 0; r < n; ++r) {
    const RequestSpec& req = b.requests[static_cast<std::size_t>(r)];
    const auto i = static_cast<std::size_t>(r);
    const int key_len = b.cross ? b.encoder_lens[i] : req.seq_len;
    require(loc[i + 1] - loc[i] == req.query_len && seq[i] == key_len, "request {}: ({}, {}) for ({}, {})", r,
            loc[i + 1] - loc[i], seq[i], req.query_len, key_len);
    if (b.cross) require(host_i32(*md.encoder_seq_lens_cpu)[i] == key_len, "encoder length {}", r);
    max_q = std::max(max_q, req.query_len);
    max_s = std::max(max_s, key_len);
    const auto row = md.block_table_host_row(static_cast<int>(r));
    for (std::size_t c = 0; c < row.size(); ++c) {
      const std::int32_t want = c < req.blocks.size() ? req.blocks[c] : kNullBlockId;
      require(row[c] == want, "block_table[{}][{}] = {}, expected {}", r, c, row[c], want);
    }
    // Slots of the query tokens (the last query_len positions), or of every
    // encoder token when cross-attention writes them.
    const bool writes = !b.cross || b.write_encoder_kv;
    const int first = b.cross ? 0 : req.seq_len - req.query_len;
    const int count = b.cross ? (b.write_encoder_kv ? key_len : 0) : req.query_len;
    for (int p = first; writes && p < first + count; ++p, ++next_slot) {
      const std::int64_t want =
          static_cast<std::int64_t>(req.blocks[static_cast<std::size_t>(p / b.options.block_size)]) *
              b.options.block_size +
          p % b.options.block_size;
      require(slots[next_slot] == want, "slot {} = {}, expected {}", next_slot, slots[next_slot], want);
    }
  }
  for (; next_slot < num_slots; ++next_slot) {
    require(slots[next_slot] == kPadSlotId, "padding slot {} = {}", next_slot, slots[next_slot]);
  }
  require(md.num_actual_tokens == loc.back() && md.max_query_len == max_q && md.max_seq_len == max_s,
          "num_actual_tokens {} / max_query_len {} / max_seq_len {}", md.num_actual_tokens, md.max_query_len,
          md.max_seq_len);
}

// ------------------------------------------------------------- validation ---

// The rules validate documents for metadata whose tensors have the right
// kinds and shapes, in int64; true when they all hold.
bool consistent(const CommonAttentionMetadata& md, std::int64_t num_blocks) {
  if (md.block_size <= 0 || num_blocks < 0) return false;
  const std::vector<std::int32_t> loc = host_i32(md.query_start_loc_cpu);
  const std::vector<std::int32_t> seq = host_i32(md.seq_lens_cpu);
  const bool cross = md.encoder_seq_lens_cpu.has_value();
  if (loc[0] != 0) return false;
  std::int64_t max_q = 0;
  std::int64_t max_s = 0;
  for (int r = 0; r < md.num_reqs; ++r) {
    const auto i = static_cast<std::size_t>(r);
    const std::int64_t q = static_cast<std::int64_t>(loc[i + 1]) - loc[i];
    const std::int64_t s = seq[i];
    if (q < 0 || s < 0) return false;
    if (cross ? s != host_i32(*md.encoder_seq_lens_cpu)[i] : s < q) return false;
    max_q = std::max(max_q, q);
    max_s = std::max(max_s, s);
    const std::int64_t used = ceil_div(s, md.block_size);
    if (used > md.block_table_cpu.size(1)) return false;
    const auto row = md.block_table_host_row(r);
    for (std::int64_t c = 0; num_blocks > 0 && c < used; ++c) {
      const std::int32_t id = row[static_cast<std::size_t>(c)];
      if (id < 0 || id >= num_blocks) return false;
    }
  }
  if (md.num_actual_tokens != loc.back() || md.max_query_len < max_q || md.max_seq_len < max_s) return false;
  if (!cross && md.slot_mapping.size(0) < md.num_actual_tokens) return false;
  const auto* slots = md.slot_mapping.data_as<std::int64_t>();
  for (std::int64_t i = 0; num_blocks > 0 && i < md.slot_mapping.size(0); ++i) {
    // slot < num_blocks * block_size, without the product.
    if (slots[i] != kPadSlotId && (slots[i] < 0 || slots[i] / md.block_size >= num_blocks)) return false;
  }
  return true;
}

enum class Mutation {
  QueryStart,
  SeqLen,
  BlockId,
  Slot,
  Counts,
  EncoderLens,
  Structure,
  kMaxValue = Structure,
};

// Corrupts `md`; returns false when the corruption breaks its structure
// (a tensor of the wrong kind or shape), which validate must always reject.
bool mutate(CommonAttentionMetadata& md, FuzzedDataProvider& in) {
  const auto pick = [&](std::int64_t n) {
    return in.ConsumeIntegralInRange<std::int64_t>(0, std::max<std::int64_t>(n, 1) - 1);
  };
  const auto value = [&] {
    return in.ConsumeBool() ? in.ConsumeIntegralInRange(-2, 20) : in.ConsumeIntegral<int>();
  };
  switch (in.ConsumeEnum<Mutation>()) {
    case Mutation::QueryStart:
      md.query_start_loc_cpu.data_as<std::int32_t>()[pick(md.query_start_loc_cpu.numel())] = value();
      return true;
    case Mutation::SeqLen:
      if (md.num_reqs > 0) md.seq_lens_cpu.data_as<std::int32_t>()[pick(md.num_reqs)] = value();
      return true;
    case Mutation::BlockId:
      md.block_table_cpu.data_as<std::int32_t>()[pick(md.block_table_cpu.numel())] = value();
      return true;
    case Mutation::Slot:
      if (md.slot_mapping.numel() > 0) {
        md.slot_mapping.data_as<std::int64_t>()[pick(md.slot_mapping.numel())] =
            in.ConsumeBool() ? in.ConsumeIntegralInRange<std::int64_t>(-2, 2000)
                             : in.ConsumeIntegral<std::int64_t>();
      }
      return true;
    case Mutation::Counts:
      md.num_actual_tokens =
          in.ConsumeBool()
              ? static_cast<int>(std::clamp<std::int64_t>(
                    static_cast<std::int64_t>(md.num_actual_tokens) + in.ConsumeIntegralInRange(-1, 1),
                    std::numeric_limits<int>::min(), kIntMax))
              : value();
      md.max_query_len = in.ConsumeBool() ? md.max_query_len : value();
      md.max_seq_len = in.ConsumeBool() ? md.max_seq_len : value();
      md.block_size = in.ConsumeBool() ? md.block_size : value();
      return true;
    case Mutation::EncoderLens:
      if (md.encoder_seq_lens_cpu && in.ConsumeBool()) {
        md.encoder_seq_lens_cpu.reset();
      } else {
        std::vector<std::int32_t> lens = host_i32(md.seq_lens_cpu);
        if (!lens.empty()) lens[static_cast<std::size_t>(pick(std::ssize(lens)))] = value();
        md.encoder_seq_lens_cpu = Tensor::from_i32(lens, {std::ssize(lens)});
      }
      return true;
    case Mutation::Structure:
      switch (in.ConsumeIntegralInRange(0, 4)) {
        case 0:
          md.num_reqs += in.ConsumeBool() ? 1 : -1;
          break;
        case 1:
          md.query_start_loc_cpu = Tensor::from_i64(
              std::vector<std::int64_t>(static_cast<std::size_t>(md.num_reqs) + 1), {md.num_reqs + 1});
          break;
        case 2:
          md.seq_lens = md.seq_lens.slice(0, 0, std::max(0, md.num_reqs - 1));
          if (md.num_reqs == 0) md.seq_lens = Tensor{};
          break;
        case 3:
          md.block_table_cpu = md.block_table_cpu.slice(1, 0, md.block_table_cpu.size(1) - 1);
          break;
        default:
          md.slot_mapping = Tensor::from_i32(std::vector<std::int32_t>{0}, {1});
          break;
      }
      return false;
  }
  return true;
}

// ----------------------------------------------------------- CPU builders ---

// One work item's share of a (request, KV head): query and key ranges, and
// the first partial slot it writes (< 0: it writes the output itself).
struct Coverage {
  int q_begin = 0;
  int q_end = 0;
  int k_begin = 0;
  int k_end = 0;
  std::int64_t partial = -1;
  friend auto operator<=>(const Coverage&, const Coverage&) = default;
};

// Every (request, KV head) with query tokens is covered: by tiles of the query
// tokens over all keys, or (split) by key ranges tiling [0, seq_len) whose
// partials, in split order, one merge combines; partial slots never overlap.
void check_work_plan(const CommonAttentionMetadata& md, const CpuAttnMetadata& plan_md, int num_kv_heads) {
  const cpu_attn::WorkList& plan = plan_md.work;
  const auto loc = md.query_start_loc_host();
  const auto seq = md.seq_lens_host();
  std::map<std::pair<int, int>, std::vector<Coverage>> covered;
  std::vector<char> partial_used(static_cast<std::size_t>(plan.partial_tokens), 0);
  for (const cpu_attn::WorkItem& item : plan.items) {
    require(item.request >= 0 && item.request < md.num_reqs && item.kv_heads >= 1 && item.kv_head >= 0 &&
                item.kv_head + item.kv_heads <= num_kv_heads &&
                item.q_end - item.q_begin <= plan.max_item_tokens && item.kv_heads <= plan.max_item_kv_heads,
            "work item (request {}, heads {}+{}) out of range", item.request, item.kv_head, item.kv_heads);
    for (int h = item.kv_head; h < item.kv_head + item.kv_heads; ++h) {
      Coverage c{item.q_begin, item.q_end, item.k_begin, item.k_end};
      if (item.partial_token >= 0) {
        c.partial = item.partial_token + (h - item.kv_head) * item.partial_head_stride;
        for (std::int64_t t = c.partial; t < c.partial + (item.q_end - item.q_begin); ++t) {
          require(t >= 0 && t < plan.partial_tokens && !partial_used[static_cast<std::size_t>(t)],
                  "partial slot {} out of range or written twice", t);
          partial_used[static_cast<std::size_t>(t)] = 1;
        }
      }
      covered[{item.request, h}].push_back(c);
    }
  }
  std::map<std::pair<int, int>, std::vector<cpu_attn::MergeItem>> merges;
  for (const cpu_attn::MergeItem& m : plan.merges) merges[{m.request, m.kv_head}].push_back(m);
  for (int r = 0; r < md.num_reqs; ++r) {
    const int q = loc[static_cast<std::size_t>(r) + 1] - loc[static_cast<std::size_t>(r)];
    const int keys = seq[static_cast<std::size_t>(r)];
    for (int h = 0; h < num_kv_heads; ++h) {
      std::vector<Coverage>& ranges = covered[{r, h}];
      std::sort(ranges.begin(), ranges.end());
      const std::vector<cpu_attn::MergeItem>& merge = merges[{r, h}];
      if (q == 0) {
        require(ranges.empty() && merge.empty(), "request {} has no query tokens but {} items", r,
                ranges.size());
        continue;
      }
      const bool split = ranges.front().partial >= 0;
      require(merge.size() == (split ? 1U : 0U), "request {} head {}: {} merges", r, h, merge.size());
      int next_q = 0;
      int next_k = 0;
      for (std::size_t s = 0; s < ranges.size(); ++s) {
        const Coverage& c = ranges[s];
        if (split) {
          require(c.q_begin == 0 && c.q_end == q && c.k_begin == next_k && c.k_end > c.k_begin &&
                      c.partial == merge[0].first_partial_token + static_cast<std::int64_t>(s) * q,
                  "split {} of request {} head {}: keys [{}, {}), partial {}", s, r, h, c.k_begin, c.k_end,
                  c.partial);
          next_k = c.k_end;
        } else {
          require(c.partial < 0 && c.q_begin == next_q && c.q_end > c.q_begin && c.k_begin == 0 &&
                      c.k_end == keys,
                  "tile [{}, {}) x [{}, {}) of request {}", c.q_begin, c.q_end, c.k_begin, c.k_end, r);
          next_q = c.q_end;
        }
      }
      require(split ? next_k == keys && merge[0].num_splits == std::ssize(ranges) && merge[0].q_begin == 0 &&
                          merge[0].q_end == q
                    : next_q == q,
              "request {} head {} not covered", r, h);
    }
  }
}

void run_builders(const CommonAttentionMetadata& md, FuzzedDataProvider& in) {
  if (md.max_seq_len > kMaxPlannedKeys || md.num_actual_tokens > kMaxPlannedTokens) return;
  BuilderParams params;
  params.block_size = md.block_size;
  params.num_kv_heads = in.ConsumeIntegralInRange(1, kMaxKvHeads);
  params.num_heads = params.num_kv_heads * in.ConsumeIntegralInRange(1, kMaxGroup);
  params.head_size = 64;
  for (const std::string_view name : {"REFERENCE", "CPU_ATTN"}) {
    const AttentionBackend* backend = BackendRegistry::instance().find(name);
    require(backend != nullptr, "backend {} not registered", name);
    const auto built = backend->make_builder(params)->build(md);
    require(built->common.num_actual_tokens == md.num_actual_tokens, "{} builder changed the metadata", name);
    if (name == "CPU_ATTN")
      check_work_plan(md, dynamic_cast<const CpuAttnMetadata&>(*built), params.num_kv_heads);
  }
}

void fuzz_one(FuzzedDataProvider& in) {
  const Batch b = make_batch(in);
  const auto slots = expected_slots(b);
  // Valid but too large to build cheaply: skipped (an invalid one is always
  // built: it must be rejected before anything is allocated).
  if (slots && *slots > kMaxBuiltSlots) return;
  std::optional<CommonAttentionMetadata> md;
  try {
    md = b.cross ? make_cross_attention_metadata(b.requests, b.encoder_lens, b.write_encoder_kv, b.options)
                 : make_common_metadata(b.requests, b.options);
  } catch (const Error& e) {
    require_error(e, ErrorKind::InvalidArgument,
                  b.cross ? "make_cross_attention_metadata" : "make_common_metadata");
    require(!slots, "a valid batch was rejected: {}", e.what());
    return;
  }
  require(slots.has_value(), "an invalid batch was accepted");
  check_built(b, *md, *slots);
  std::int64_t max_id = -1;
  for (const RequestSpec& req : b.requests) {
    for (const std::int32_t id : req.blocks) max_id = std::max<std::int64_t>(max_id, id);
  }
  md->validate(kWhere);
  md->validate(kWhere, max_id + 1);
  run_builders(*md, in);

  // Corrupted copies (host copies are the tensors themselves on the CPU).
  const int mutations = in.ConsumeIntegralInRange(0, kMaxMutations);
  for (int m = 0; m < mutations; ++m) {
    CommonAttentionMetadata copy = *md;
    copy.query_start_loc_cpu = Tensor::from_i32(host_i32(md->query_start_loc_cpu), {md->num_reqs + 1});
    copy.seq_lens_cpu = Tensor::from_i32(host_i32(md->seq_lens_cpu), {md->num_reqs});
    copy.block_table_cpu = Tensor::from_i32(host_i32(md->block_table_cpu), md->block_table_cpu.shape());
    copy.slot_mapping = Tensor::from_i64(
        std::vector<std::int64_t>(md->slot_mapping.data_as<std::int64_t>(),
                                  md->slot_mapping.data_as<std::int64_t>() + md->slot_mapping.numel()),
        {md->slot_mapping.numel()});
    copy.query_start_loc = copy.query_start_loc_cpu;
    copy.seq_lens = copy.seq_lens_cpu;
    copy.block_table = copy.block_table_cpu;
    const bool structured = mutate(copy, in);
    const std::int64_t num_blocks =
        in.ConsumeBool() ? max_id + 1 + in.ConsumeIntegralInRange(-1, 1) : in.ConsumeIntegral<std::int64_t>();
    const bool want = structured && consistent(copy, num_blocks);
    try {
      copy.validate(kWhere, num_blocks);
    } catch (const Error& e) {
      require_error(e, ErrorKind::InvalidArgument, kWhere);
      require(!want, "validate rejected consistent metadata: {}", e.what());
      continue;
    }
    require(want, "validate accepted inconsistent metadata");
    run_builders(copy, in);
  }
}

}  // namespace
}  // namespace pagedattn::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  pagedattn::fuzz::fuzz_one(in);
  return 0;
}
