// fuzz_batch_attention: the public plan/run wrapper (BatchAttention) on the
// CPU: a CPU_ATTN and a REFERENCE instance of the same fuzzer-chosen options
// (heads, KV heads, head size, block size, causal, PrefixLM, window, soft
// cap, ALiBi, sinks, chunked local attention, scale, fixed capacities,
// cascade, batch invariance; now and then one option made invalid), each
// over its own copy of one small f32 KV cache (NHD or HND), through 1-3
// steps of plan() and run(). A step's plan is mostly well formed (now and
// then 8 requests behind a shared 256-token prefix, so cascades happen), with
// up to three corruptions: offsets, lengths, block ids, stride, array sizes,
// PrefixLM ranges, small and extreme (INT32_MAX, INT32_MIN, -1) values.
//
// Properties:
// - the constructor accepts the options or throws InvalidArgument /
//   Unsupported; options the header's rules reject are InvalidArgument;
// - plan() accepts exactly the steps its contract admits (evaluated here in
//   int64); a rejection is an InvalidArgument from "BatchAttention::plan",
//   the same from both instances; an accepted plan's num_tokens() and
//   slot_mapping() are the ones computed here from the block table;
// - a rejected plan changes nothing: slot_mapping() stays, and run() with
//   the last accepted plan's inputs gives its verdict again and, when it
//   ran, the same output bits; with no plan accepted yet, run() and
//   slot_mapping() throw;
// - run() with a planned step's query (plus padding rows) and key/value (or
//   none) succeeds exactly when every block id the step reads is inside the
//   cache, on both instances; a rejected run writes nothing;
// - after an accepted run each cache is the one before with the step's rows
//   at the expected slots, nothing else changed; padding rows of output and
//   LSE are untouched; REFERENCE's output and LSE are within the conformance
//   tolerance table of the dense fp64 oracle's (keys gathered here, so that
//   a wrapper or metadata defect both backends share shows), and CPU_ATTN's
//   are finite and within it of REFERENCE's.
#include <fuzzer/FuzzedDataProvider.h>
#include <pagedattn/batch_attention.h>
#include <pagedattn/cascade.h>
#include <pagedattn/conformance.h>
#include <pagedattn/error.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "conformance/rng.h"
#include "fuzz_check.h"

namespace pagedattn::fuzz {
namespace {

using conformance::Rng;

constexpr std::string_view kPlanWhere = "BatchAttention::plan";
constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
constexpr std::int32_t kInt32Min = std::numeric_limits<std::int32_t>::min();
constexpr int kHeadSizes[] = {8, 16, 32};
constexpr int kGroups[] = {1, 2, 3};  // query heads per KV head
constexpr int kMaxKvHeads = 2;
constexpr int kBlockSizes[] = {1, 2, 3, 4, 8, 16};
// The cache holds this many token slots whatever the block size. Block ids
// may repeat (both instances read the same bits), so a cascade step's
// kCascadeMinPrefixTokens-token prefix needs no more.
constexpr int kCacheTokens = 128;
constexpr int kMaxSharedQueryLen = 2;
constexpr int kMaxSteps = 3;
constexpr int kMaxRequests = 4;
constexpr int kMaxQueryLen = 8;
constexpr int kMaxContextLen = 24;
constexpr int kMaxSpareBlocks = 2;  // table entries past a row's longest need
constexpr int kMaxMutations = 3;
constexpr int kMaxRangesPerRequest = 2;
constexpr int kMaxRangeGap = 4;
constexpr int kMaxRangeLen = 6;
constexpr int kMaxPaddingRows = 2;
constexpr int kMaxWindow = 16;
constexpr float kMinSoftCap = 1.0f;
constexpr float kMaxSoftCap = 30.0f;
constexpr float kMinScale = 0.05f;
constexpr float kMaxScale = 2.0f;
constexpr float kMaxSink = 5.0f;  // sinks ~ U[0, 5), as the conformance grid
constexpr int kMaxChunkBlocks = 4;
constexpr float kUnwritten = -1234.5f;  // output / LSE padding rows, never a result
constexpr std::int32_t kExtremeValues[] = {-1, kInt32Min, static_cast<std::int32_t>(kInt32Max),
                                           static_cast<std::int32_t>(kInt32Max) - 1, 1 << 30};
constexpr std::int64_t kMinStride = std::numeric_limits<std::int64_t>::min();
constexpr std::int64_t kMaxStride = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kExtremeStrides[] = {-1,        0, kInt32Max, kInt32Max + 1, std::int64_t{1} << 40,
                                            kMaxStride};
constexpr int kSmallValueMax = 40;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// ------------------------------------------------------------------ setup ---

struct Setup {
  BatchAttentionOptions options;  // CPU_ATTN's; REFERENCE's differ in backend and batch_invariant
  bool hnd = false;               // cache layout [NB, Hkv, BS, D] instead of [NB, BS, Hkv, D]
  std::uint64_t seed = 0;
  int num_blocks = 0;

