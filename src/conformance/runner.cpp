// The conformance harness: drives a backend exactly as the Attention layer
// does (common metadata -> builder -> impl.do_kv_cache_update -> impl.forward)
// on one ConformanceCase and checks what docs/testing.md lists: poisoned outputs,
// guard rows, padded rows, untouched cache outside the written slots, LSE,
// tolerance against the dense oracle, and bitwise determinism.
#include <pagedattn/backend/scalar.h>
#include <pagedattn/cascade.h>
#include <pagedattn/conformance.h>
#include <pagedattn/error.h>
#include <pagedattn/metadata.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <exception>
#include <mutex>
#include <thread>

// Header-only, as in kv_cache_manager.cpp.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "conformance/cache_under_test.h"
#include "conformance/case_setup.h"
#include "conformance/guarded_output.h"
#include "conformance/rng.h"

namespace pagedattn {

namespace {

using conformance::CacheUnderTest;
using conformance::GuardedLse;
using conformance::GuardedOutput;
using conformance::join;
using conformance::make_lse;
using conformance::make_output;
using conformance::make_row_tensors;
using conformance::poison_bits;
using conformance::random_rows;
using conformance::read_lse;
using conformance::read_output;
using conformance::Rng;
using conformance::RowTensors;
using conformance::skip_reason;
using conformance::validate_case;

constexpr int kPaddingTokens = 3;         // q/k/v/output rows past num_actual_tokens in padded cases
constexpr int kPaddingSlots = 1;          // -1 entries the slot mapping gets: shorter than key
constexpr float kFp8AmaxDivisor = 64.0f;  // fp8 scale = amax / 64 (vLLM's test_cache)
// The layer's q_scale in every case: impls that quantize the query to e4m3
// divide by it (quantizes_query_for); not a power of two, so that division
// rounds, and small enough that N(0, 1) queries use e4m3's range.
constexpr float kFp8QueryScale = 0.02f;
constexpr double kMaxSink = 5.0;          // sinks ~ U[0, 5) (vLLM's rand * 5)
constexpr int kSecondStepQueryLen = 1;    // cross-attention: decode step reading the cached encoder K/V
constexpr std::string_view kLayerName = "conformance.attn";

// One forward call of the case: its metadata, inputs and what the oracle says.
struct Step {
  std::string name;
  CommonAttentionMetadata common;
  std::shared_ptr<const BackendMetadata> metadata;
  int rows = 0;  // query rows, padding included
  RowTensors query;
  RowTensors key_value;  // views 0 and 1, or none
  OracleOutput expected;
};

class CaseRun {
 public:
  CaseRun(const AttentionBackend& backend, const ConformanceCase& c, Device device)
      : backend_(backend), c_(c), device_(device), rng_(kSeedBase + c.seed) {}

  CaseResult run();

 private:
  void make_params();
  std::int64_t assign_pages(const std::vector<int>& kv_lens);
  void make_scales();
  void append_read_back(std::size_t r, int first, int count);
  void write(const std::vector<float>& keys, const std::vector<float>& values,
             const std::vector<std::pair<int, int>>& tokens, const TensorView& key, const TensorView& value,
             const TensorView& slot_mapping, bool issue_write);
  void write_context();
  std::optional<std::string> prepare_and_run(Step& step, bool first_step);
  std::optional<std::string> forward_and_check(Step& step);
  OracleProblem oracle_problem() const;
  std::vector<MmPrefixRange> mm_prefix_ranges(std::size_t r) const;

  static constexpr std::uint64_t kSeedBase = 0x5EED0000ull;

