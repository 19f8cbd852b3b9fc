#include "reference_backend.h"

#include <pagedattn/error.h>
#include <pagedattn/backend/impl_checks.h>
#include <pagedattn/ops.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kernels/reference_attention.h"

namespace pagedattn {

namespace {

constexpr std::string_view kImplWhere = "REFERENCE impl";
constexpr std::string_view kForwardWhere = "REFERENCE forward";
constexpr std::string_view kUpdateWhere = "REFERENCE do_kv_cache_update";
constexpr std::string_view kBuilderWhere = "REFERENCE builder";

// Element types the kernel can read from a cache.
constexpr DType kCacheStorageDTypes[] = {DType::F32,      DType::F16,      DType::BF16,
                                         DType::FP8_E4M3, DType::FP8_E5M2, DType::I8};

RowsOperand rows_operand(const TensorView& t) {
  return {t.data(), t.dtype(), t.stride(0), t.stride(1)};
}

CacheOperand cache_operand(const TensorView& t) {
  return {t.data(), t.stride(0), t.stride(1), t.stride(2)};
}

// The step plan: the validated step and the kernel's scratch, sized by the
// builder for its head size and the step's longest request, so that forward
// allocates nothing. One forward at a time writes the scratch.
struct ReferenceMetadata final : BackendMetadata {
  std::unique_ptr<double[]> scratch;
  std::size_t scratch_len = 0;
};

// Keys of the step's longest request: its seq_len, or its query length for
// encoder types (which read their own rows).
int max_keys(const StepFacts& facts) { return std::max(facts.longest_seq, facts.longest_query); }

class ReferenceImpl final : public AttentionImpl {
 public:
  ReferenceImpl(AttentionImplParams params, const ReferenceBackend& backend)
      : AttentionImpl(std::move(params)), backend_(backend) {
    const AttentionImplParams& p = params_;
    check_impl_params(kImplWhere, p);
    check_arg(p.device.is_cpu(), kImplWhere, "device", "cpu", p.device);
    require_supported(backend_.problem_support(make_attention_problem(p, 0, nullptr, false, false)),
                      backend_.name());
  }

  void check_forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                     const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                     const TensorView& output, const TensorView& lse) const override;
  void forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
               const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
               const TensorView& output, const TensorView& lse) override;

  void do_kv_cache_update(const LayerQuantState& layer, const TensorView& key, const TensorView& value,
                          const KVCacheView& kv_cache, const TensorView& slot_mapping) override {
    check_arg(kv_cache.defined(), kUpdateWhere, "kv_cache", "a bound KV cache", "undefined");
    const KVWriteScales scales = kv_write_scales(params_.kv_cache_dtype, layer, kv_cache);
    reshape_and_cache(key, value, kv_cache.key, kv_cache.value, slot_mapping, params_.kv_cache_dtype,
                      scales.k, scales.v, kv_cache.key_packing);
  }

  std::string_view class_name() const override { return "ReferenceAttentionImpl"; }

 private:
  ForwardShape check(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                     const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                     const TensorView& output, const TensorView& lse) const;

  const ReferenceBackend& backend_;
};

ForwardShape ReferenceImpl::check(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                                  const TensorView& value, const KVCacheView& kv_cache,
                                  const BackendMetadata& metadata, const TensorView& output,
                                  const TensorView& lse) const {
  const auto* md = dynamic_cast<const ReferenceMetadata*>(&metadata);
  check_arg(md != nullptr, kForwardWhere, "metadata", "metadata built by the REFERENCE builder",
            "metadata of another backend");
  const std::size_t scratch_len = reference::reference_attention_scratch_len(params_.head_size, max_keys(*md->facts));
  if (md->scratch_len < scratch_len) {
    throw_invalid(kForwardWhere, "metadata scratch",
                  fmt::format("{} doubles for head_size {} (BuilderParams::head_size is the largest of the layers)",
                              scratch_len, params_.head_size),
                  std::to_string(md->scratch_len));
  }
  const DType output_dtypes[] = {DType::F32, DType::F16, DType::BF16};
  const ForwardShape shape = check_forward_args(kForwardWhere, params_, Device::cpu(), layer, query, key, value,
                                                kv_cache, metadata, output, lse, output_dtypes,
                                                supports_quant_query_input());
  require_supported(backend_.problem_support(make_attention_problem(params_, shape.block_size, &metadata.common,
                                                                lse.defined(), shape.per_head_kv_scales)),
                    backend_.name());
  return shape;
}

void ReferenceImpl::check_forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                                  const TensorView& value, const KVCacheView& kv_cache,
                                  const BackendMetadata& metadata, const TensorView& output,
                                  const TensorView& lse) const {
  static_cast<void>(check(layer, query, key, value, kv_cache, metadata, output, lse));
}