  int block_size() const { return options.block_size; }
  int kv_heads() const { return options.num_kv_heads == 0 ? options.num_heads : options.num_kv_heads; }
  std::string describe() const {
    const BatchAttentionOptions& o = options;
    return fmt::format(
        "H {} Hkv {} D {} bs {} causal {} mm_prefix {} window {} soft_cap {} alibi {} sinks {} chunk {} "
        "scale {} capacities {}/{}/{} cascade {} batch_invariant {} layout {} blocks {} seed {}",
        o.num_heads, o.num_kv_heads, o.head_size, o.block_size, o.causal, o.use_mm_prefix,
        o.sliding_window.value_or(0), o.logits_soft_cap.value_or(0.0f), o.alibi_slopes.size(), o.sinks.size(),
        o.attention_chunk_size.value_or(0), o.scale.value_or(0.0f), o.max_num_reqs, o.max_num_tokens,
        o.max_blocks_per_req, o.cascade, o.batch_invariant, hnd ? "HND" : "NHD", num_blocks, seed);
  }
};

enum class OptionFault {
  Size,        // head_size, block_size or num_kv_heads in [-1, 3]
  Float,       // scale or logits_soft_cap 0, -1, NaN or inf
  Window,      // in [-1, 3]
  PerHead,     // sinks or ALiBi slopes of num_heads +- 1
  Chunk,       // a multiple of block_size in [-1, 3], or one past it
  MmPrefix,    // maybe not causal, maybe chunked
  Capacities,  // each 0 or positive (see the top of the file)
  kMaxValue = Capacities,
};

constexpr float kBadFloats[] = {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                                std::numeric_limits<float>::infinity()};

// Sets one option to a value that is often outside its rules.
void break_option(FuzzedDataProvider& in, BatchAttentionOptions& o) {
  const int small = in.ConsumeIntegralInRange(-1, 3);
  int* const sizes[] = {&o.head_size, &o.block_size, &o.num_kv_heads};
  std::optional<float>* const floats[] = {&o.scale, &o.logits_soft_cap};
  std::vector<float>* const per_head[] = {&o.sinks, &o.alibi_slopes};
  switch (in.ConsumeEnum<OptionFault>()) {
    case OptionFault::Size:
      *in.PickValueInArray(sizes) = small;
      break;
    case OptionFault::Float:
      *in.PickValueInArray(floats) = in.PickValueInArray(kBadFloats);
      break;
    case OptionFault::Window:
      o.sliding_window = small;
      break;
    case OptionFault::PerHead:
      in.PickValueInArray(per_head)->assign(
          static_cast<std::size_t>(o.num_heads + (in.ConsumeBool() ? 1 : -1)), 1.0f);
      break;
    case OptionFault::Chunk:
      o.attention_chunk_size = o.block_size * small + in.ConsumeIntegralInRange(0, 1);
      break;
    case OptionFault::MmPrefix:
      o.use_mm_prefix = true;
      o.causal = in.ConsumeBool();
      if (in.ConsumeBool()) o.attention_chunk_size = o.block_size;
      break;
    case OptionFault::Capacities:
      o.max_num_reqs = small;
      o.max_num_tokens = in.ConsumeIntegralInRange(-1, 1);
      o.max_blocks_per_req = in.ConsumeIntegralInRange(-1, 1);
      break;
  }
}

// The header's rules for options (batch_attention.h and the impl parameter
// checks it leads to); false when they must be rejected.
bool options_valid(const BatchAttentionOptions& o) {
  const int kv = o.num_kv_heads == 0 ? o.num_heads : o.num_kv_heads;
  const auto per_head = [&](const std::vector<float>& v) {
    return v.empty() || v.size() == static_cast<std::size_t>(o.num_heads);
  };
  const bool all_fixed = o.max_num_reqs > 0 && o.max_num_tokens > 0 && o.max_blocks_per_req > 0;
  const bool none_fixed = o.max_num_reqs == 0 && o.max_num_tokens == 0 && o.max_blocks_per_req == 0;
  return o.num_heads > 0 && o.head_size > 0 && kv > 0 && o.num_heads % kv == 0 && o.block_size > 0 &&
         (!o.scale || std::isfinite(*o.scale)) && (!o.sliding_window || *o.sliding_window > 0) &&
         (!o.logits_soft_cap || (std::isfinite(*o.logits_soft_cap) && *o.logits_soft_cap > 0)) &&
         per_head(o.alibi_slopes) && per_head(o.sinks) &&
         (!o.attention_chunk_size ||
          (*o.attention_chunk_size > 0 && *o.attention_chunk_size % o.block_size == 0)) &&
         (!o.use_mm_prefix || (o.causal && !o.attention_chunk_size)) && (all_fixed || none_fixed);
}

Setup make_setup(FuzzedDataProvider& in) {
  Setup s;
  BatchAttentionOptions& o = s.options;
  o.num_kv_heads = in.ConsumeIntegralInRange(1, kMaxKvHeads);
  o.num_heads = o.num_kv_heads * in.PickValueInArray(kGroups);
  o.head_size = in.PickValueInArray(kHeadSizes);
  o.block_size = in.PickValueInArray(kBlockSizes);
  o.dtype = DType::F32;
  o.backend = "CPU_ATTN";
  // Exhausted input reads zeros: the plain causal case.
  o.causal = in.ConsumeIntegralInRange(0, 3) != 3;
  o.use_mm_prefix = o.causal && in.ConsumeBool();
  const auto sometimes = [&] { return in.ConsumeIntegralInRange(0, 3) == 3; };
  if (sometimes()) o.sliding_window = in.ConsumeIntegralInRange(1, kMaxWindow);
  if (sometimes()) o.logits_soft_cap = in.ConsumeFloatingPointInRange(kMinSoftCap, kMaxSoftCap);
  if (sometimes()) o.scale = in.ConsumeFloatingPointInRange(kMinScale, kMaxScale);
  if (sometimes()) o.alibi_slopes = alibi_slopes(o.num_heads);
  const bool sinks = sometimes();
  if (!o.use_mm_prefix && sometimes()) {
    o.attention_chunk_size = o.block_size * in.ConsumeIntegralInRange(1, kMaxChunkBlocks);
  }
  if (sometimes()) {
    o.max_num_reqs = in.ConsumeIntegralInRange(1, kMaxRequests);
    o.max_num_tokens = in.ConsumeIntegralInRange(1, kMaxRequests * kMaxQueryLen);
    o.max_blocks_per_req = in.ConsumeIntegralInRange(1, kMaxContextLen + kMaxQueryLen);
  }
  o.cascade = !sometimes();
  o.batch_invariant = sometimes();
  s.hnd = in.ConsumeBool();
  s.seed = in.ConsumeIntegral<std::uint64_t>();
  if (sinks) {
    Rng rng(s.seed);
    for (int h = 0; h < o.num_heads; ++h) o.sinks.push_back(static_cast<float>(rng.uniform()) * kMaxSink);
  }
  if (in.ConsumeIntegralInRange(0, 15) == 15) break_option(in, o);
  s.num_blocks = o.block_size > 0 ? kCacheTokens / o.block_size : 0;
  return s;
}

// ------------------------------------------------------------------ cache ---

// A cache's storage, in the setup's layout. The cache holds finite values
// only, so == compares bits but for signed zeros.
struct CacheContents {
  std::vector<float> key;
  std::vector<float> value;
  bool operator==(const CacheContents&) const = default;
};

// One instance's cache: contiguous storage in the setup's layout, seen as
// [NB, BS, Hkv, D].
struct Cache {
  Tensor key;
  Tensor value;

