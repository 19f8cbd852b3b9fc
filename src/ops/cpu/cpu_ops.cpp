// Adapter from the validated front-end arguments (TensorViews) to the CPU
// kernels' POD params.
#include "ops/cpu/cpu_ops.h"

#include "ops/cpu/cache_kernels.h"
#include "ops/index_select_params.h"

namespace pagedattn {
namespace {

namespace k = cpu_kernels;

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

k::RowStrides row_strides(const TensorView& t) { return {t.stride(0), t.stride(1)}; }  // [T, H, D]

k::CacheStrides cache_strides(const TensorView& t) {  // [NB, BS, Hkv, D]
  return {t.stride(0), t.stride(1), t.stride(2)};
}

k::CacheStrides token_scale_strides(const TensorView& t) {  // [NB, Hkv, BS]
  return {t.stride(kScaleHalfBlockDim), t.stride(kScaleHalfSlotDim), t.stride(kScaleHalfHeadDim)};
}

k::LseStrides lse_strides(const TensorView& t) { return {t.stride(0), t.stride(1)}; }  // [H, T]

// A [1] scale is per tensor (stride 0 reuses it for every head); [Hkv] is per head.
std::int64_t scale_stride(const TensorView& scale) { return scale.numel() == 1 ? 0 : scale.stride(0); }

class CpuOps final : public OpsImpl {
 public:
  void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                         const TensorView& value_cache, const TensorView& slot_mapping,
                         const TensorView& k_scale, const TensorView& v_scale, KVQuantMode mode,
                         KeyPacking key_packing) override {
    k::ReshapeAndCacheParams p;
    p.key = key.data();
    p.value = value.data();
    p.key_cache = key_cache.data();
    p.value_cache = value_cache.data();
    p.slot_mapping = slot_mapping.data_as<const std::int64_t>();
    p.slot_stride = slot_mapping.stride(0);
    if (mode == KVQuantMode::Fp8PerTensor) {
      p.k_scale = k_scale.data_as<const float>();
      p.v_scale = v_scale.data_as<const float>();
      p.k_scale_stride = scale_stride(k_scale);
      p.v_scale_stride = scale_stride(v_scale);
    } else if (mode != KVQuantMode::None) {
      p.k_token_scale = k_scale.data_as<float>();
      p.v_token_scale = v_scale.data_as<float>();
      p.k_token_scale_strides = token_scale_strides(k_scale);
      p.v_token_scale_strides = token_scale_strides(v_scale);
    }
    p.num_tokens = slot_mapping.size(0);
    p.num_kv_heads = key.size(1);
    p.head_size = key.size(2);
    p.block_size = key_cache.size(1);
    p.key_strides = row_strides(key);
    p.value_strides = row_strides(value);
    p.key_cache_strides = cache_strides(key_cache);
    p.value_cache_strides = cache_strides(value_cache);
    p.src_dtype = key.dtype();
    p.cache_dtype = key_cache.dtype();
    p.key_packing = key_packing;
    k::reshape_and_cache(p);
  }

  bool writes_key_packing(KeyPacking /*packing*/) const override { return true; }

  void merge_attn_states(const TensorView& output, const TensorView& prefix_output,
                         const TensorView& prefix_lse, const TensorView& suffix_output,
                         const TensorView& suffix_lse, const TensorView& output_lse) override {
    k::MergeAttnStatesParams p;
    p.output = output.data();
    p.prefix_output = prefix_output.data();
    p.suffix_output = suffix_output.data();
    p.prefix_lse = prefix_lse.data_as<const float>();
    p.suffix_lse = suffix_lse.data_as<const float>();
    if (output_lse.defined()) {
      p.output_lse = output_lse.data_as<float>();
      p.output_lse_strides = lse_strides(output_lse);
    }
    p.num_tokens = output.size(0);
    p.num_heads = output.size(1);
    p.head_size = output.size(2);
    p.output_strides = row_strides(output);
    p.prefix_strides = row_strides(prefix_output);
    p.suffix_strides = row_strides(suffix_output);
    p.prefix_lse_strides = lse_strides(prefix_lse);
    p.suffix_lse_strides = lse_strides(suffix_lse);
    p.dtype = output.dtype();
    k::merge_attn_states(p);
  }

  void copy_blocks(const std::vector<TensorView>& caches, const TensorView& block_mapping) override {
    for (const TensorView& cache : caches) {
      k::CopyBlocksParams p;
      p.cache = cache.data();
      p.element_size = cache.element_size();
      p.block_stride = cache.stride(0);
      p.block = layout_of(cache, 1);
      p.block_mapping = block_mapping.data_as<const std::int64_t>();
      p.mapping_row_stride = block_mapping.stride(0);
      p.mapping_col_stride = block_mapping.stride(1);
      p.num_pairs = block_mapping.size(0);
      k::copy_blocks(p);
    }
  }

  void index_select(const TensorView& dst, const TensorView& src, int dim, const TensorView& index,
                    std::uint64_t fill_bits) override {
    k::index_select(index_select_params<k::IndexSelectParams>(dst, src, dim, index, fill_bits));
  }

  float abs_max(const TensorView& x) override {
    k::AbsMaxParams p;
    p.data = x.data();
    p.dtype = x.dtype();
    p.layout = layout_of(x, 0);
    return k::abs_max(p);
  }
};

}  // namespace

OpsImpl& cpu_ops_impl() {
  static CpuOps impl;
  return impl;
}

}  // namespace pagedattn
