#include "backends/cpu_attn/cpu_attn_backend.h"

#include <fmt/format.h>

#include "backends/cpu_attn/cpu_attn_impl.h"
#include "backends/cpu_attn/cpu_attn_metadata.h"
#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cpu_attn/kernels/cpu_attn_isa.h"
#include "backends/cpu_attn/kernels/cpu_attn_kernel.h"

#include <algorithm>

namespace pagedattn {

namespace {

constexpr int kHeadSizeMultiple = 8;  // the kernels' narrowest vector: 8 floats
constexpr int kCpuAttnPriority = 0;

bool is_supported_kv_storage(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::FP8_E4M3 ||
         t == DType::FP8_E5M2 || t == DType::I8;
}

}  // namespace

std::string_view CpuAttnBackend::description() const {
  return "tiled online-softmax CPU backend: Highway SIMD (AVX-512/BF16, AVX2, portable), thread pool, split-KV";
}

std::vector<DType> CpuAttnBackend::supported_dtypes() const { return {DType::F32, DType::F16, DType::BF16}; }

std::vector<CacheDType> CpuAttnBackend::supported_kv_cache_dtypes() const { return all_cache_dtypes(); }

std::optional<std::string> CpuAttnBackend::head_size_rule(int head_size) const {
  if (head_size > 0 && head_size % kHeadSizeMultiple == 0) return std::nullopt;
  return fmt::format("head_size must be a positive multiple of {}, got {}", kHeadSizeMultiple, head_size);
}

KeyPacking CpuAttnBackend::key_packing(const TensorView& key_cache) const {
  const KeyPacking preferred =
      cpu_attn::preferred_key_packing(key_cache.dtype(), static_cast<int>(key_cache.size(3)));
  return can_hold_key_packing(key_cache, preferred) ? preferred : KeyPacking::None;
}

ProblemSupport CpuAttnBackend::problem_support(const AttentionProblem& problem) const {
  ProblemSupport support;
  if (auto rule = head_size_rule(problem.head_size)) support.reasons.push_back(std::move(*rule));
  if (!supports_dtype(problem.dtype)) {
    support.reasons.push_back(fmt::format("dtype {} not supported", problem.dtype));
  }
  if (!is_supported_kv_storage(problem.kv_storage_dtype)) {
    support.reasons.push_back(fmt::format("KV cache element type {} not supported", problem.kv_storage_dtype));
  }
  if (problem.num_kv_heads <= 0 || problem.num_heads <= 0 || problem.num_heads % problem.num_kv_heads != 0) {
    support.reasons.push_back(fmt::format("num_heads ({}) must be a positive multiple of num_kv_heads ({})",
                                       problem.num_heads, problem.num_kv_heads));
  }
  if (problem.block_size < 0) support.reasons.push_back(fmt::format("block_size {} not supported", problem.block_size));
  return support;
}

std::unique_ptr<AttentionImpl> CpuAttnBackend::make_impl(const AttentionImplParams& params) const {
  require_supported(problem_support(make_attention_problem(params, 0, nullptr, false, false)), name());
  return std::make_unique<CpuAttnImpl>(params);
}

std::unique_ptr<AttentionMetadataBuilder> CpuAttnBackend::make_builder(const BuilderParams& params) const {
  return std::make_unique<CpuAttnMetadataBuilder>(params);
}

void register_cpu_attn_backend(BackendRegistry& registry) {
  registry.add(std::make_unique<CpuAttnBackend>(), kCpuAttnPriority);
}

}  // namespace pagedattn