  KVCacheView view() const { return {key, value}; }
  CacheContents contents() const {
    const auto* k = static_cast<const float*>(key.data());
    const auto* v = static_cast<const float*>(value.data());
    return {{k, k + key.numel()}, {v, v + value.numel()}};
  }
};

// Where (slot, KV head)'s row starts in a cache's storage.
std::size_t storage_offset(const Setup& s, std::int64_t slot, std::int64_t head) {
  const std::int64_t bs = s.block_size();
  const std::int64_t hkv = s.kv_heads();
  const std::int64_t row = s.hnd ? ((slot / bs) * hkv + head) * bs + slot % bs : slot * hkv + head;
  return static_cast<std::size_t>(row * s.options.head_size);
}

std::vector<float> random_values(Rng& rng, std::size_t n) {
  std::vector<float> v(n);
  for (float& x : v) x = rng.normal();
  return v;
}

// The setup's cache, drawn from its seed: every call gives the same values.
Cache make_cache(const Setup& s) {
  const std::int64_t nb = s.num_blocks;
  const std::int64_t bs = s.block_size();
  const std::int64_t hkv = s.kv_heads();
  const std::int64_t d = s.options.head_size;
  Rng rng(s.seed);
  const auto half = [&] {
    const std::vector<float> v = random_values(rng, static_cast<std::size_t>(nb * bs * hkv * d));
    if (!s.hnd) return Tensor::from_floats(v, {nb, bs, hkv, d}, DType::F32);
    return Tensor::from_floats(v, {nb, hkv, bs, d}, DType::F32).permute({0, 2, 1, 3});
  };
  Tensor key = half();
  return {key, half()};
}

// ------------------------------------------------------------------- plan ---

struct PlanArgs {
  std::vector<std::int32_t> query_start_loc;
  std::vector<std::int32_t> seq_lens;
  std::vector<std::int32_t> block_table;
  std::int64_t stride = 0;
  std::vector<std::int32_t> range_start_loc;
  std::vector<std::int32_t> ranges;