  const AttentionBackend& backend_;
  const ConformanceCase& c_;
  Device device_;
  Rng rng_;
  AttentionImplParams params_;
  std::unique_ptr<AttentionImpl> impl_;
  std::unique_ptr<CascadeBuilder> builder_;
  LayerQuantState layer_;
  std::vector<float> k_scale_;
  std::vector<float> v_scale_;
  std::vector<int> kv_lens_;
  std::vector<std::vector<float>> keys_;           // per request, model-dtype [kv_len, Hkv, D]
  std::vector<std::vector<float>> values_;         // per request
  std::vector<std::vector<float>> read_keys_;      // per request, as attention reads them
  std::vector<std::vector<float>> read_values_;    // per request
  std::vector<std::vector<std::int32_t>> blocks_;  // per request
  std::optional<CacheUnderTest> cache_;
  bool want_lse_ = false;
  XXH3_state_t digest_;
};

void CaseRun::make_params() {
  const int H = c_.num_heads;
  params_.num_heads = H;
  params_.head_size = c_.head_size;
  params_.scale = c_.scale.value_or(static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.head_size))));
  params_.num_kv_heads = c_.num_kv_heads;
  if (c_.alibi) params_.alibi_slopes = alibi_slopes(H);
  params_.sliding_window = c_.sliding_window;
  params_.attention_chunk_size = c_.attention_chunk_size;
  params_.use_mm_prefix = c_.mm_prefix;
  params_.kv_cache_dtype = c_.kv_cache_dtype;
  params_.logits_soft_cap = c_.soft_cap;
  params_.attn_type = c_.attn_type;
  if (c_.sinks) {
    for (int h = 0; h < H; ++h) params_.sinks.push_back(static_cast<float>(rng_.uniform() * kMaxSink));
  }
  params_.dtype = c_.dtype;
  params_.device = device_;
}

std::int64_t CaseRun::assign_pages(const std::vector<int>& kv_lens) {
  // Block 0 is the null block; the rest are handed out in a random order and
  // about a quarter are left spare.
  std::int64_t needed = 0;
  for (const int len : kv_lens) needed += (len + c_.block_size - 1) / c_.block_size - c_.shared_prefix / c_.block_size;
  needed += c_.shared_prefix / c_.block_size;
  const std::int64_t num_blocks = 1 + needed + std::max<std::int64_t>(2, needed / 4);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks - 1));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>(i + 1);
  for (std::size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[rng_.below(i)]);
  auto next = ids.begin();
  // A shared prefix's blocks are handed out once, at the head of every table.
  const auto shared = static_cast<std::ptrdiff_t>(c_.shared_prefix / c_.block_size);
  const std::vector<std::int32_t> prefix(next, next + shared);
  next += shared;
  for (const int len : kv_lens) {
    const auto count = static_cast<std::ptrdiff_t>((len + c_.block_size - 1) / c_.block_size) - shared;
    blocks_.emplace_back(prefix);
    blocks_.back().insert(blocks_.back().end(), next, next + count);
    next += count;
  }
  return num_blocks;
}

// Per-tensor scale amax / 64, or one per KV head; 1 for unquantized caches.
void CaseRun::make_scales() {
  const bool per_head = c_.per_head_kv_scales;
  const std::size_t n = per_head ? static_cast<std::size_t>(c_.num_kv_heads) : 1;
  const auto head_size = static_cast<std::size_t>(c_.head_size);
  auto scales = [&](const std::vector<std::vector<float>>& rows) {
    std::vector<float> amax(n, 0.0f);
    for (const auto& req : rows) {
      for (std::size_t i = 0; i < req.size(); ++i) {
        const std::size_t h = per_head ? i / head_size % n : 0;
        amax[h] = std::max(amax[h], std::abs(req[i]));
      }
    }
    for (float& a : amax) a = a > 0.0f ? a / kFp8AmaxDivisor : 1.0f;
    return amax;
  };
  // Per-token-head caches compute their own scales; the layer's stay 1.
  const bool fp8 = kv_quant_mode(c_.kv_cache_dtype) == KVQuantMode::Fp8PerTensor;
  k_scale_ = fp8 ? scales(keys_) : std::vector<float>{1.0f};
  v_scale_ = fp8 ? scales(values_) : std::vector<float>{1.0f};
  const std::vector<float> one{1.0f};
  const std::vector<float> q_scale{kFp8QueryScale};
  layer_.q_scale = Tensor::from_floats(q_scale, {1}, DType::F32, device_);
  layer_.q_scale_float = kFp8QueryScale;
  layer_.prob_scale = Tensor::from_floats(one, {1}, DType::F32, device_);
  layer_.k_scale = Tensor::from_floats(k_scale_, {std::ssize(k_scale_)}, DType::F32, device_);
  layer_.v_scale = Tensor::from_floats(v_scale_, {std::ssize(v_scale_)}, DType::F32, device_);
  layer_.k_scale_float = k_scale_[0];
  layer_.v_scale_float = v_scale_[0];
}

