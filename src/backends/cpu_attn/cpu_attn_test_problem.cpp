#include "backends/cpu_attn/cpu_attn_test_problem.h"

#include <pagedattn/error.h>
#include <pagedattn/metadata.h>
#include <pagedattn/backend/registry.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace pagedattn::cpu_attn_test {

// The impl arguments of a bf16 decoder layer with a `cache` KV cache.
AttentionImplParams bf16_layer(int heads, int kv_heads, int head_size, CacheDType cache) {
  AttentionImplParams params;
  params.num_heads = heads;
  params.num_kv_heads = kv_heads;
  params.head_size = head_size;
  params.scale = 0.125f;
  params.dtype = DType::BF16;
  params.kv_cache_dtype = cache;
  return params;
}

BuilderParams builder_params(int block_size, int kv_heads, int head_size, int heads) {
  BuilderParams bp;
  bp.block_size = block_size;
  bp.num_kv_heads = kv_heads;
  bp.head_size = head_size;
  bp.num_heads = heads;
  return bp;
}

namespace {

// fp8 scales: amax / 64, as the conformance harness and vLLM's test_cache
// choose them, for standard-normal values (|x| < ~5).
constexpr float kFp8Scale = 5.0f / 64.0f;
// Sinks ~ U[0, 5), as the conformance grid draws them.
constexpr float kMaxSink = 5.0f;

std::vector<std::int32_t> request_blocks(int request, int blocks_per_request) {
  // Block 0 stays unused (the null block); requests own disjoint ranges,
  // reversed so that consecutive positions never sit in adjacent blocks.
  std::vector<std::int32_t> blocks(static_cast<std::size_t>(blocks_per_request));
  for (int b = 0; b < blocks_per_request; ++b) {
    blocks[static_cast<std::size_t>(b)] = 1 + request * blocks_per_request + (blocks_per_request - 1 - b);
  }
  return blocks;
}

bool nan_pattern_equal(const std::vector<float>& a, const std::vector<float>& b, std::string& where,
                       const char* what) {
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) {
      where = fmt::format("{}[{}]: REFERENCE {}, CPU_ATTN {}", what, i, a[i], b[i]);
      return false;
    }
  }
  return true;
}

}  // namespace

std::string LayerSpec::describe() const {
  std::string s =
      fmt::format("h{}/{} d{} bs{} {} kv={}{} {}", heads, kv_heads, head_size, block_size, dtype_name(dtype),
                  cache_dtype_name(cache), per_head_scales ? "/head" : "", kv_cache_layout_name(layout));
  if (!causal) s += " noncausal";
  if (window) s += fmt::format(" win={}", *window);
  if (soft_cap) s += fmt::format(" cap={}", *soft_cap);
  if (scale) s += fmt::format(" scale={}", *scale);
  if (alibi) s += " alibi";
  if (sinks) s += " sinks";
  return s;
}