  std::string describe() const {
    return fmt::format(
        "query_start_loc [{}] seq_lens [{}] stride {} block_table [{}] range_start_loc [{}] ranges [{}]",
        fmt::join(query_start_loc, ","), fmt::join(seq_lens, ","), stride, fmt::join(block_table, ","),
        fmt::join(range_start_loc, ","), fmt::join(ranges, ","));
  }
};

// The slots plan() maps the step's query tokens to (batch_attention.h): the
// last q_len positions of each request, block_table[r][pos / BS] * BS + pos % BS.
std::vector<std::int64_t> expected_slots(const PlanArgs& p, int bs) {
  std::vector<std::int64_t> slots;
  for (std::size_t r = 0; r < p.seq_lens.size(); ++r) {
    const std::int32_t* row = p.block_table.data() + r * static_cast<std::size_t>(p.stride);
    for (std::int64_t pos = p.seq_lens[r] - (p.query_start_loc[r + 1] - p.query_start_loc[r]);
         pos < p.seq_lens[r]; ++pos) {
      slots.push_back(static_cast<std::int64_t>(row[pos / bs]) * bs + pos % bs);
    }
  }
  return slots;
}

std::int32_t pick_value(FuzzedDataProvider& in) {
  return in.ConsumeBool() ? in.ConsumeIntegralInRange(-2, kSmallValueMax)
                          : in.PickValueInArray(kExtremeValues);
}

// Sorted, disjoint, non-empty ranges within [0, seq_len], CSR over requests.
void add_ranges(FuzzedDataProvider& in, PlanArgs& p) {
  p.range_start_loc = {0};
  for (const std::int32_t seq : p.seq_lens) {
    std::int32_t cursor = 0;
    for (int i = in.ConsumeIntegralInRange(0, kMaxRangesPerRequest); i > 0; --i) {
      const std::int32_t start = cursor + in.ConsumeIntegralInRange(0, kMaxRangeGap);
      const std::int32_t end = start + in.ConsumeIntegralInRange(1, kMaxRangeLen);
      if (end > seq) break;
      p.ranges.insert(p.ranges.end(), {start, end});
      cursor = end;
    }
    p.range_start_loc.push_back(static_cast<std::int32_t>(p.ranges.size() / 2));
  }
}

// A well-formed step: requests of a few tokens with block ids the fuzzer
// picks inside the cache, or (shared) kCascadeMinRequests short decodes
// behind one kCascadeMinPrefixTokens-token prefix, the shape cascade plans.
PlanArgs make_valid_plan(FuzzedDataProvider& in, const Setup& s, bool shared) {
  const int bs = s.block_size();
  PlanArgs p;
  p.query_start_loc = {0};
  const int n = shared ? kCascadeMinRequests : in.ConsumeIntegralInRange(1, kMaxRequests);
  const auto prefix_blocks = static_cast<int>(ceil_div(kCascadeMinPrefixTokens, bs));
  for (int r = 0; r < n; ++r) {
    const int q = in.ConsumeIntegralInRange(shared ? 1 : 0, shared ? kMaxSharedQueryLen : kMaxQueryLen);
    const int context = shared ? prefix_blocks * bs + in.ConsumeIntegralInRange(0, bs - 1)
                               : in.ConsumeIntegralInRange(0, kMaxContextLen);
    p.query_start_loc.push_back(p.query_start_loc.back() + q);
    p.seq_lens.push_back(context + q);
  }
  std::int64_t longest = 0;
  for (const std::int32_t seq : p.seq_lens) longest = std::max(longest, ceil_div(seq, bs));
  p.stride = longest + in.ConsumeIntegralInRange(0, kMaxSpareBlocks);
  Rng rng(s.seed + p.query_start_loc.back());
  std::vector<std::int32_t> prefix(static_cast<std::size_t>(prefix_blocks));
  for (std::int32_t& id : prefix)
    id = static_cast<std::int32_t>(rng.below(static_cast<std::size_t>(s.num_blocks)));
  for (int r = 0; r < n; ++r) {
    const std::int64_t used = ceil_div(p.seq_lens[static_cast<std::size_t>(r)], bs);
    for (std::int64_t c = 0; c < p.stride; ++c) {
      std::int32_t id = 0;
      if (c >= used) {  // never read: anything
        id = in.ConsumeBool() ? kNullBlockId : in.PickValueInArray(kExtremeValues);
      } else if (shared) {
        id = c < prefix_blocks ? prefix[static_cast<std::size_t>(c)]
                               : static_cast<std::int32_t>(rng.below(static_cast<std::size_t>(s.num_blocks)));
      } else {
        id = in.ConsumeIntegralInRange(0, s.num_blocks - 1);
      }
      p.block_table.push_back(id);
    }
  }
  if (s.options.use_mm_prefix && in.ConsumeBool()) add_ranges(in, p);
  return p;
}

enum class PlanFault {
  Value,      // an offset, length or range value
  Resize,     // one entry more or fewer in one array
  BlockId,    // just past the cache, or extreme
  Stride,     // one off, or extreme
  NewRanges,  // none or one range, on a wrapper with or without use_mm_prefix
  kMaxValue = NewRanges,
};

void corrupt_plan(FuzzedDataProvider& in, const Setup& s, PlanArgs& p) {
  std::vector<std::int32_t>* const arrays[] = {&p.query_start_loc, &p.seq_lens, &p.range_start_loc, &p.ranges,
                                               &p.block_table};
  std::vector<std::int32_t>& array = *in.PickValueInArray(arrays);
  switch (in.ConsumeEnum<PlanFault>()) {
    case PlanFault::Value:
      if (!array.empty()) array[in.ConsumeIntegralInRange<std::size_t>(0, array.size() - 1)] = pick_value(in);
      break;
    case PlanFault::Resize:
      if (in.ConsumeBool() || array.empty()) {
        array.push_back(pick_value(in));
      } else {
        array.pop_back();
      }
      break;
    case PlanFault::BlockId:
      if (!p.block_table.empty()) {
        p.block_table[in.ConsumeIntegralInRange<std::size_t>(0, p.block_table.size() - 1)] =
            in.ConsumeBool() ? s.num_blocks + in.ConsumeIntegralInRange(-1, 1)
                             : in.PickValueInArray(kExtremeValues);
      }
      break;
    case PlanFault::Stride:
      if (in.ConsumeBool()) {  // saturating at the extreme strides
        p.stride = std::clamp(p.stride, kMinStride + 1, kMaxStride - 1) + in.ConsumeIntegralInRange(-1, 1);
      } else {
        p.stride = in.PickValueInArray(kExtremeStrides);
      }
      break;
    case PlanFault::NewRanges:
      p.range_start_loc.assign(p.seq_lens.size() + 1, 0);
      p.ranges.clear();
      if (in.ConsumeBool()) {  // [0, 1) for the first request
        p.ranges = {0, 1};
        std::fill(p.range_start_loc.begin() + 1, p.range_start_loc.end(), 1);
      }
      break;
  }
}

// The plan contract (batch_attention.h, the PrefixLM range rules of
// metadata.h, the fixed capacities), in int64: true when plan() must accept.
bool plan_valid(const PlanArgs& p, const BatchAttentionOptions& o) {
  const std::int64_t n = std::ssize(p.query_start_loc) - 1;
  if (n < 1 || std::ssize(p.seq_lens) != n || p.stride < 0 || p.stride > kInt32Max) return false;
  if (std::ssize(p.block_table) != n * p.stride || p.query_start_loc[0] != 0) return false;
  for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
    const std::int64_t q = static_cast<std::int64_t>(p.query_start_loc[r + 1]) - p.query_start_loc[r];
    if (q < 0 || p.seq_lens[r] < q || ceil_div(p.seq_lens[r], o.block_size) > p.stride) return false;
  }
  const std::int64_t tokens = p.query_start_loc.back();
  if (!p.range_start_loc.empty() || !p.ranges.empty()) {
    if (!o.use_mm_prefix || std::ssize(p.range_start_loc) != n + 1 || p.ranges.size() % 2 != 0) return false;
    const std::int64_t num_ranges = std::ssize(p.ranges) / 2;
    if (p.range_start_loc[0] != 0 || p.range_start_loc.back() != num_ranges) return false;
    for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
      if (p.range_start_loc[r + 1] < p.range_start_loc[r]) return false;
    }
    for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
      std::int32_t previous_end = 0;
      for (auto i = static_cast<std::size_t>(p.range_start_loc[r]);
           i < static_cast<std::size_t>(p.range_start_loc[r + 1]); ++i) {
        const std::int32_t start = p.ranges[2 * i];
        const std::int32_t end = p.ranges[2 * i + 1];
        if (start < previous_end || start >= end || end > p.seq_lens[r]) return false;
        previous_end = end;
      }
    }
  }
  if (o.max_num_reqs > 0) {
    if (n > o.max_num_reqs || tokens > o.max_num_tokens ||
        n * p.stride > static_cast<std::int64_t>(o.max_num_reqs) * o.max_blocks_per_req) {
      return false;
    }
  }
  return true;
}