// Appends positions [first, first + count) of request r, as attention reads
// them (through the cache's rounding / quantization round trip when paged).
void CaseRun::append_read_back(std::size_t r, int first, int count) {
  const std::size_t row = static_cast<std::size_t>(c_.num_kv_heads) * c_.head_size;
  const auto begin = static_cast<std::size_t>(first) * row;
  const auto end = static_cast<std::size_t>(first + count) * row;
  if (!cache_) {
    const auto b = static_cast<std::ptrdiff_t>(begin);
    const auto e = static_cast<std::ptrdiff_t>(end);
    read_keys_[r].insert(read_keys_[r].end(), keys_[r].begin() + b, keys_[r].begin() + e);
    read_values_[r].insert(read_values_[r].end(), values_[r].begin() + b, values_[r].begin() + e);
    return;
  }
  std::vector<float> out(row);
  for (std::size_t i = begin; i < end; i += row) {
    cache_->read_back(&keys_[r][i], k_scale_, out.data());
    read_keys_[r].insert(read_keys_[r].end(), out.begin(), out.end());
    cache_->read_back(&values_[r][i], v_scale_, out.data());
    read_values_[r].insert(read_values_[r].end(), out.begin(), out.end());
  }
}

// Request r's PrefixLM ranges in a mm_prefix case, else none.
std::vector<MmPrefixRange> CaseRun::mm_prefix_ranges(std::size_t r) const {
  return c_.mm_prefix ? c_.batch.mm_prefix_ranges[r] : std::vector<MmPrefixRange>{};
}

OracleProblem CaseRun::oracle_problem() const {
  OracleProblem pb;
  pb.num_heads = c_.num_heads;
  pb.num_kv_heads = c_.num_kv_heads;
  pb.head_size = c_.head_size;
  pb.scale = static_cast<double>(params_.scale);
  pb.attn_type = c_.attn_type;
  pb.causal = c_.causal;
  pb.sliding_window = c_.sliding_window;
  pb.attention_chunk_size = c_.attention_chunk_size;
  if (c_.soft_cap) pb.soft_cap = static_cast<double>(*c_.soft_cap);
  pb.alibi_slopes = params_.alibi_slopes;
  pb.sinks = params_.sinks;
  return pb;
}

// Records tokens (request, position) with model-dtype K/V rows `keys` /
// `values` ([N, Hkv, D]) in the expected cache image and, with `issue_write`,
// stores them through impl.do_kv_cache_update (backends whose forward writes
// the cache get the new tokens that way instead).
void CaseRun::write(const std::vector<float>& keys, const std::vector<float>& values,
                    const std::vector<std::pair<int, int>>& tokens, const TensorView& key,
                    const TensorView& value, const TensorView& slot_mapping, bool issue_write) {
  const std::size_t row = static_cast<std::size_t>(c_.num_kv_heads) * c_.head_size;
  const int bs = c_.block_size;
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const auto [r, pos] = tokens[t];
    const std::int32_t block = blocks_[static_cast<std::size_t>(r)][static_cast<std::size_t>(pos / bs)];
    cache_->record(static_cast<std::int64_t>(block) * bs + pos % bs, &keys[t * row], &values[t * row],
                   k_scale_, v_scale_);
  }
  if (issue_write) impl_->do_kv_cache_update(layer_, key, value, cache_->view(), slot_mapping);
}

