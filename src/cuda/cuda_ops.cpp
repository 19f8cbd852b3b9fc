// Adapter from the validated op front-ends (TensorViews) to the CUDA kernels'
// POD params. Kernels run on the current forward context's stream.
#include "cuda/cuda_ops.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <limits>

#include "cuda/cuda_runtime.h"
#include "cuda/kernels/cache_ops.h"
#include "ops/index_select_params.h"

namespace pagedattn::cuda {
namespace {

namespace k = cuda_kernels;

static_assert(kMaxTensorDims <= k::kMaxLayoutDims, "a tensor must fit a kernel layout");

k::StridedLayout layout_of(const TensorView& t, int first_dim) {
  k::StridedLayout l;
  for (int d = first_dim; d < t.dim(); ++d) {
    l.shape[l.rank] = t.size(d);
    l.strides[l.rank] = t.stride(d);
    ++l.rank;
  }
  return l;
}

// A [1] scale is per tensor (stride 0 reuses it for every head); [Hkv] is per head.
std::int64_t scale_stride(const TensorView& scale) { return scale.numel() == 1 ? 0 : scale.stride(0); }

class CudaOps final : public OpsImpl {
 public:
  void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                         const TensorView& value_cache, const TensorView& slot_mapping,
                         const TensorView& k_scale, const TensorView& v_scale, KVQuantMode mode,
                         KeyPacking /*key_packing: None, writes_key_packing*/) override {
    DeviceGuard guard(key.device().index);
    k::ReshapeAndCacheParams p;
    p.key = key.data();
    p.value = value.data();
    p.key_cache = key_cache.data();
    p.value_cache = value_cache.data();
    p.slot_mapping = static_cast<const std::int64_t*>(slot_mapping.data());
    p.slot_stride = slot_mapping.stride(0);
    if (mode == KVQuantMode::Fp8PerTensor) {
      p.k_scale = static_cast<const float*>(k_scale.data());
      p.v_scale = static_cast<const float*>(v_scale.data());
      p.k_scale_stride = scale_stride(k_scale);
      p.v_scale_stride = scale_stride(v_scale);
    } else if (mode != KVQuantMode::None) {
      // [NB, Hkv, BS] scales, written.
      p.k_token_scale = static_cast<float*>(k_scale.data());
      p.v_token_scale = static_cast<float*>(v_scale.data());
      p.ks_block = k_scale.stride(kScaleHalfBlockDim);
      p.ks_slot = k_scale.stride(kScaleHalfSlotDim);
      p.ks_head = k_scale.stride(kScaleHalfHeadDim);
      p.vs_block = v_scale.stride(kScaleHalfBlockDim);
      p.vs_slot = v_scale.stride(kScaleHalfSlotDim);
      p.vs_head = v_scale.stride(kScaleHalfHeadDim);
    }
    p.num_tokens = slot_mapping.size(0);
    p.num_kv_heads = key.size(1);
    p.head_size = key.size(2);
    p.block_size = key_cache.size(1);
    p.num_slots = key_cache.size(0) * key_cache.size(1);
    p.key_token_stride = key.stride(0);
    p.key_head_stride = key.stride(1);
    p.value_token_stride = value.stride(0);
    p.value_head_stride = value.stride(1);
    p.kc_block = key_cache.stride(0);
    p.kc_slot = key_cache.stride(1);
    p.kc_head = key_cache.stride(2);
    p.vc_block = value_cache.stride(0);
    p.vc_slot = value_cache.stride(1);
    p.vc_head = value_cache.stride(2);
    p.src_dtype = key.dtype();
    p.cache_dtype = key_cache.dtype();
    check_cuda(k::launch_reshape_and_cache(p, current_stream()), "reshape_and_cache (CUDA)");
  }