// Whether every block id a valid plan's step reads is inside the cache: each
// request's first ceil(seq_len / block_size) entries; with chunked local
// attention, the entries of the chunks its queries fall in (what
// make_local_attention_virtual_batches keeps).
bool reads_inside_cache(const PlanArgs& p, const Setup& s) {
  const int bs = s.block_size();
  const auto inside = [&](std::size_t r, std::int64_t begin, std::int64_t end) {
    for (std::int64_t c = begin; c < end; ++c) {
      const std::int32_t id =
          p.block_table[r * static_cast<std::size_t>(p.stride) + static_cast<std::size_t>(c)];
      if (id < 0 || id >= s.num_blocks) return false;
    }
    return true;
  };
  for (std::size_t r = 0; r < p.seq_lens.size(); ++r) {
    const std::int64_t seq = p.seq_lens[r];
    const std::int64_t q = p.query_start_loc[r + 1] - p.query_start_loc[r];
    if (!s.options.attention_chunk_size) {
      if (!inside(r, 0, ceil_div(seq, bs))) return false;
      continue;
    }
    const std::int64_t chunk = *s.options.attention_chunk_size;
    for (std::int64_t c = (seq - q) / chunk; q > 0 && c <= (seq - 1) / chunk; ++c) {
      const std::int64_t keys = std::min(seq, (c + 1) * chunk) - c * chunk;
      if (!inside(r, c * chunk / bs, c * chunk / bs + ceil_div(keys, bs))) return false;
    }
  }
  return true;
}

// -------------------------------------------------------------------- run ---

struct RunInputs {
  Tensor query;  // [rows, H, D], rows >= the plan's tokens
  Tensor key;    // [rows, Hkv, D], or undefined: the step's keys are already cached
  Tensor value;
  bool with_lse = true;
  int tokens = 0;  // the plan's
};