// Decoder context tokens, written before the step as earlier steps would have.
void CaseRun::write_context() {
  const std::size_t row = static_cast<std::size_t>(c_.num_kv_heads) * c_.head_size;
  std::vector<float> ctx_k;
  std::vector<float> ctx_v;
  std::vector<std::pair<int, int>> tokens;
  std::vector<std::int64_t> slots;
  for (std::size_t r = 0; r < c_.batch.requests.size(); ++r) {
    const auto [q_len, seq_len] = c_.batch.requests[r];
    const int ctx = seq_len - q_len;
    ctx_k.insert(ctx_k.end(), keys_[r].begin(), keys_[r].begin() + static_cast<std::ptrdiff_t>(ctx * row));
    ctx_v.insert(ctx_v.end(), values_[r].begin(),
                 values_[r].begin() + static_cast<std::ptrdiff_t>(ctx * row));
    for (int pos = 0; pos < ctx; ++pos) tokens.emplace_back(static_cast<int>(r), pos);
    const auto request_slots = slots_for_positions(blocks_[r], c_.block_size, 0, ctx);
    slots.insert(slots.end(), request_slots.begin(), request_slots.end());
    append_read_back(r, 0, ctx);
  }
  if (tokens.empty()) return;
  const auto n = std::ssize(tokens);
  const Tensor k = Tensor::from_floats(ctx_k, {n, c_.num_kv_heads, c_.head_size}, c_.dtype, device_);
  const Tensor v = Tensor::from_floats(ctx_v, {n, c_.num_kv_heads, c_.head_size}, c_.dtype, device_);
  write(ctx_k, ctx_v, tokens, k, v, Tensor::from_i64(slots, {n}, device_), true);
}

// Builds the step's inputs (writing the new K/V for the first step), the
// oracle's answer, the backend metadata, then runs and checks forward.
std::optional<std::string> CaseRun::prepare_and_run(Step& step, bool first_step) {
  const int H = c_.num_heads;
  const int Hkv = c_.num_kv_heads;
  const int D = c_.head_size;
  const bool cross = c_.attn_type == AttentionType::EncoderDecoder;
  const auto q_row = static_cast<std::size_t>(H) * D;
  const auto kv_row = static_cast<std::size_t>(Hkv) * D;
  const auto q_host = random_rows(rng_, static_cast<std::size_t>(step.rows) * q_row, c_.dtype);

  // New K/V rows: the query tokens' own keys, or (cross, first step) every encoder token.
  std::vector<float> new_k;
  std::vector<float> new_v;
  std::vector<std::pair<int, int>> new_tokens;
  OracleProblem pb = oracle_problem();
  int first_token = 0;
  for (std::size_t r = 0; r < kv_lens_.size(); ++r) {
    const int q_len = step.common.query_len(static_cast<int>(r));
    const int kv_len = kv_lens_[r];
    if (first_step) {
      const int first = cross ? 0 : kv_len - q_len;
      const int count = cross ? kv_len : q_len;
      const auto b = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(first) * kv_row);
      const auto e = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(first + count) * kv_row);
      new_k.insert(new_k.end(), keys_[r].begin() + b, keys_[r].begin() + e);
      new_v.insert(new_v.end(), values_[r].begin() + b, values_[r].begin() + e);
      for (int pos = first; pos < first + count; ++pos) new_tokens.emplace_back(static_cast<int>(r), pos);
      append_read_back(r, first, count);
    }
    OracleRequest rq;
    rq.query_len = q_len;
    rq.kv_len = kv_len;
    const auto qb =
        q_host.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(first_token) * q_row);
    rq.query.assign(qb, qb + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(q_len) * q_row));
    if (layer_.quantize_query) {  // the impl reads e4m3 queries: so does the oracle
      for (float& x : rq.query) x = fp8_query_round_trip(x, kFp8QueryScale);
    }
    rq.key = read_keys_[r];
    rq.value = read_values_[r];
    rq.mm_prefix_ranges = mm_prefix_ranges(r);
    pb.requests.push_back(std::move(rq));
    first_token += q_len;
  }
  if (step.common.num_actual_tokens != first_token) {
    return fmt::format("{}: metadata has {} tokens, the batch {}", step.name, step.common.num_actual_tokens,
                       first_token);
  }
  step.expected = dense_attention(pb);

  if (!first_step) {
    step.query = make_row_tensors({&q_host}, {H}, step.rows, D, c_.dtype, device_, c_.strided_qkv);
  } else {
    // Rows past the real tokens hold junk that must never be read or stored.
    const int kv_rows = cross ? static_cast<int>(new_tokens.size()) : step.rows;
    const auto junk = random_rows(rng_, static_cast<std::size_t>(kv_rows) * kv_row - new_k.size(), c_.dtype);
    std::vector<float> k_rows = new_k;
    std::vector<float> v_rows = new_v;
    k_rows.insert(k_rows.end(), junk.begin(), junk.end());
    v_rows.insert(v_rows.end(), junk.begin(), junk.end());
    if (cross) {
      step.query = make_row_tensors({&q_host}, {H}, step.rows, D, c_.dtype, device_, c_.strided_qkv);
      step.key_value =
          make_row_tensors({&k_rows, &v_rows}, {Hkv, Hkv}, kv_rows, D, c_.dtype, device_, c_.strided_qkv);
    } else {
      const RowTensors qkv = make_row_tensors({&q_host, &k_rows, &v_rows}, {H, Hkv, Hkv}, step.rows, D,
                                              c_.dtype, device_, c_.strided_qkv);
      step.query = {qkv.owners, {qkv.views[0]}};
      step.key_value = {qkv.owners, {qkv.views[1], qkv.views[2]}};
    }
    if (cache_) {
      write(new_k, new_v, new_tokens, step.key_value.views[0], step.key_value.views[1],
            step.common.slot_mapping, !backend_.forward_includes_kv_cache_update());
    }
  }
  // Chunked local attention runs on the step split per chunk, as the layer's
  // ModelMetadataBuilder does.
  step.metadata = c_.attention_chunk_size
                      ? builder_->build(make_local_attention_virtual_batches(step.common, *c_.attention_chunk_size))
                      : builder_->build(step.common);
  // The batch has 8 requests: the prefix's length and the layer decide.
  const bool want_cascade = cascade_applies(params_) && c_.shared_prefix >= kCascadeMinPrefixTokens;
  if (c_.shared_prefix > 0 && builder_->last_used_cascade() != want_cascade) {
    return fmt::format("{}: the shared-prefix step was {}planned as a cascade, expected {}", step.name,
                       builder_->last_used_cascade() ? "" : "not ", want_cascade ? "one" : "none");
  }
  return forward_and_check(step);
}

