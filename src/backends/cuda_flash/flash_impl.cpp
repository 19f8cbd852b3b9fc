#include "flash_impl.h"

#include <cuda_runtime_api.h>
#include <pagedattn/backend/impl_checks.h>
#include <pagedattn/cascade.h>
#include <pagedattn/error.h>
#include <pagedattn/ops.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>

#include "cuda/cuda_runtime.h"
#include "flash_metadata.h"
#include "flash_planner.h"
#include "kernels/flash_params.h"

namespace pagedattn::cuda_flash {
namespace {

constexpr std::string_view kImplWhere = "CUDA_FLASH impl";
constexpr std::string_view kForwardWhere = "CUDA_FLASH forward";
constexpr std::string_view kUpdateWhere = "CUDA_FLASH do_kv_cache_update";
constexpr std::uintptr_t kVectorBytes = 16;  // the kernels move 16-byte vectors

// The kernels load and store 8-element vectors: the base must be 16-byte
// aligned (8-byte for fp8) and every stride but the last a multiple of 8.
void check_vector_aligned(const TensorView& t, std::string_view name) {
  const std::uintptr_t align = t.element_size() == 1 ? kVectorBytes / 2 : kVectorBytes;
  const auto address = reinterpret_cast<std::uintptr_t>(t.data());
  check_arg(address % align == 0, kForwardWhere, fmt::format("{} data pointer", name),
            fmt::format("{}-byte aligned", align), fmt::format("{:#x}", address));
  for (int d = 0; d + 1 < t.dim(); ++d) {
    check_arg(t.stride(d) % kHeadSizeAlign == 0, kForwardWhere, fmt::format("{}.stride({})", name, d),
              fmt::format("a multiple of {}", kHeadSizeAlign), t.stride(d));
  }
}

// Whether every row of t starts on a 16-byte boundary and its last dimension
// is whole 16-byte chunks (choose_kernel's kv_rows_16b).
bool rows_16b(const TensorView& t) {
  const std::int64_t elem = t.element_size();
  bool ok = reinterpret_cast<std::uintptr_t>(t.data()) % kVectorBytes == 0 &&
            (t.size(t.dim() - 1) * elem) % static_cast<std::int64_t>(kVectorBytes) == 0;
  for (int d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.stride(d) * elem) % static_cast<std::int64_t>(kVectorBytes) == 0;
  return ok;
}

class FlashImpl final : public AttentionImpl {
 public:
  FlashImpl(AttentionImplParams params, const AttentionBackend& backend)
      : AttentionImpl(std::move(params)), backend_(backend) {
    const AttentionImplParams& p = params_;
    check_impl_params(kImplWhere, p);
    check_arg(p.device.is_cuda(), kImplWhere, "device", "a CUDA device", p.device);
    require_supported(backend_.problem_support(make_attention_problem(p, 0, nullptr, false, false)), backend_.name());
    // Per-head constants live on the device for the whole life of the layer.
    if (!p.alibi_slopes.empty()) {
      alibi_ = Tensor::from_floats(p.alibi_slopes, {p.num_heads}, DType::F32, p.device);
    }
    if (!p.sinks.empty()) sinks_ = Tensor::from_floats(p.sinks, {p.num_heads}, DType::F32, p.device);
  }

  void check_forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                     const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                     const TensorView& output, const TensorView& lse) const override;
  void forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key, const TensorView& value,
               const KVCacheView& kv_cache, const BackendMetadata& metadata, const TensorView& output,
               const TensorView& lse) override;

  void do_kv_cache_update(const LayerQuantState& layer, const TensorView& key, const TensorView& value,
                          const KVCacheView& kv_cache, const TensorView& slot_mapping) override;

  std::string_view class_name() const override { return "CudaFlashAttentionImpl"; }

 private:
  // What forward derives while checking its arguments.
  struct CheckedForward {
    const FlashMetadata* plan = nullptr;
    int tokens = 0;
    ForwardShape shape;
    bool kv_rows_16b = false;  // choose_kernel's kv_rows_16b
  };
  CheckedForward check(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                       const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                       const TensorView& output, const TensorView& lse) const;

  const AttentionBackend& backend_;
  Tensor alibi_;
  Tensor sinks_;
};