struct RunResult {
  std::optional<std::string> error;  // set: run() threw
  Tensor output;                     // [rows, H, D]
  Tensor lse;                        // [H, rows] or undefined
};

RunInputs make_run_inputs(FuzzedDataProvider& in, const Setup& s, int tokens) {
  RunInputs x;
  x.tokens = tokens;
  const std::int64_t rows = tokens + in.ConsumeIntegralInRange(0, kMaxPaddingRows);
  const bool with_kv = in.ConsumeIntegralInRange(0, 2) != 2;
  x.with_lse = in.ConsumeIntegralInRange(0, 3) != 3;
  const std::int64_t h = s.options.num_heads;
  const std::int64_t hkv = s.kv_heads();
  const std::int64_t d = s.options.head_size;
  Rng rng(s.seed ^ static_cast<std::uint64_t>(rows * h + tokens));
  x.query = Tensor::from_floats(random_values(rng, static_cast<std::size_t>(rows * h * d)), {rows, h, d},
                                DType::F32);
  if (with_kv) {
    const auto n = static_cast<std::size_t>(rows * hkv * d);
    x.key = Tensor::from_floats(random_values(rng, n), {rows, hkv, d}, DType::F32);
    x.value = Tensor::from_floats(random_values(rng, n), {rows, hkv, d}, DType::F32);
  }
  return x;
}

// The InvalidArgument a call threw, checked (from `where` when given);
// nullopt if it returned.
template <typename Call>
std::optional<std::string> invalid_argument_of(Call&& call, std::string_view where = {}) {
  try {
    call();
  } catch (const Error& e) {
    if (where.empty()) {
      require_error(e, ErrorKind::InvalidArgument);
    } else {
      require_error(e, ErrorKind::InvalidArgument, where);
    }
    return e.what();
  }
  return std::nullopt;
}

RunResult run_once(BatchAttention& attn, const RunInputs& x, const Cache& cache) {
  const std::int64_t rows = x.query.size(0);
  const std::int64_t h = x.query.size(1);
  const std::vector<float> unwritten_out(static_cast<std::size_t>(x.query.numel()), kUnwritten);
  RunResult r;
  r.output = Tensor::from_floats(unwritten_out, x.query.shape(), DType::F32);
  if (x.with_lse) {
    r.lse = Tensor::from_floats(std::vector<float>(static_cast<std::size_t>(h * rows), kUnwritten), {h, rows},
                                DType::F32);
  }
  r.error = invalid_argument_of([&] { attn.run(x.query, x.key, x.value, cache.view(), r.output, r.lse); });
  return r;
}

// `before` with the step's key and value rows written at their slots, in
// token order (a later token wins a slot two tokens share).
CacheContents with_step_written(const Setup& s, CacheContents before, const RunInputs& x,
                                const std::vector<std::int64_t>& slots) {
  if (!x.key.defined()) return before;
  const std::int64_t hkv = s.kv_heads();
  const auto d = static_cast<std::size_t>(s.options.head_size);
  const auto* keys = static_cast<const float*>(x.key.data());
  const auto* values = static_cast<const float*>(x.value.data());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    for (std::int64_t h = 0; h < hkv; ++h) {
      const std::size_t from = (i * static_cast<std::size_t>(hkv) + static_cast<std::size_t>(h)) * d;
      const std::size_t to = storage_offset(s, slots[i], h);
      std::copy_n(keys + from, d, before.key.begin() + static_cast<std::ptrdiff_t>(to));
      std::copy_n(values + from, d, before.value.begin() + static_cast<std::ptrdiff_t>(to));
    }
  }
  return before;
}

// The step as the dense oracle takes it: each request's query rows and the
// keys and values of its positions gathered from `cache` through the block
// table, so that no wrapper, metadata or paging code is involved. An id
// outside the cache (only in a chunk no query reads) gives zero rows.
OracleOutput dense_oracle(const Setup& s, const PlanArgs& p, const RunInputs& x, const CacheContents& cache) {
  const BatchAttentionOptions& o = s.options;
  // The default scale in float, as the wrapper computes it.
  OracleProblem pb{.num_heads = o.num_heads,
                   .num_kv_heads = s.kv_heads(),
                   .head_size = o.head_size,
                   .scale = o.scale.value_or(1.0f / std::sqrt(static_cast<float>(o.head_size))),
                   .causal = o.causal,
                   .sliding_window = o.sliding_window,
                   .attention_chunk_size = o.attention_chunk_size,
                   .soft_cap = o.logits_soft_cap,
                   .alibi_slopes = o.alibi_slopes,
                   .sinks = o.sinks};
  const auto d = static_cast<std::size_t>(o.head_size);
  const auto q_row = static_cast<std::size_t>(o.num_heads) * d;
  const auto* query = static_cast<const float*>(x.query.data());
  const int bs = s.block_size();
  for (std::size_t r = 0; r < p.seq_lens.size(); ++r) {
    OracleRequest rq;
    rq.query_len = p.query_start_loc[r + 1] - p.query_start_loc[r];
    rq.kv_len = p.seq_lens[r];
    rq.query.assign(query + static_cast<std::size_t>(p.query_start_loc[r]) * q_row,
                    query + static_cast<std::size_t>(p.query_start_loc[r + 1]) * q_row);
    for (std::int64_t pos = 0; pos < rq.kv_len; ++pos) {
      const std::int32_t id =
          p.block_table[r * static_cast<std::size_t>(p.stride) + static_cast<std::size_t>(pos / bs)];
      for (std::int64_t h = 0; h < pb.num_kv_heads; ++h) {
        const bool inside = id >= 0 && id < s.num_blocks;
        const std::size_t at =
            inside ? storage_offset(s, static_cast<std::int64_t>(id) * bs + pos % bs, h) : 0;
        for (const auto& [to, from] : {std::pair{&rq.key, &cache.key}, std::pair{&rq.value, &cache.value}}) {
          for (std::size_t i = 0; i < d; ++i) to->push_back(inside ? (*from)[at + i] : 0.0f);
        }
      }
    }
    if (!p.range_start_loc.empty()) {
      for (auto i = static_cast<std::size_t>(p.range_start_loc[r]);
           i < static_cast<std::size_t>(p.range_start_loc[r + 1]); ++i) {
        rq.mm_prefix_ranges.push_back({p.ranges[2 * i], p.ranges[2 * i + 1]});
      }
    }
    pb.requests.push_back(std::move(rq));
  }
  return dense_attention(pb);
}

