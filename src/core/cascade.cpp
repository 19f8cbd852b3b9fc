// Cascade attention (cascade.h): the shared prefix found in the block
// tables, the step split into a prefix pass and a suffix pass, and the
// forward that runs both and merges them by LSE.
#include <pagedattn/cascade.h>

#include <pagedattn/ops.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace pagedattn {
namespace {

constexpr std::string_view kSplitWhere = "split_cascade";
constexpr std::string_view kForwardWhere = "Attention.forward";

}  // namespace

int common_prefix_blocks(const CommonAttentionMetadata& common) {
  if (common.num_reqs < 2 || common.block_size <= 0) return 0;
  int limit = std::numeric_limits<int>::max();
  for (int r = 0; r < common.num_reqs; ++r) limit = std::min(limit, common.context_len(r) / common.block_size);
  const std::span<const std::int32_t> first = common.block_table_host_row(0);
  int blocks = 0;
  for (; blocks < limit; ++blocks) {
    for (int r = 1; r < common.num_reqs; ++r) {
      if (common.block_table_host_row(r)[static_cast<std::size_t>(blocks)] != first[static_cast<std::size_t>(blocks)]) {
        return blocks;
      }
    }
  }
  return blocks;
}

bool cascade_applies(const AttentionImplParams& params) {
  return params.attn_type == AttentionType::Decoder && !params.sliding_window && params.alibi_slopes.empty() &&
         params.sinks.empty() && !params.attention_chunk_size && !params.use_mm_prefix;
}

bool cascade_pays(const CommonAttentionMetadata& common, int prefix_blocks) {
  return common.causal && !common.has_mm_prefix_ranges() && common.num_reqs >= kCascadeMinRequests &&
         static_cast<std::int64_t>(prefix_blocks) * common.block_size >= kCascadeMinPrefixTokens;
}

void check_cascade_step(std::string_view where, const CommonAttentionMetadata& common, int prefix_blocks) {
  common.validate(where);
  check_arg(!common.has_mm_prefix_ranges(), where, "metadata mm_prefix_ranges",
            "none (a cascade's passes do not carry PrefixLM ranges)", "set");
  const int shared = common_prefix_blocks(common);
  check_arg(prefix_blocks >= 1 && prefix_blocks <= shared, where, "prefix_blocks",
            fmt::format("in [1, the shared prefix's {} blocks]", shared), prefix_blocks);
}

void check_cascade_layer(std::string_view where, const AttentionImplParams& params) {
  check_arg(cascade_applies(params), where, "metadata",
            "a plain plan (a cascade needs no window, ALiBi, sinks, chunking or PrefixLM)", "a cascade plan");
}

CascadeSplit split_cascade(const CommonAttentionMetadata& common, int prefix_blocks, int max_queries) {
  check_cascade_step(kSplitWhere, common, prefix_blocks);
  const int prefix_len = prefix_blocks * common.block_size;
  const int tokens = common.num_actual_tokens;
  check_arg(max_queries >= 0, kSplitWhere, "max_queries", ">= 0", max_queries);
  const int per_request = max_queries > 0 ? std::min(max_queries, prefix_len) : prefix_len;

  CascadeSplit split{common, common};
  // Prefix: every query over the prefix, non-causal (each of them follows
  // every prefix key), in requests of at most prefix_len queries.
  const std::span<const std::int32_t> first = common.block_table_host_row(0);
  const std::vector<std::int32_t> prefix_row(first.begin(), first.begin() + prefix_blocks);
  std::vector<std::int32_t> query_start_loc{0};
  std::vector<std::int32_t> seq_lens;
  std::vector<std::int32_t> table;
  do {
    query_start_loc.push_back(std::min(tokens, query_start_loc.back() + per_request));
    seq_lens.push_back(prefix_len);
    table.insert(table.end(), prefix_row.begin(), prefix_row.end());
  } while (query_start_loc.back() < tokens);
  set_requests(split.prefix, query_start_loc, seq_lens, table, prefix_blocks);
  split.prefix.causal = false;
  split.prefix.max_query_len = std::min(tokens, per_request);
  split.prefix.max_seq_len = prefix_len;

  // Suffix: each request over its keys after the prefix.
  const std::int64_t stride = common.block_table_cpu.size(1) - prefix_blocks;
  query_start_loc.assign(common.query_start_loc_host().begin(), common.query_start_loc_host().end());
  seq_lens.clear();
  table.clear();
  int longest = 0;
  for (int r = 0; r < common.num_reqs; ++r) {
    seq_lens.push_back(common.seq_len(r) - prefix_len);
    longest = std::max(longest, seq_lens.back());
    const std::span<const std::int32_t> row = common.block_table_host_row(r);
    table.insert(table.end(), row.begin() + prefix_blocks, row.end());
  }
  set_requests(split.suffix, query_start_loc, seq_lens, table, stride);
  split.suffix.max_seq_len = longest;
  return split;
}

CascadeBuilder::CascadeBuilder(const AttentionBackend& backend, BuilderParams params, DType dtype, bool allow,
                               CascadeMode mode)
    : backend_(backend), params_(std::move(params)), dtype_(dtype), allow_(allow), mode_(mode) {
  plain_ = backend_.make_builder(params_);
  check_arg(plain_ != nullptr, "CascadeBuilder", fmt::format("backend {} builder", backend_.name()), "a builder",
            "null");
  check_arg(!allow_ || params_.num_heads > 0, "CascadeBuilder", "num_heads", "> 0 (sizes the cascade's buffers)",
            params_.num_heads);
}