FlashImpl::CheckedForward FlashImpl::check(const LayerQuantState& layer, const TensorView& query,
                                            const TensorView& key, const TensorView& value,
                                            const KVCacheView& kv_cache, const BackendMetadata& metadata,
                                            const TensorView& output, const TensorView& lse) const {
  const AttentionImplParams& p = params_;
  const auto* plan = dynamic_cast<const FlashMetadata*>(&metadata);
  check_arg(plan != nullptr, kForwardWhere, "metadata", "metadata built by the CUDA_FLASH builder",
            "metadata of another backend");
  check_arg(plan->head_size == p.head_size, kForwardWhere, "metadata head_size", p.head_size, plan->head_size);
  if (plan->cascade) check_cascade_layer(kForwardWhere, p);
  // The partial-output region holds plan->partial_heads query heads per token.
  if (plan->partial_token_rows > 0 && p.num_heads > plan->partial_heads) {
    throw_invalid(kForwardWhere, "metadata partial heads",
                  fmt::format(">= the layer's num_heads ({}): BuilderParams::num_heads is the largest of the layers",
                              p.num_heads),
                  std::to_string(plan->partial_heads));
  }
  if (reads_paged_cache(p.attn_type)) {
    check_arg(kv_cache.key_packing == KeyPacking::None, kForwardWhere, "kv_cache.key_packing",
              "none (CUDA_FLASH reads row-major K)", key_packing_name(kv_cache.key_packing));
  }
  const DType output_dtypes[] = {p.dtype};
  const ForwardShape shape = check_forward_args(kForwardWhere, p, p.device, layer, query, key, value, kv_cache,
                                                metadata, output, lse, output_dtypes, supports_quant_query_input());
  check_vector_aligned(query, "query");
  check_vector_aligned(output, "output");
  // The K/V the kernels read: the paged cache, or the step's own K/V.
  const TensorView& k_read = shape.paged ? kv_cache.key : key;
  const TensorView& v_read = shape.paged ? kv_cache.value : value;
  check_vector_aligned(k_read, shape.paged ? "kv_cache.key" : "key");
  check_vector_aligned(v_read, shape.paged ? "kv_cache.value" : "value");
  return {plan, metadata.common.num_actual_tokens, shape, rows_16b(k_read) && rows_16b(v_read)};
}

void FlashImpl::check_forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                              const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                              const TensorView& output, const TensorView& lse) const {
  static_cast<void>(check(layer, query, key, value, kv_cache, metadata, output, lse));
}

void FlashImpl::forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                        const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                        const TensorView& output, const TensorView& lse) {
  const CheckedForward checked = check(layer, query, key, value, kv_cache, metadata, output, lse);
  const AttentionImplParams& p = params_;
  const FlashMetadata* plan = checked.plan;
  const CommonAttentionMetadata& common = metadata.common;
  const int tokens = checked.tokens;
  const bool paged = checked.shape.paged;
  const Device device = p.device;
  const DType storage = checked.shape.cache_storage;
  const bool fp8 = checked.shape.fp8;
  const std::int64_t num_blocks = checked.shape.num_blocks;
  const int block_size = checked.shape.block_size;
  if (tokens == 0) return;

  FlashParams k;
  k.num_heads = p.num_heads;
  k.num_kv_heads = p.num_kv_heads;
  k.head_size = p.head_size;
  k.variant = make_attention_variant(p, common.causal,
                                     alibi_.defined() ? static_cast<const float*>(alibi_.data()) : nullptr,
                                     sinks_.defined() ? static_cast<const float*>(sinks_.data()) : nullptr,
                                     plan->mm_prefix);

  k.query = query.data();
  k.q_row_stride = query.stride(0);
  k.q_head_stride = query.stride(1);
  k.output = output.data();
  k.o_row_stride = output.stride(0);
  k.o_head_stride = output.stride(1);
  if (lse.defined()) {
    k.lse = static_cast<float*>(lse.data());
    k.lse_head_stride = lse.stride(0);
    k.lse_token_stride = lse.stride(1);
  }

  k.dense_kv = !paged;
  if (paged) {
    k.key = kv_cache.key.data();
    k.value = kv_cache.value.data();
    k.k_block_stride = kv_cache.key.stride(0);
    k.k_slot_stride = kv_cache.key.stride(1);
    k.k_head_stride = kv_cache.key.stride(2);
    k.v_block_stride = kv_cache.value.stride(0);
    k.v_slot_stride = kv_cache.value.stride(1);
    k.v_head_stride = kv_cache.value.stride(2);
    k.block_size = block_size;
    k.num_blocks = num_blocks;
    k.kv_dtype = storage;
    if (fp8) {
      k.k_scale = static_cast<const float*>(layer.k_scale.data());
      k.v_scale = static_cast<const float*>(layer.v_scale.data());
      k.kv_scale_stride = layer.k_scale.size(0) == 1 ? 0 : static_cast<int>(layer.k_scale.stride(0));
    }
    if (checked.shape.token_head_scales) {
      // [NB, Hkv, BS] f32 each; check_forward_args made their strides equal.
      const ScaleOperand ks = token_scale_operand(kv_cache.key_scale);
      k.k_token_scale = ks.data;
      k.v_token_scale = static_cast<const float*>(kv_cache.value_scale.data());
      k.scale_block_stride = ks.block_stride;
      k.scale_slot_stride = ks.slot_stride;
      k.scale_head_stride = ks.head_stride;
    }
  } else {
    k.key = key.data();
    k.value = value.data();
    k.k_slot_stride = key.stride(0);
    k.k_head_stride = key.stride(1);
    k.v_slot_stride = value.stride(0);
    k.v_head_stride = value.stride(1);
    k.kv_dtype = p.dtype;
  }

  k.header = plan->header;
  k.items = plan->items;
  k.combine = plan->combine;
  k.block_table = plan->block_table;
  k.partial_out = plan->partial_out;
  k.partial_lse = plan->partial_lse;
  k.kernel = choose_kernel(head_size_class(p.head_size), checked.shape.token_head_scales, plan->decode_only,
                           plan->prefill_only, plan->sm_version, plan->batch_invariant, checked.kv_rows_16b);

  cuda::DeviceGuard guard(device.index);
  const auto stream = static_cast<cudaStream_t>(cuda::current_stream());
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda::check_cuda(cudaStreamIsCapturing(stream, &capture), kForwardWhere);
  // A captured step is replayed with later plans (launch_item_slots).
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  k.grid_items = launch_item_slots(plan->num_items, p.num_kv_heads, plan->num_sms, kCaptureCtasPerSm, capturing);
  k.grid_combine = launch_item_slots(plan->num_combine, p.num_kv_heads, plan->num_sms, kCaptureCtasPerSm, capturing);
  k.num_sms = plan->num_sms;

  const int status = launch_flash_attention(k, p.dtype, k.grid_combine > 0, stream);
  if (status == kLaunchUnsupportedHeadSize || status == kLaunchUnsupportedDType) {
    throw_unsupported(kForwardWhere, fmt::format("no kernel instantiated for head_size {} and dtype {}", p.head_size,
                                                 p.dtype));
  }
  cuda::check_cuda(status, kForwardWhere);
}