  void merge_attn_states(const TensorView& output, const TensorView& prefix_output, const TensorView& prefix_lse,
                         const TensorView& suffix_output, const TensorView& suffix_lse,
                         const TensorView& output_lse) override {
    DeviceGuard guard(output.device().index);
    k::MergeAttnStatesParams p;
    p.output = output.data();
    p.prefix_output = prefix_output.data();
    p.suffix_output = suffix_output.data();
    p.prefix_lse = static_cast<const float*>(prefix_lse.data());
    p.suffix_lse = static_cast<const float*>(suffix_lse.data());
    if (output_lse.defined()) {
      p.output_lse = static_cast<float*>(output_lse.data());
      p.out_lse_head = output_lse.stride(0);
      p.out_lse_token = output_lse.stride(1);
    }
    p.num_tokens = output.size(0);
    p.num_heads = output.size(1);
    p.head_size = output.size(2);
    p.out_token = output.stride(0);
    p.out_head = output.stride(1);
    p.pre_token = prefix_output.stride(0);
    p.pre_head = prefix_output.stride(1);
    p.suf_token = suffix_output.stride(0);
    p.suf_head = suffix_output.stride(1);
    p.pre_lse_head = prefix_lse.stride(0);
    p.pre_lse_token = prefix_lse.stride(1);
    p.suf_lse_head = suffix_lse.stride(0);
    p.suf_lse_token = suffix_lse.stride(1);
    p.dtype = output.dtype();
    check_cuda(k::launch_merge_attn_states(p, current_stream()), "merge_attn_states (CUDA)");
  }

  void copy_blocks(const std::vector<TensorView>& caches, const TensorView& block_mapping) override {
    DeviceGuard guard(block_mapping.device().index);
    for (const TensorView& cache : caches) {
      k::CopyBlocksParams p;
      p.cache = cache.data();
      p.element_size = cache.element_size();
      p.block_stride = cache.stride(0);
      p.block = layout_of(cache, 1);
      p.block_mapping = static_cast<const std::int64_t*>(block_mapping.data());
      p.mapping_row_stride = block_mapping.stride(0);
      p.mapping_col_stride = block_mapping.stride(1);
      p.num_pairs = block_mapping.size(0);
      check_cuda(k::launch_copy_blocks(p, current_stream()), "copy_blocks (CUDA)");
    }
  }

  void index_select(const TensorView& dst, const TensorView& src, int dim, const TensorView& index,
                    std::uint64_t fill_bits) override {
    DeviceGuard guard(dst.device().index);
    check_cuda(k::launch_index_select(index_select_params<k::IndexSelectParams>(dst, src, dim, index, fill_bits),
                                      current_stream()),
               "index_select (CUDA)");
  }

  float abs_max(const TensorView& x) override {
    DeviceGuard guard(x.device().index);
    const auto stream = static_cast<cudaStream_t>(current_stream());
    constexpr std::string_view where = "abs_max (CUDA)";
    unsigned int* scratch = nullptr;  // [0] = max bits, [1] = NaN flag
    constexpr std::size_t kScratchBytes = 2 * sizeof(unsigned int);
    check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&scratch), kScratchBytes, stream), where);
    unsigned int host[2] = {0u, 0u};
    int status = cudaMemsetAsync(scratch, 0, kScratchBytes, stream);
    if (status == cudaSuccess) {
      k::AbsMaxParams p;
      p.data = x.data();
      p.dtype = x.dtype();
      p.layout = layout_of(x, 0);
      p.result = scratch;
      p.saw_nan = scratch + 1;
      status = k::launch_abs_max(p, stream);
    }
    if (status == cudaSuccess) status = cudaMemcpyAsync(host, scratch, kScratchBytes, cudaMemcpyDeviceToHost, stream);
    const int freed = cudaFreeAsync(scratch, stream);
    if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
    check_cuda(status, where);
    check_cuda(freed, where);
    if (host[1] != 0u) return std::numeric_limits<float>::quiet_NaN();
    float result = 0.0f;
    std::memcpy(&result, &host[0], sizeof result);
    return result;
  }
};

}  // namespace

OpsImpl& cuda_ops_impl() {
  static CudaOps impl;
  return impl;
}

}  // namespace pagedattn::cuda