std::vector<std::int64_t> planned_slots(const BatchAttention& attn) {
  const Tensor& t = attn.slot_mapping();
  return {t.data_as<std::int64_t>(), t.data_as<std::int64_t>() + t.numel()};
}

bool all_unwritten(const TensorView& t) {
  const std::vector<float> v = to_float_vector(t);
  return std::all_of(v.begin(), v.end(), [](float x) { return x == kUnwritten; });
}

// ------------------------------------------------------------------ steps ---

// The last plan both instances accepted: its slots and the run made right
// after it, with CPU_ATTN's result.
struct LastPlan {
  std::vector<std::int64_t> slots;
  RunInputs inputs;
  RunResult result;
};

struct Session {
  const Setup& setup;
  BatchAttention& cpu;
  BatchAttention& ref;
  Cache cpu_cache;
  Cache ref_cache;
  std::optional<LastPlan> last;
  std::string trace;  // options and steps so far, for messages

  void rejected_plan_changed_nothing() {
    if (!last) {
      const std::int64_t h = setup.options.num_heads;
      const Tensor q = Tensor::zeros({1, h, setup.options.head_size}, DType::F32);
      const auto error = invalid_argument_of([&] { cpu.run(q, {}, {}, cpu_cache.view(), q); });
      require(error.has_value(), "run() after only rejected plans returned\n{}", trace);
      require(invalid_argument_of([&] { planned_slots(cpu); }).has_value(),
              "slot_mapping() after only rejected plans returned\n{}", trace);
      return;
    }
    require(planned_slots(cpu) == last->slots, "a rejected plan changed slot_mapping()\n{}", trace);
    const RunResult again = run_once(cpu, last->inputs, cpu_cache);
    require(again.error.has_value() == last->result.error.has_value(),
            "a rejected plan changed the last plan's run verdict: '{}' then '{}'\n{}",
            last->result.error.value_or("ran"), again.error.value_or("ran"), trace);
    if (again.error) return;
    require(to_float_vector(again.output) == to_float_vector(last->result.output) &&
                (!again.lse.defined() || to_float_vector(again.lse) == to_float_vector(last->result.lse)),
            "a rejected plan changed the last plan's output bits\n{}", trace);
  }

  void run_step(const PlanArgs& plan, std::vector<std::int64_t> slots, RunInputs inputs) {
    const CacheContents before = cpu_cache.contents();
    RunResult got = run_once(cpu, inputs, cpu_cache);
    const RunResult want = run_once(ref, inputs, ref_cache);
    const bool inside = reads_inside_cache(plan, setup);
    require(!got.error == inside && !want.error == inside,
            "run verdicts CPU_ATTN '{}', REFERENCE '{}', expected {} (block ids read {} the cache)\n{}",
            got.error.value_or("ran"), want.error.value_or("ran"), inside ? "a run" : "a rejection",
            inside ? "inside" : "outside", trace);
    const CacheContents after = cpu_cache.contents();
    if (got.error) {
      require(after == before && ref_cache.contents() == before && all_unwritten(got.output) &&
                  (!got.lse.defined() || all_unwritten(got.lse)),
              "a rejected run wrote the cache or the output\n{}", trace);
      last = LastPlan{std::move(slots), std::move(inputs), std::move(got)};
      return;
    }
    require(after == with_step_written(setup, before, inputs, slots),
            "CPU_ATTN's cache is not the cache before with the step's rows at its slots\n{}", trace);
    require(ref_cache.contents() == after, "CPU_ATTN and REFERENCE wrote different caches\n{}", trace);
    const std::int64_t t = inputs.tokens;
    const std::int64_t rows = inputs.query.size(0);
    require(all_unwritten(got.output.slice(0, t, rows)) &&
                (!got.lse.defined() || all_unwritten(got.lse.slice(1, t, rows))),
            "run() wrote padding rows [{}, {})\n{}", t, rows, trace);
    const std::vector<float> want_out = to_float_vector(want.output.slice(0, 0, t));
    const std::vector<float> want_lse =
        want.lse.defined() ? to_float_vector(want.lse.slice(1, 0, t)) : std::vector<float>{};
    const auto oracle_mismatch =
        compare_with_oracle(dense_oracle(setup, plan, inputs, after), want_out, want_lse, DType::F32);
    require(!oracle_mismatch, "REFERENCE differs from the dense oracle (cascade {}): {}\n{}",
            ref.used_cascade(), oracle_mismatch.value_or(""), trace);
    OracleOutput expected;
    expected.num_tokens = static_cast<int>(t);
    expected.num_heads = setup.options.num_heads;
    expected.head_size = setup.options.head_size;
    expected.output.assign(want_out.begin(), want_out.end());
    expected.lse.assign(want_lse.begin(), want_lse.end());
    const std::vector<float> got_lse =
        got.lse.defined() ? to_float_vector(got.lse.slice(1, 0, t)) : std::vector<float>{};
    const auto mismatch =
        compare_with_oracle(expected, to_float_vector(got.output.slice(0, 0, t)), got_lse, DType::F32);
    require(!mismatch, "CPU_ATTN differs from REFERENCE (cascade {}/{}): {}\n{}", cpu.used_cascade(),
            ref.used_cascade(), mismatch.value_or(""), trace);
    last = LastPlan{std::move(slots), std::move(inputs), std::move(got)};
  }