std::optional<std::string> CaseRun::forward_and_check(Step& step) {
  const int tokens = step.common.num_actual_tokens;
  GuardedOutput out = make_output(step.rows, c_.num_heads, c_.head_size, c_.dtype, device_, c_.strided_qkv);
  GuardedLse lse;
  if (want_lse_) lse = make_lse(c_.num_heads, step.rows, device_);
  const TensorView key = step.key_value.views.empty() ? TensorView{} : step.key_value.views[0];
  const TensorView value = step.key_value.views.empty() ? TensorView{} : step.key_value.views[1];
  const KVCacheView cache = cache_ ? cache_->view() : KVCacheView{};

  std::vector<std::uint8_t> first_out;
  std::vector<std::uint8_t> first_lse;
  const int runs = backend_.is_deterministic() ? 2 : 1;
  for (int run = 0; run < runs; ++run) {
    fill_tensor_bits(out.storage, poison_bits(c_.dtype));
    if (want_lse_) fill_tensor_bits(lse.storage, poison_bits(DType::F32));
    planned_forward(*impl_, layer_, step.query.views[0], key, value, cache, *step.metadata, out.view, lse.view);
    if (run == 0) {
      first_out = to_byte_vector(out.storage);
      XXH3_64bits_update(&digest_, first_out.data(), first_out.size());
      if (want_lse_) {
        first_lse = to_byte_vector(lse.storage);
        XXH3_64bits_update(&digest_, first_lse.data(), first_lse.size());
      }
    } else if (to_byte_vector(out.storage) != first_out ||
               (want_lse_ && to_byte_vector(lse.storage) != first_lse)) {
      return fmt::format(
          "{}: a second identical forward gave different bits (the backend claims determinism)", step.name);
    }
  }

  std::vector<float> real_out;
  std::vector<float> real_lse;
  if (auto bad = read_output(out, tokens, real_out)) return fmt::format("{}: {}", step.name, *bad);
  if (want_lse_) {
    if (auto bad = read_lse(lse, step.rows, tokens, real_lse)) return fmt::format("{}: {}", step.name, *bad);
  }
  if (auto bad = compare_with_oracle(step.expected, real_out, real_lse, c_.dtype)) {
    return fmt::format("{}: {}", step.name, *bad);
  }
  return std::nullopt;
}