PagedProblem::PagedProblem(const LayerSpec& spec, std::vector<std::pair<int, int>> requests,
                           std::uint32_t seed)
    : spec_(spec), requests_(std::move(requests)) {
  int longest = 0;
  for (const auto& [q, s] : requests_) {
    first_position_.push_back(num_positions_);
    num_tokens_ += q;
    num_positions_ += s;
    longest = std::max(longest, s);
  }
  blocks_per_request_ = std::max(1, (longest + spec.block_size - 1) / spec.block_size);

  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const auto random = [&](std::size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  const auto d = static_cast<std::size_t>(spec.head_size);
  query_ = random(static_cast<std::size_t>(num_tokens_) * spec.heads * d);
  key_ = random(static_cast<std::size_t>(num_positions_) * spec.kv_heads * d);
  value_ = random(key_.size());
  const std::size_t scales = spec.per_head_scales ? static_cast<std::size_t>(spec.kv_heads) : 1;
  std::uniform_real_distribution<float> scale_jitter(0.75f, 1.25f);
  for (std::size_t i = 0; i < scales; ++i) {
    k_scale_.push_back(kFp8Scale * scale_jitter(rng));
    v_scale_.push_back(kFp8Scale * scale_jitter(rng));
  }

  params_.num_heads = spec.heads;
  params_.num_kv_heads = spec.kv_heads;
  params_.head_size = spec.head_size;
  params_.scale = spec.scale.value_or(1.0f / std::sqrt(static_cast<float>(spec.head_size)));
  params_.dtype = spec.dtype;
  params_.kv_cache_dtype = spec.cache;
  params_.sliding_window = spec.window;
  params_.logits_soft_cap = spec.soft_cap;
  if (spec.alibi) params_.alibi_slopes = alibi_slopes(spec.heads);
  if (spec.sinks) {
    std::uniform_real_distribution<float> sink(0.0f, kMaxSink);
    for (int h = 0; h < spec.heads; ++h) params_.sinks.push_back(sink(rng));
  }
}

std::string PagedProblem::describe() const {
  std::string s = spec_.describe() + " requests";
  for (const auto& [q, k] : requests_) s += fmt::format(" ({},{})", q, k);
  return s;
}

float& PagedProblem::query(int token, int head, int dim) {
  return query_[(static_cast<std::size_t>(token) * spec_.heads + head) * spec_.head_size + dim];
}

std::size_t PagedProblem::kv_row(int r, int pos, int kv_head) const {
  return (static_cast<std::size_t>(first_position_[static_cast<std::size_t>(r)] + pos) * spec_.kv_heads +
          kv_head) *
         spec_.head_size;
}

float& PagedProblem::key(int r, int pos, int kv_head, int dim) { return key_[kv_row(r, pos, kv_head) + dim]; }

ForwardResult PagedProblem::run(const AttentionBackend& backend) const {
  const int d = spec_.head_size;
  std::vector<RequestSpec> specs;
  std::vector<std::int64_t> slots;
  for (std::size_t r = 0; r < requests_.size(); ++r) {
    RequestSpec rs{requests_[r].first, requests_[r].second,
                   request_blocks(static_cast<int>(r), blocks_per_request_)};
    const std::vector<std::int64_t> own = slots_for_positions(rs.blocks, spec_.block_size, 0, rs.seq_len);
    slots.insert(slots.end(), own.begin(), own.end());
    specs.push_back(std::move(rs));
  }
  MetadataOptions options;
  options.block_size = spec_.block_size;
  options.causal = spec_.causal;
  const CommonAttentionMetadata common = make_common_metadata(specs, options);

  const std::int64_t num_blocks = 1 + static_cast<std::int64_t>(requests_.size()) * blocks_per_request_;
  const std::vector<int> order = backend.kv_cache_stride_order(spec_.layout);
  const Tensor storage = Tensor::empty_strided_order(
      backend.kv_cache_shape(num_blocks, spec_.block_size, spec_.kv_heads, d, spec_.cache), order,
      kv_cache_storage_dtype(spec_.cache, spec_.dtype), Device::cpu());
  fill_tensor_bits(storage, 0);
  const KVCacheView cache = backend.unbind_kv_cache(storage);

  LayerQuantState layer;
  if (is_quantized_kv_cache(spec_.cache)) {
    layer.k_scale = Tensor::from_floats(k_scale_, {std::ssize(k_scale_)}, DType::F32);
    layer.v_scale = Tensor::from_floats(v_scale_, {std::ssize(v_scale_)}, DType::F32);
    layer.k_scale_float = k_scale_[0];
    layer.v_scale_float = v_scale_[0];
  }
  const auto impl = backend.make_impl(params_);
  const Dims kv_shape{num_positions_, spec_.kv_heads, d};
  impl->do_kv_cache_update(layer, Tensor::from_floats(key_, kv_shape, spec_.dtype),
                           Tensor::from_floats(value_, kv_shape, spec_.dtype), cache,
                           Tensor::from_i64(slots, {std::ssize(slots)}));

  const auto md = backend.make_builder(builder_params(spec_.block_size, spec_.kv_heads, d, spec_.heads))->build(common);
  const Tensor query = Tensor::from_floats(query_, {num_tokens_, spec_.heads, d}, spec_.dtype);
  const Tensor out = Tensor::zeros({num_tokens_, spec_.heads, d}, spec_.dtype);
  const Tensor lse = Tensor::zeros({spec_.heads, num_tokens_}, DType::F32);
  impl->forward(layer, query, {}, {}, cache, *md, out, lse);
  return {to_float_vector(out), to_float_vector(lse)};
}

std::optional<std::string> compare_with_reference(const ForwardResult& want, const ForwardResult& got,
                                                  const PagedProblem& problem) {
  std::string where;
  if (!nan_pattern_equal(want.output, got.output, where, "output") ||
      !nan_pattern_equal(want.lse, got.lse, where, "lse")) {
    return "NaN pattern differs at " + where;
  }
  // NaN where both are NaN compares as 0.
  const auto finite_part = [](const std::vector<float>& x) {
    std::vector<float> y(x);
    for (float& v : y) v = std::isnan(v) ? 0.0f : v;
    return y;
  };
  OracleOutput expected;
  expected.num_tokens = problem.num_tokens();
  expected.num_heads = problem.spec().heads;
  expected.head_size = problem.spec().head_size;
  const std::vector<float> want_output = finite_part(want.output);
  const std::vector<float> want_lse = finite_part(want.lse);
  expected.output.assign(want_output.begin(), want_output.end());
  expected.lse.assign(want_lse.begin(), want_lse.end());
  return compare_with_oracle(expected, finite_part(got.output), finite_part(got.lse), problem.spec().dtype);
}

const AttentionBackend& reference_backend() {
  const AttentionBackend* backend = BackendRegistry::instance().find("REFERENCE");
  if (backend == nullptr) throw_invalid("cpu_attn_test", "backend", "REFERENCE registered", "absent");
  return *backend;
}

}  // namespace pagedattn::cpu_attn_test