  void step(FuzzedDataProvider& in) {
    const BatchAttentionOptions& o = setup.options;
    const bool shared = o.cascade && in.ConsumeIntegralInRange(0, 7) == 7;
    PlanArgs plan = make_valid_plan(in, setup, shared);
    if (in.ConsumeIntegralInRange(0, 3) == 3) {
      for (int i = in.ConsumeIntegralInRange(1, kMaxMutations); i > 0; --i) corrupt_plan(in, setup, plan);
    }
    trace += fmt::format("\nplan {}", plan.describe());
    const bool valid = plan_valid(plan, o);
    const auto call = [&](BatchAttention& attn) {
      return invalid_argument_of(
          [&] {
            attn.plan(plan.query_start_loc, plan.seq_lens, plan.block_table, plan.stride,
                      plan.range_start_loc, plan.ranges);
          },
          kPlanWhere);
    };
    const auto cpu_error = call(cpu);
    const auto ref_error = call(ref);
    require(cpu_error == ref_error, "plan verdicts differ: CPU_ATTN '{}', REFERENCE '{}'\n{}",
            cpu_error.value_or("accepted"), ref_error.value_or("accepted"), trace);
    require(cpu_error.has_value() != valid, "plan {} ({}), its contract says {}\n{}",
            cpu_error ? "rejected" : "accepted", cpu_error.value_or(""), valid ? "valid" : "invalid", trace);
    if (cpu_error) {
      rejected_plan_changed_nothing();
      return;
    }
    require(cpu.num_tokens() == plan.query_start_loc.back(), "num_tokens() {} after a plan of {} tokens\n{}",
            cpu.num_tokens(), plan.query_start_loc.back(), trace);
    std::vector<std::int64_t> slots = expected_slots(plan, o.block_size);
    const std::vector<std::int64_t> planned = planned_slots(cpu);
    require(planned == slots, "slot_mapping() [{}], expected [{}]\n{}", fmt::join(planned, ","),
            fmt::join(slots, ","), trace);
    RunInputs inputs = make_run_inputs(in, setup, cpu.num_tokens());
    trace +=
        fmt::format(" run rows {} kv {} lse {}", inputs.query.size(0), inputs.key.defined(), inputs.with_lse);
    run_step(plan, std::move(slots), std::move(inputs));
  }
};

void fuzz_one(FuzzedDataProvider& in) {
  const Setup setup = make_setup(in);
  const bool valid = options_valid(setup.options);
  std::unique_ptr<BatchAttention> cpu;
  try {
    cpu = std::make_unique<BatchAttention>(setup.options);
  } catch (const Error& e) {
    require(e.kind() == ErrorKind::Unsupported ? valid : e.kind() == ErrorKind::InvalidArgument,
            "BatchAttention({}) threw a {} error: {}", setup.describe(), error_kind_name(e.kind()), e.what());
    return;
  }
  require(valid, "BatchAttention accepted options its rules reject: {}", setup.describe());
  BatchAttentionOptions ref_options = setup.options;
  ref_options.backend = "REFERENCE";
  ref_options.batch_invariant = false;  // a restriction on the backend choice, not on the result
  BatchAttention ref(ref_options);

  Session session{setup, *cpu, ref, make_cache(setup), make_cache(setup), {}, setup.describe()};
  for (int i = in.ConsumeIntegralInRange(1, kMaxSteps); i > 0; --i) session.step(in);
}

}  // namespace
}  // namespace pagedattn::fuzz

PAGEDATTN_FUZZ_CPU_ATTN_TARGET(pagedattn::fuzz::fuzz_one)