void FlashImpl::do_kv_cache_update(const LayerQuantState& layer, const TensorView& key, const TensorView& value,
                                   const KVCacheView& kv_cache, const TensorView& slot_mapping) {
  // Shapes are checked here and slots bounded in the kernel, so the update
  // needs no host copy of the slot mapping (it can be graph-captured).
  const AttentionImplParams& p = params_;
  const Device device = p.device;
  const DType storage = kv_cache_storage_dtype(p.kv_cache_dtype, p.dtype);
  check_arg(kv_cache.defined(), kUpdateWhere, "kv_cache", "a bound KV cache", "undefined");
  check_arg(kv_cache.key_packing == KeyPacking::None, kUpdateWhere, "kv_cache.key_packing",
            "none (CUDA_FLASH writes row-major K)", key_packing_name(kv_cache.key_packing));
  for (const auto& [t, name] : {std::pair{&key, "key"}, std::pair{&value, "value"}}) {
    check_rank(*t, kUpdateWhere, name, 3);
    check_dtype(*t, kUpdateWhere, name, p.dtype);
    check_device(*t, kUpdateWhere, name, device);
    check_size(*t, 1, kUpdateWhere, name, p.num_kv_heads);
    check_size(*t, 2, kUpdateWhere, name, p.head_size);
    check_last_dim_contiguous(*t, kUpdateWhere, name);
  }
  check_cache_half(kUpdateWhere, kv_cache.key, "kv_cache.key", device, storage, p.num_kv_heads, p.head_size);
  check_cache_half(kUpdateWhere, kv_cache.value, "kv_cache.value", device, storage, p.num_kv_heads, p.head_size);
  check_rank(slot_mapping, kUpdateWhere, "slot_mapping", 1);
  check_dtype(slot_mapping, kUpdateWhere, "slot_mapping", DType::I64);
  check_device(slot_mapping, kUpdateWhere, "slot_mapping", device);
  check_arg(slot_mapping.size(0) <= key.size(0), kUpdateWhere, "slot_mapping.size(0)",
            fmt::format("<= key.size(0) ({})", key.size(0)), slot_mapping.size(0));
  check_arg(value.size(0) == key.size(0), kUpdateWhere, "value.size(0)", key.size(0), value.size(0));
  const KVQuantMode mode = kv_quant_mode(p.kv_cache_dtype);
  if (mode == KVQuantMode::Fp8PerTensor) {
    check_kv_scale(kUpdateWhere, layer.k_scale, "k_scale", device, p.num_kv_heads);
    check_kv_scale(kUpdateWhere, layer.v_scale, "v_scale", device, p.num_kv_heads);
  } else if (mode != KVQuantMode::None) {
    check_token_scales(kUpdateWhere, kv_cache, p.kv_cache_dtype, device);
  }
  const KVWriteScales scales = kv_write_scales(p.kv_cache_dtype, layer, kv_cache);
  ops_impl(DeviceType::CUDA)
      .reshape_and_cache(key, value, kv_cache.key, kv_cache.value, slot_mapping, scales.k, scales.v, mode,
                         KeyPacking::None);
}

}  // namespace

std::unique_ptr<AttentionImpl> make_flash_impl(const AttentionImplParams& params, const AttentionBackend& backend) {
  return std::make_unique<FlashImpl>(params, backend);
}

}  // namespace pagedattn::cuda_flash
