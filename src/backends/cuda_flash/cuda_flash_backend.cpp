#include "cuda_flash_backend.h"

#include <pagedattn/error.h>

#include "flash_impl.h"
#include "flash_metadata.h"
#include "flash_planner.h"
#include "kernels/flash_params.h"

namespace pagedattn {
namespace {

constexpr int kMaxHeadSize = cuda_flash::kMaxHeadSize;
constexpr int kHeadSizeAlign = cuda_flash::kHeadSizeAlign;

}  // namespace

int CudaFlashBackend::cascade_prefix_queries() const { return cuda_flash::kDecodeMaxTokens; }

std::vector<CacheDType> CudaFlashBackend::supported_kv_cache_dtypes() const { return all_cache_dtypes(); }

std::optional<std::string> CudaFlashBackend::head_size_rule(int head_size) const {
  if (head_size % kHeadSizeAlign != 0 || head_size > kMaxHeadSize) {
    return fmt::format("head_size must be a multiple of {} and at most {}", kHeadSizeAlign, kMaxHeadSize);
  }
  return std::nullopt;
}

ProblemSupport CudaFlashBackend::problem_support(const AttentionProblem& problem) const {
  ProblemSupport support;
  if (!supports_dtype(problem.dtype)) {
    support.reasons.push_back(fmt::format("dtype {} not supported: the kernels use f16/bf16 tensor-core MMAs",
                                       problem.dtype));
  }
  const bool kv_ok = problem.kv_storage_dtype == problem.dtype || is_fp8(problem.kv_storage_dtype) ||
                     problem.kv_storage_dtype == DType::I8;
  if (!kv_ok) {
    support.reasons.push_back(fmt::format("kv cache storage dtype {} not supported with dtype {}",
                                       problem.kv_storage_dtype, problem.dtype));
  }
  if (problem.head_size <= 0 || head_size_rule(problem.head_size)) {
    support.reasons.push_back(fmt::format("head_size {} not supported (multiples of {} up to {})", problem.head_size,
                                       kHeadSizeAlign, kMaxHeadSize));
  }
  if (problem.num_heads <= 0 || problem.num_kv_heads <= 0 || problem.num_heads % problem.num_kv_heads != 0) {
    support.reasons.push_back(fmt::format("num_heads ({}) must be a positive multiple of num_kv_heads ({})",
                                       problem.num_heads, problem.num_kv_heads));
  }
  if (problem.block_size < 0) support.reasons.push_back(fmt::format("block_size {} not supported", problem.block_size));
  return support;
}

std::unique_ptr<AttentionImpl> CudaFlashBackend::make_impl(const AttentionImplParams& params) const {
  return cuda_flash::make_flash_impl(params, *this);
}

std::unique_ptr<AttentionMetadataBuilder> CudaFlashBackend::make_builder(const BuilderParams& params) const {
  return cuda_flash::make_flash_builder(params);
}

void register_cuda_flash_backend(BackendRegistry& registry) {
  registry.add(std::make_unique<CudaFlashBackend>(), 0);
}

}  // namespace pagedattn