std::shared_ptr<const BackendMetadata> CascadeBuilder::build(const CommonAttentionMetadata& common) {
  last_used_cascade_ = false;
  const int blocks = allow_ && backend_.supports_cascade() ? common_prefix_blocks(common) : 0;
  if (blocks == 0 || !cascade_pays(common, blocks)) return plain_->build(common);
  if (mode_ == CascadeMode::Native) {
    if (std::shared_ptr<const BackendMetadata> native = plain_->build_cascade(common, blocks)) {
      last_used_cascade_ = true;
      return native;
    }
  }
  auto md = std::make_shared<CascadeMetadata>();
  adopt_step("CascadeBuilder::build", common, *md);
  const CascadeSplit split = split_cascade(md->common, blocks, backend_.cascade_prefix_queries());
  if (!prefix_) prefix_ = backend_.make_builder(params_);
  if (!suffix_) suffix_ = backend_.make_builder(params_);
  md->prefix = prefix_->build(split.prefix);
  md->suffix = suffix_->build(split.suffix);
  const std::int64_t rows = std::max(common.num_actual_tokens, 1);
  const std::int64_t heads = params_.num_heads;
  const std::int64_t out_elems = rows * heads * params_.head_size;
  if (rows > capacity_) {
    capacity_ = std::max(rows, 2 * capacity_);
    out_storage_ = Tensor::empty({2 * capacity_ * heads * params_.head_size}, dtype_, params_.device);
    lse_storage_ = Tensor::empty({2 * heads * capacity_}, DType::F32, params_.device);
  }
  // Contiguous views of the storage's first elements, one pair per part.
  const auto part = [](const Tensor& storage, std::int64_t index, std::int64_t elems, Dims shape) {
    return storage.slice(0, index * elems, (index + 1) * elems).view(shape);
  };
  md->prefix_out = part(out_storage_, 0, out_elems, {rows, heads, params_.head_size});
  md->suffix_out = part(out_storage_, 1, out_elems, {rows, heads, params_.head_size});
  md->prefix_lse = part(lse_storage_, 0, heads * rows, {heads, rows});
  md->suffix_lse = part(lse_storage_, 1, heads * rows, {heads, rows});
  md->prefix_len = blocks * common.block_size;
  last_used_cascade_ = true;
  return md;
}

namespace {

// The buffers' views for a layer of `heads` query heads.
struct Parts {
  TensorView prefix_out, suffix_out, prefix_lse, suffix_lse;
};
Parts parts_for(const CascadeMetadata& md, std::int64_t heads) {
  check_arg(heads <= md.prefix_out.size(1), kForwardWhere, "num_heads",
            fmt::format("<= the cascade plan's {} (its builder's num_heads)", md.prefix_out.size(1)), heads);
  return {md.prefix_out.slice(1, 0, heads), md.suffix_out.slice(1, 0, heads), md.prefix_lse.slice(0, 0, heads),
          md.suffix_lse.slice(0, 0, heads)};
}

}  // namespace

void check_planned_forward(const AttentionImpl& impl, const LayerQuantState& layer, const TensorView& query,
                           const TensorView& key, const TensorView& value, const KVCacheView& kv_cache,
                           const BackendMetadata& metadata, const TensorView& output, const TensorView& lse) {
  const auto* cascade = dynamic_cast<const CascadeMetadata*>(&metadata);
  if (cascade == nullptr) {
    impl.check_forward(layer, query, key, value, kv_cache, metadata, output, lse);
    return;
  }
  check_cascade_layer(kForwardWhere, impl.params());
  const Parts p = parts_for(*cascade, impl.params().num_heads);
  impl.check_forward(layer, query, key, value, kv_cache, *cascade->prefix, p.prefix_out, p.prefix_lse);
  impl.check_forward(layer, query, key, value, kv_cache, *cascade->suffix, p.suffix_out, p.suffix_lse);
  // The merge's own checks, on the output rows the step writes.
  check_rank(output, kForwardWhere, "output", 3);
  check_arg(output.size(0) >= cascade->common.num_actual_tokens, kForwardWhere, "output.size(0)",
            fmt::format(">= num_actual_tokens ({})", cascade->common.num_actual_tokens), output.size(0));
}

void planned_forward(AttentionImpl& impl, const LayerQuantState& layer, const TensorView& query,
                     const TensorView& key, const TensorView& value, const KVCacheView& kv_cache,
                     const BackendMetadata& metadata, const TensorView& output, const TensorView& lse) {
  const auto* cascade = dynamic_cast<const CascadeMetadata*>(&metadata);
  if (cascade == nullptr) {
    impl.forward(layer, query, key, value, kv_cache, metadata, output, lse);
    return;
  }
  check_cascade_layer(kForwardWhere, impl.params());
  const Parts p = parts_for(*cascade, impl.params().num_heads);
  impl.forward(layer, query, key, value, kv_cache, *cascade->prefix, p.prefix_out, p.prefix_lse);
  impl.forward(layer, query, key, value, kv_cache, *cascade->suffix, p.suffix_out, p.suffix_lse);
  const std::int64_t tokens = cascade->common.num_actual_tokens;
  if (tokens == 0) return;
  merge_attn_states(output.slice(0, 0, tokens), p.prefix_out.slice(0, 0, tokens), p.prefix_lse.slice(1, 0, tokens),
                    p.suffix_out.slice(0, 0, tokens), p.suffix_lse.slice(1, 0, tokens),
                    lse.defined() ? lse.slice(1, 0, tokens) : TensorView{});
}

}  // namespace pagedattn