CaseResult CaseRun::run() {
  const bool cross = c_.attn_type == AttentionType::EncoderDecoder;
  const auto kv_row = static_cast<std::size_t>(c_.num_kv_heads) * c_.head_size;
  const auto& reqs = c_.batch.requests;
  make_params();
  want_lse_ = c_.want_lse && backend_.can_return_lse();
  for (const auto& [q, s] : reqs) {
    kv_lens_.push_back(s);
    keys_.push_back(random_rows(rng_, static_cast<std::size_t>(s) * kv_row, c_.dtype));
    values_.push_back(random_rows(rng_, static_cast<std::size_t>(s) * kv_row, c_.dtype));
  }
  // A shared prefix holds the same tokens in every request.
  const auto prefix_elems = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(c_.shared_prefix) * kv_row);
  for (std::size_t r = 1; r < reqs.size() && prefix_elems > 0; ++r) {
    std::copy(keys_[0].begin(), keys_[0].begin() + prefix_elems, keys_[r].begin());
    std::copy(values_[0].begin(), values_[0].begin() + prefix_elems, values_[r].begin());
  }
  read_keys_.resize(reqs.size());
  read_values_.resize(reqs.size());
  const std::int64_t num_blocks = assign_pages(kv_lens_);
  make_scales();

  MetadataOptions options;
  options.block_size = c_.block_size;
  options.causal = c_.attn_type == AttentionType::Decoder && c_.causal;
  options.device = device_;
  options.num_padded_slots = c_.padded_slots ? kPaddingSlots : 0;

  // One step, or for cross-attention a first step that writes the encoder
  // K/V and a decode step that only reads them.
  std::vector<Step> steps(cross ? 2 : 1);
  for (std::size_t s = 0; s < steps.size(); ++s) {
    std::vector<RequestSpec> specs;
    for (std::size_t r = 0; r < reqs.size(); ++r) {
      const int q_len = s == 0 ? reqs[r].first : kSecondStepQueryLen;
      specs.push_back({q_len, cross ? q_len : reqs[r].second, blocks_[r], mm_prefix_ranges(r)});
    }
    if (cross) {
      steps[s].name = s == 0 ? "step 1 (writes encoder K/V)" : "step 2 (reads cached encoder K/V)";
      steps[s].common = make_cross_attention_metadata(specs, kv_lens_, s == 0, options);
    } else {
      steps[s].name = "forward";
      steps[s].common = make_common_metadata(specs, options);
    }
    steps[s].rows = steps[s].common.num_actual_tokens + (c_.padded_slots ? kPaddingTokens : 0);
  }

  const bool per_head =
      c_.per_head_kv_scales && kv_quant_mode(c_.kv_cache_dtype) == KVQuantMode::Fp8PerTensor;
  const ProblemSupport support = backend_.problem_support(
      make_attention_problem(params_, c_.block_size, &steps[0].common, want_lse_, per_head));
  if (!support.supported()) return {CaseStatus::Skipped, join(support.reasons)};
  if (c_.batch_invariant && !backend_.supports_batch_invariance()) {
    return {CaseStatus::Skipped, "batch invariance not supported"};
  }

  impl_ = backend_.make_impl(params_);
  layer_.quantize_query = impl_->quantizes_query();  // as an Attention layer sets it
  BuilderParams builder_params;
  builder_params.block_size = c_.block_size;
  builder_params.num_kv_heads = c_.num_kv_heads;
  builder_params.head_size = c_.head_size;
  builder_params.num_heads = c_.num_heads;
  builder_params.device = device_;
  builder_params.layer_names = {std::string(kLayerName)};
  builder_params.batch_invariant = c_.batch_invariant;
  // As the layers' builder: cascades allowed where the layer allows them (a
  // CascadeBuilder that never cascades is the backend's builder).
  builder_ = std::make_unique<CascadeBuilder>(backend_, builder_params, c_.dtype,
                                              c_.shared_prefix > 0 && cascade_applies(params_));
  if (reads_paged_cache(c_.attn_type)) cache_.emplace(backend_, c_, num_blocks, device_);
  if (c_.attn_type == AttentionType::Decoder) write_context();

  XXH3_64bits_reset(&digest_);
  for (std::size_t s = 0; s < steps.size(); ++s) {
    if (auto bad = prepare_and_run(steps[s], s == 0)) return {CaseStatus::Failed, *bad, XXH3_64bits_digest(&digest_)};
  }
  if (cache_) {
    if (auto bad = cache_->check()) return {CaseStatus::Failed, *bad, XXH3_64bits_digest(&digest_)};
  }
  return {CaseStatus::Passed, {}, XXH3_64bits_digest(&digest_)};
}