void ReferenceImpl::forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                            const TensorView& value, const KVCacheView& kv_cache,
                            const BackendMetadata& metadata, const TensorView& output,
                            const TensorView& lse) {
  const AttentionImplParams& p = params_;
  const CommonAttentionMetadata& common = metadata.common;
  const int tokens = common.num_actual_tokens;
  const ForwardShape shape = check(layer, query, key, value, kv_cache, metadata, output, lse);

  reference::ReferenceAttentionParams k;
  k.num_heads = p.num_heads;
  k.num_kv_heads = p.num_kv_heads;
  k.head_size = p.head_size;
  k.variant = make_attention_variant(p, common.causal, p.alibi_slopes.empty() ? nullptr : p.alibi_slopes.data(),
                                     p.sinks.empty() ? nullptr : p.sinks.data(), host_mm_prefix_ranges(common));

  k.num_reqs = common.num_reqs;
  k.num_actual_tokens = tokens;
  k.query_start_loc = common.query_start_loc_host().data();
  k.seq_lens = common.seq_lens_host().data();
  k.block_table = static_cast<const std::int32_t*>(common.block_table_cpu.data());
  k.block_table_row_stride = common.block_table_cpu.stride(0);

  k.query = rows_operand(query);
  if (shape.paged) {
    k.key_cache = cache_operand(kv_cache.key);
    k.key_cache.packing = kv_cache.key_packing;
    k.value_cache = cache_operand(kv_cache.value);
    k.cache_dtype = shape.cache_storage;
    k.block_size = shape.block_size;
    if (shape.fp8) {
      k.k_scale = static_cast<const float*>(layer.k_scale.data());
      k.v_scale = static_cast<const float*>(layer.v_scale.data());
      k.num_kv_scales = static_cast<int>(layer.k_scale.size(0));
    }
    if (shape.token_head_scales) {
      k.k_token_scale = token_scale_operand(kv_cache.key_scale);
      k.v_token_scale = token_scale_operand(kv_cache.value_scale);
    }
  } else {
    k.key = rows_operand(key);
    k.value = rows_operand(value);
  }

  k.output = output.data();
  k.output_dtype = output.dtype();
  k.output_row_stride = output.stride(0);
  k.output_head_stride = output.stride(1);
  if (lse.defined()) {
    k.lse = static_cast<float*>(lse.data());
    k.lse_head_stride = lse.stride(0);
    k.lse_token_stride = lse.stride(1);
  }

  const auto& md = static_cast<const ReferenceMetadata&>(metadata);
  k.scratch = md.scratch.get();
  k.scratch_len = md.scratch_len;
  if (const auto status = reference::reference_attention(k); status != reference::ReferenceStatus::Ok) {
    throw Error(ErrorKind::InvalidArgument, fmt::format("{}: kernel rejected the batch: {}", kForwardWhere,
                                                        reference::reference_status_name(status)));
  }
}

class ReferenceMetadataBuilder final : public AttentionMetadataBuilder {
 public:
  explicit ReferenceMetadataBuilder(BuilderParams params) : params_(std::move(params)) {
    check_arg(params_.block_size > 0, kBuilderWhere, "block_size", "> 0", params_.block_size);
    check_arg(params_.device.is_cpu(), kBuilderWhere, "device", "cpu", params_.device);
    check_arg(params_.head_size > 0, kBuilderWhere, "head_size", "> 0", params_.head_size);
  }

  std::shared_ptr<const BackendMetadata> build(const CommonAttentionMetadata& common) override {
    auto metadata = std::make_shared<ReferenceMetadata>();
    adopt_step(kBuilderWhere, common, *metadata);
    metadata->scratch_len = reference::reference_attention_scratch_len(params_.head_size, max_keys(*metadata->facts));
    metadata->scratch = std::make_unique<double[]>(metadata->scratch_len);
    check_arg(common.device().is_cpu(), kBuilderWhere, "metadata device", "cpu", common.device());
    if (common.block_size > 0) {
      check_arg(common.block_size == params_.block_size, kBuilderWhere, "metadata block_size",
                fmt::format("the builder's block_size ({})", params_.block_size), common.block_size);
    }
    return metadata;
  }

 private:
  BuilderParams params_;
};

}  // namespace

std::vector<DType> ReferenceBackend::supported_dtypes() const {
  return {DType::F32, DType::F16, DType::BF16};
}

std::vector<CacheDType> ReferenceBackend::supported_kv_cache_dtypes() const { return all_cache_dtypes(); }

ProblemSupport ReferenceBackend::problem_support(const AttentionProblem& problem) const {
  ProblemSupport support;
  if (!supports_dtype(problem.dtype))
    support.reasons.push_back(fmt::format("dtype {} not supported", problem.dtype));
  if (std::find(std::begin(kCacheStorageDTypes), std::end(kCacheStorageDTypes), problem.kv_storage_dtype) ==
      std::end(kCacheStorageDTypes)) {
    support.reasons.push_back(fmt::format("kv cache storage dtype {} not supported", problem.kv_storage_dtype));
  }
  if (problem.head_size <= 0)
    support.reasons.push_back(fmt::format("head_size {} not supported", problem.head_size));
  if (problem.num_heads <= 0 || problem.num_kv_heads <= 0 || problem.num_heads % problem.num_kv_heads != 0) {
    support.reasons.push_back(fmt::format("num_heads ({}) must be a positive multiple of num_kv_heads ({})",
                                       problem.num_heads, problem.num_kv_heads));
  }
  return support;
}

std::unique_ptr<AttentionImpl> ReferenceBackend::make_impl(const AttentionImplParams& params) const {
  return std::make_unique<ReferenceImpl>(params, *this);
}

std::unique_ptr<AttentionMetadataBuilder> ReferenceBackend::make_builder(const BuilderParams& params) const {
  return std::make_unique<ReferenceMetadataBuilder>(params);
}

void register_reference_backend(BackendRegistry& registry) {
  registry.add(std::make_unique<ReferenceBackend>(), kOnlyWhenAsked);
}

}  // namespace pagedattn
