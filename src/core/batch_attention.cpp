#include <pagedattn/batch_attention.h>

#include <pagedattn/backend/impl_checks.h>
#include <pagedattn/selector.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/mm_prefix.h"

namespace pagedattn {
namespace {

constexpr std::string_view kWhere = "BatchAttention";
constexpr std::string_view kPlanWhere = "BatchAttention::plan";
constexpr std::string_view kRunWhere = "BatchAttention::run";
constexpr float kUnitScale = 1.0f;

void check_options(const BatchAttentionOptions& o) {
  check_arg(o.num_heads > 0, kWhere, "num_heads", "> 0", o.num_heads);
  check_arg(o.head_size > 0, kWhere, "head_size", "> 0", o.head_size);
  check_arg(o.num_kv_heads > 0 && o.num_heads % o.num_kv_heads == 0, kWhere, "num_kv_heads",
            fmt::format("> 0 and dividing num_heads ({})", o.num_heads), o.num_kv_heads);
  check_arg(o.block_size > 0, kWhere, "block_size", "> 0", o.block_size);
  check_arg(o.dtype == DType::F32 || o.dtype == DType::F16 || o.dtype == DType::BF16, kWhere, "dtype",
            "f32, f16 or bf16", o.dtype);
  if (o.scale) check_arg(std::isfinite(*o.scale), kWhere, "scale", "finite", *o.scale);
  if (o.sliding_window) check_arg(*o.sliding_window > 0, kWhere, "sliding_window", "> 0", *o.sliding_window);
  if (o.logits_soft_cap) {
    check_arg(std::isfinite(*o.logits_soft_cap) && *o.logits_soft_cap > 0, kWhere, "logits_soft_cap",
              "finite and > 0", *o.logits_soft_cap);
  }
  const auto check_per_head = [&](const std::vector<float>& values, std::string_view name) {
    check_arg(values.empty() || values.size() == static_cast<std::size_t>(o.num_heads), kWhere,
              fmt::format("{} size", name), fmt::format("0 or num_heads ({})", o.num_heads), values.size());
  };
  if (o.attention_chunk_size) {
    check_arg(*o.attention_chunk_size > 0 && *o.attention_chunk_size % o.block_size == 0, kWhere,
              "attention_chunk_size", fmt::format("a positive multiple of block_size ({})", o.block_size),
              *o.attention_chunk_size);
  }
  if (o.use_mm_prefix) {
    check_arg(o.causal, kWhere, "causal", "true with use_mm_prefix (PrefixLM widens a causal mask)", "false");
  }
  check_per_head(o.alibi_slopes, "alibi_slopes");
  check_per_head(o.sinks, "sinks");
  check_arg(o.max_num_reqs >= 0, kWhere, "max_num_reqs", ">= 0 (0: no fixed capacity)", o.max_num_reqs);
  check_arg(o.max_num_tokens >= 0, kWhere, "max_num_tokens", ">= 0 (0: no fixed capacity)", o.max_num_tokens);
  check_arg(o.max_blocks_per_req >= 0, kWhere, "max_blocks_per_req", ">= 0 (0: no fixed capacity)",
            o.max_blocks_per_req);
  const bool fixed = o.max_num_reqs > 0 || o.max_num_tokens > 0 || o.max_blocks_per_req > 0;
  if (fixed) {
    check_arg(o.max_num_reqs > 0 && o.max_num_tokens > 0 && o.max_blocks_per_req > 0, kWhere,
              "max_num_reqs, max_num_tokens and max_blocks_per_req", "all > 0 or all 0",
              fmt::format("{}, {} and {}", o.max_num_reqs, o.max_num_tokens, o.max_blocks_per_req));
  }
}

Tensor unit_scale(Device device) { return Tensor::from_floats(std::vector<float>{kUnitScale}, {1}, DType::F32, device); }

}  // namespace

// Host arrays and their device copies (the same tensors on the CPU), sized
// for `capacity`; plans view their prefixes, so addresses stay put. The
// PrefixLM arrays exist with use_mm_prefix only.
struct BatchAttention::Buffers {
  int reqs = 0;
  int tokens = 0;
  std::int64_t table = 0;
  std::int64_t range_values = 0;
  Tensor query_start_loc_cpu, seq_lens_cpu, block_table_cpu, slot_mapping_cpu;
  Tensor mm_prefix_range_start_loc_cpu, mm_prefix_ranges_cpu;
  Tensor query_start_loc, seq_lens, block_table, slot_mapping;
  Tensor mm_prefix_range_start_loc, mm_prefix_ranges;
  Tensor slot_view;  // the last plan's [num_tokens] slots on the device
};

BatchAttention::BatchAttention(BatchAttentionOptions options) : options_(std::move(options)) {
  if (options_.num_kv_heads == 0) options_.num_kv_heads = options_.num_heads;
  check_options(options_);
  SelectorConfig cfg;
  cfg.head_size = options_.head_size;
  cfg.dtype = options_.dtype;
  cfg.kv_cache_dtype = options_.kv_cache_dtype;
  cfg.block_size = options_.block_size;
  cfg.has_sink = !options_.sinks.empty();
  cfg.use_non_causal = !options_.causal;
  cfg.use_mm_prefix = options_.use_mm_prefix;
  cfg.use_batch_invariant = options_.batch_invariant;
  cfg.device = options_.device;
  cfg.capability = device_capability(options_.device);
  // An empty request would let PAGEDATTN_BACKEND choose; "auto" asks the selector.
  backend_ = &select_backend(cfg, options_.backend.empty() ? std::string_view("auto") : options_.backend);

  AttentionImplParams params;
  params.num_heads = options_.num_heads;
  params.head_size = options_.head_size;
  params.scale = options_.scale.value_or(1.0f / std::sqrt(static_cast<float>(options_.head_size)));
  params.num_kv_heads = options_.num_kv_heads;
  params.alibi_slopes = options_.alibi_slopes;
  params.sliding_window = options_.sliding_window;
  params.kv_cache_dtype = options_.kv_cache_dtype;
  params.logits_soft_cap = options_.logits_soft_cap;
  params.sinks = options_.sinks;
  params.attention_chunk_size = options_.attention_chunk_size;
  params.use_mm_prefix = options_.use_mm_prefix;
  params.dtype = options_.dtype;
  params.device = options_.device;
  AttentionProblem problem = make_attention_problem(params, options_.block_size, nullptr, false, false);
  problem.causal = options_.causal;
  require_supported(backend_->problem_support(problem), backend_->name());
  if (options_.attention_chunk_size && !backend_->supports_chunked_local_attention()) {
    throw_unsupported(kWhere, fmt::format("backend {} does not run chunked local attention", backend_->name()));
  }
  impl_ = backend_->make_impl(params);
  const bool fixed = options_.max_num_reqs > 0;
  builder_ = std::make_unique<CascadeBuilder>(
      *backend_,
      BuilderParams{options_.block_size, options_.num_kv_heads, options_.head_size, options_.device, {},
                    options_.num_heads, options_.batch_invariant},
      // A cascade plan depends on which requests share a prefix: never batch-invariant.
      options_.dtype,
      options_.cascade && !options_.batch_invariant && !fixed && cascade_applies(impl_->params()));
  unit_scales_.q_scale = unit_scale(options_.device);
  unit_scales_.k_scale = unit_scale(options_.device);
  unit_scales_.v_scale = unit_scale(options_.device);
  unit_scales_.prob_scale = unit_scale(options_.device);
  buffers_ = std::make_unique<Buffers>();
  if (options_.max_num_reqs > 0) {
    reserve(options_.max_num_reqs, options_.max_num_tokens,
            static_cast<std::int64_t>(options_.max_num_reqs) * options_.max_blocks_per_req, 0);
  }
}

BatchAttention::~BatchAttention() = default;

void BatchAttention::reserve(int num_reqs, int num_tokens, std::int64_t table_entries,
                             std::int64_t range_values) {
  Buffers& b = *buffers_;
  const bool fixed = options_.max_num_reqs > 0;
  if (fixed && b.reqs > 0) {
    check_arg(num_reqs <= b.reqs, kPlanWhere, "number of requests", fmt::format("<= max_num_reqs ({})", b.reqs),
              num_reqs);
    check_arg(num_tokens <= b.tokens, kPlanWhere, "number of tokens",
              fmt::format("<= max_num_tokens ({})", b.tokens), num_tokens);
    check_arg(table_entries <= b.table, kPlanWhere, "block_table size",
              fmt::format("<= max_num_reqs * max_blocks_per_req ({})", b.table), table_entries);
  }
  const Device dev = options_.device;
  const auto pair = [&](Tensor& host, Tensor& device, std::int64_t n, DType t) {
    host = Tensor::empty({std::max<std::int64_t>(n, 1)}, t, Device::cpu());
    device = dev.is_cpu() ? host : Tensor::empty({std::max<std::int64_t>(n, 1)}, t, dev);
  };
  if (num_reqs > b.reqs || num_tokens > b.tokens || table_entries > b.table) {
    // Grown buffers at least double, so a growing stream of steps reallocates rarely.
    const int reqs = std::max(num_reqs, fixed ? 0 : b.reqs * 2);
    const int tokens = std::max(num_tokens, fixed ? 0 : b.tokens * 2);
    const std::int64_t table = std::max(table_entries, fixed ? 0 : b.table * 2);
    pair(b.query_start_loc_cpu, b.query_start_loc, static_cast<std::int64_t>(reqs) + 1, DType::I32);
    if (options_.use_mm_prefix) {
      pair(b.mm_prefix_range_start_loc_cpu, b.mm_prefix_range_start_loc, static_cast<std::int64_t>(reqs) + 1,
           DType::I32);
    }
    pair(b.seq_lens_cpu, b.seq_lens, reqs, DType::I32);
    pair(b.block_table_cpu, b.block_table, table, DType::I32);
    pair(b.slot_mapping_cpu, b.slot_mapping, tokens, DType::I64);
    b.reqs = reqs;
    b.tokens = tokens;
    b.table = table;
  }
  // No option bounds the number of ranges, so their arrays grow under fixed
  // capacities too (backends take a plan's ranges from its host arrays).
  if (options_.use_mm_prefix && (!b.mm_prefix_ranges_cpu.defined() || range_values > b.range_values)) {
    const std::int64_t values = std::max(range_values, b.range_values * 2);
    pair(b.mm_prefix_ranges_cpu, b.mm_prefix_ranges, values, DType::I32);
    b.range_values = values;
  }
}

void BatchAttention::plan(std::span<const std::int32_t> query_start_loc,
                          std::span<const std::int32_t> seq_lens, std::span<const std::int32_t> block_table,
                          std::int64_t block_table_stride,
                          std::span<const std::int32_t> mm_prefix_range_start_loc,
                          std::span<const std::int32_t> mm_prefix_ranges) {
  check_arg(query_start_loc.size() >= 2, kPlanWhere, "query_start_loc size", ">= 2 (one request or more)",
            query_start_loc.size());
  check_arg(query_start_loc.size() - 1 <= static_cast<std::size_t>(std::numeric_limits<int>::max()), kPlanWhere,
            "number of requests", "representable as int", query_start_loc.size() - 1);
  const int num_reqs = static_cast<int>(query_start_loc.size() - 1);
  check_arg(seq_lens.size() == static_cast<std::size_t>(num_reqs), kPlanWhere, "seq_lens size",
            fmt::format("query_start_loc size - 1 ({})", num_reqs), seq_lens.size());
  check_arg(block_table_stride >= 0 && block_table_stride <= std::numeric_limits<std::int32_t>::max(), kPlanWhere,
            "block_table stride", "in [0, 2^31)", block_table_stride);
  const std::int64_t table_entries = static_cast<std::int64_t>(num_reqs) * block_table_stride;
  check_arg(static_cast<std::int64_t>(block_table.size()) == table_entries, kPlanWhere, "block_table size",
            fmt::format("number of requests * stride ({} * {} = {})", num_reqs, block_table_stride, table_entries),
            block_table.size());
  // The slots are computed here, before validate runs: the lengths they read
  // must already be consistent and the rows long enough.
  check_arg(query_start_loc[0] == 0, kPlanWhere, "query_start_loc[0]", 0, query_start_loc[0]);
  const int bs = options_.block_size;
  int max_query_len = 0;
  int max_seq_len = 0;
  for (int r = 0; r < num_reqs; ++r) {
    const std::int64_t q_len = static_cast<std::int64_t>(query_start_loc[r + 1]) - query_start_loc[r];
    check_arg(q_len >= 0, kPlanWhere, fmt::format("query_start_loc[{}]", r + 1),
              fmt::format(">= query_start_loc[{}] ({})", r, query_start_loc[r]), query_start_loc[r + 1]);
    check_arg(seq_lens[r] >= q_len, kPlanWhere, fmt::format("seq_lens[{}]", r),
              fmt::format(">= its query length ({})", q_len), seq_lens[r]);
    const std::int64_t blocks = (static_cast<std::int64_t>(seq_lens[r]) + bs - 1) / bs;
    check_arg(blocks <= block_table_stride, kPlanWhere, fmt::format("block_table row {} length", r),
              fmt::format(">= ceil(seq_lens[{}] / block_size) = {}", r, blocks), block_table_stride);
    max_query_len = std::max(max_query_len, static_cast<int>(q_len));
    max_seq_len = std::max(max_seq_len, seq_lens[r]);
  }
  const bool has_ranges = !mm_prefix_range_start_loc.empty() || !mm_prefix_ranges.empty();
  if (has_ranges) {
    check_arg(options_.use_mm_prefix, kPlanWhere, "mm_prefix_ranges",
              "none for a BatchAttention without use_mm_prefix",
              fmt::format("{} values", mm_prefix_ranges.size()));
    // The step-kind half of validate's range check holds by construction:
    // use_mm_prefix is causal, and a plan is decoder self-attention, split
    // into chunks (which refuses ranges) only after this.
    check_mm_prefix_range_values(kPlanWhere, seq_lens, mm_prefix_range_start_loc, mm_prefix_ranges);
  }
  const int num_tokens = query_start_loc[static_cast<std::size_t>(num_reqs)];
  const auto range_values = static_cast<std::int64_t>(mm_prefix_ranges.size());
  reserve(num_reqs, num_tokens, table_entries, range_values);

  // Every argument is checked: the buffers the last plan views are written
  // from here, so that plan is unusable until the build succeeds.
  planned_ = false;
  Buffers& b = *buffers_;
  std::copy(query_start_loc.begin(), query_start_loc.end(), b.query_start_loc_cpu.data_as<std::int32_t>());
  std::copy(seq_lens.begin(), seq_lens.end(), b.seq_lens_cpu.data_as<std::int32_t>());
  std::copy(block_table.begin(), block_table.end(), b.block_table_cpu.data_as<std::int32_t>());
  if (has_ranges) {
    std::copy(mm_prefix_range_start_loc.begin(), mm_prefix_range_start_loc.end(),
              b.mm_prefix_range_start_loc_cpu.data_as<std::int32_t>());
    std::copy(mm_prefix_ranges.begin(), mm_prefix_ranges.end(),
              b.mm_prefix_ranges_cpu.data_as<std::int32_t>());
  }
  auto* slots = b.slot_mapping_cpu.data_as<std::int64_t>();
  for (int r = 0; r < num_reqs; ++r) {
    const std::int32_t* row = block_table.data() + static_cast<std::int64_t>(r) * block_table_stride;
    for (int pos = seq_lens[r] - (query_start_loc[r + 1] - query_start_loc[r]); pos < seq_lens[r]; ++pos) {
      *slots++ = static_cast<std::int64_t>(row[pos / bs]) * bs + pos % bs;
    }
  }

  const auto prefix = [](const Tensor& t, std::int64_t n) { return t.slice(0, 0, n); };
  CommonAttentionMetadata common;
  common.query_start_loc_cpu = prefix(b.query_start_loc_cpu, num_reqs + 1);
  common.seq_lens_cpu = prefix(b.seq_lens_cpu, num_reqs);
  common.block_table_cpu = prefix(b.block_table_cpu, table_entries).view({num_reqs, block_table_stride});
  common.query_start_loc = prefix(b.query_start_loc, num_reqs + 1);
  common.seq_lens = prefix(b.seq_lens, num_reqs);
  common.block_table = prefix(b.block_table, table_entries).view({num_reqs, block_table_stride});
  common.slot_mapping = prefix(b.slot_mapping, num_tokens);
  if (has_ranges) {
    const Dims ranges_shape{range_values / kMmPrefixRangeWidth, kMmPrefixRangeWidth};
    common.mm_prefix_range_start_loc_cpu = prefix(b.mm_prefix_range_start_loc_cpu, num_reqs + 1);
    common.mm_prefix_ranges_cpu = prefix(b.mm_prefix_ranges_cpu, range_values).view(ranges_shape);
    common.mm_prefix_range_start_loc = prefix(b.mm_prefix_range_start_loc, num_reqs + 1);
    common.mm_prefix_ranges = prefix(b.mm_prefix_ranges, range_values).view(ranges_shape);
  }
  if (!options_.device.is_cpu()) {
    copy_tensor(common.query_start_loc, common.query_start_loc_cpu);
    copy_tensor(common.seq_lens, common.seq_lens_cpu);
    if (table_entries > 0) copy_tensor(common.block_table, common.block_table_cpu);
    if (num_tokens > 0) copy_tensor(common.slot_mapping, prefix(b.slot_mapping_cpu, num_tokens));
    if (has_ranges) {
      copy_tensor(common.mm_prefix_range_start_loc, common.mm_prefix_range_start_loc_cpu);
      copy_tensor(common.mm_prefix_ranges, common.mm_prefix_ranges_cpu);
    }
  }
  common.num_reqs = num_reqs;
  common.num_actual_tokens = num_tokens;
  common.max_query_len = max_query_len;
  common.max_seq_len = max_seq_len;
  common.causal = options_.causal;
  common.block_size = bs;
  metadata_ = options_.attention_chunk_size
                  ? builder_->build(make_local_attention_virtual_batches(common, *options_.attention_chunk_size))
                  : builder_->build(common);
  b.slot_view = common.slot_mapping;
  planned_ = true;
}

bool BatchAttention::used_cascade() const { return planned_ && builder_->last_used_cascade(); }

const Tensor& BatchAttention::slot_mapping() const {
  check_arg(planned_, "BatchAttention::slot_mapping", "plan", "called first", "no plan");
  return buffers_->slot_view;
}

void BatchAttention::run(const TensorView& query, const TensorView& key, const TensorView& value,
                         const KVCacheView& cache, const TensorView& output, const TensorView& lse,
                         const TensorView& k_scale, const TensorView& v_scale) {
  check_arg(planned_, kRunWhere, "plan", "called before run", "no plan");
  check_arg(key.defined() == value.defined(), kRunWhere, "key and value", "both given or both undefined",
            key.defined() ? "only key" : "only value");
  check_arg(k_scale.defined() == v_scale.defined(), kRunWhere, "k_scale and v_scale", "both given or both undefined",
            k_scale.defined() ? "only k_scale" : "only v_scale");
  // The unit scales unless the call brings its own (no copy per decode call).
  LayerQuantState given;
  if (k_scale.defined()) {
    given = unit_scales_;
    given.k_scale = Tensor(Tensor{}, k_scale);
    given.v_scale = Tensor(Tensor{}, v_scale);
  }
  const LayerQuantState& quant = k_scale.defined() ? given : unit_scales_;
  const BackendMetadata& md = *metadata_;
  if (key.defined()) {
    check_rank(key, kRunWhere, "key", 3);
    check_arg(key.size(0) >= md.common.num_actual_tokens, kRunWhere, "key rows",
              fmt::format(">= the plan's tokens ({})", md.common.num_actual_tokens), key.size(0));
  }
  // The impl's checks cover every argument and the cache against the plan's
  // block ids, so a rejected run writes nothing.
  check_planned_forward(*impl_, quant, query, key, value, cache, md, output, lse);
  if (key.defined()) impl_->do_kv_cache_update(quant, key, value, cache, buffers_->slot_view);
  planned_forward(*impl_, quant, query, key, value, cache, md, output, lse);
}

}  // namespace pagedattn