void count(ConformanceSummary& summary, CaseStatus status) {
  switch (status) {
    case CaseStatus::Passed:
      ++summary.passed;
      return;
    case CaseStatus::Failed:
      ++summary.failed;
      return;
    case CaseStatus::Skipped:
      ++summary.skipped;
      return;
  }
}

}  // namespace

std::string_view case_status_name(CaseStatus status) {
  switch (status) {
    case CaseStatus::Passed:
      return "passed";
    case CaseStatus::Failed:
      return "failed";
    case CaseStatus::Skipped:
      return "skipped";
  }
  return "unknown";
}

CaseResult run_conformance_case(const AttentionBackend& backend, const ConformanceCase& c, Device device) {
  try {
    validate_case(c);
  } catch (const std::exception& e) {
    return {CaseStatus::Failed, fmt::format("invalid case: {}", e.what())};
  }
  try {
    if (auto reason = skip_reason(backend, c, device)) return {CaseStatus::Skipped, *reason};
    CaseRun run(backend, c, device);
    return run.run();
  } catch (const std::exception& e) {
    return {CaseStatus::Failed, fmt::format("threw: {}", e.what())};
  }
}

bool matches_any(const ConformanceCase& c, std::span<const std::string> filters) {
  if (filters.empty()) return true;
  const std::string id = c.id();
  return std::any_of(filters.begin(), filters.end(),
                     [&](const std::string& f) { return id.find(f) != std::string::npos; });
}

ConformanceSummary run_conformance(const AttentionBackend& backend, std::string_view filter, Device device,
                                   const CaseCallback& on_case, int max_threads) {
  std::vector<std::string> filters;
  if (!filter.empty()) filters.emplace_back(filter);
  return run_conformance(backend, filters, device, on_case, max_threads);
}

ConformanceSummary run_conformance(const AttentionBackend& backend, std::span<const std::string> filters,
                                   Device device, const CaseCallback& on_case, int max_threads) {
  std::vector<ConformanceCase> cases;
  for (ConformanceCase& c : conformance_grid()) {
    if (matches_any(c, filters)) cases.push_back(std::move(c));
  }
  const std::size_t n = cases.size();
  std::vector<std::optional<CaseResult>> results(n);
  std::atomic<std::size_t> next{0};
  std::mutex mutex;
  std::size_t reported = 0;
  ConformanceSummary summary;
  std::exception_ptr callback_error;

  // Results are reported in grid order, whichever thread finishes first.
  auto worker = [&] {
    for (std::size_t i = next++; i < n; i = next++) {
      CaseResult result = run_conformance_case(backend, cases[i], device);
      const std::lock_guard lock(mutex);
      results[i] = std::move(result);
      for (; reported < n && results[reported]; ++reported) {
        const CaseResult& r = *results[reported];
        count(summary, r.status);
        if (!on_case || callback_error) continue;
        try {
          on_case(cases[reported], r);
        } catch (...) {
          callback_error = std::current_exception();
          next = n;
        }
      }
    }
  };
  const auto threads = static_cast<std::size_t>(
      std::clamp<std::int64_t>(max_threads, 1, std::max<std::int64_t>(1, std::ssize(cases))));
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  if (callback_error) std::rethrow_exception(callback_error);
  return summary;
}

std::string format_summary(const ConformanceSummary& s) {
  return fmt::format("conformance: {} passed, {} failed, {} skipped", s.passed, s.failed, s.skipped);
}

}  // namespace pagedattn
