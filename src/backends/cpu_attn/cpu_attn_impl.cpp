#include "backends/cpu_attn/cpu_attn_impl.h"

#include <pagedattn/error.h>
#include <pagedattn/backend/impl_checks.h>
#include <pagedattn/ops.h>

#include "backends/cpu_attn/cpu_attn_metadata.h"
#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cpu_attn/kernels/cpu_attn_isa.h"
#include "backends/cpu_attn/kernels/cpu_attn_kernel.h"
#include "backends/cpu_attn/thread_pool.h"

#include <cstdlib>
#include <exception>

namespace pagedattn {

namespace {

constexpr std::string_view kWhere = "CPU_ATTN forward";

RowsOperand rows_operand(const TensorView& t) {  // [T, H, D]
  return {t.data(), t.dtype(), t.stride(0), t.stride(1)};
}

CacheOperand cache_operand(const TensorView& t) {  // [NB, BS, Hkv, D]
  return {t.data(), t.stride(0), t.stride(1), t.stride(2)};
}

}  // namespace

void apply_cpu_isa_from_env() {
  // The static caches the outcome, a failure as its exception, and never
  // lets the initializer throw: one that throws leaves its guard to the next
  // caller, and under TSan a caller waiting on that guard in another thread is
  // never woken (the conformance runner constructs impls from several threads).
  static const std::exception_ptr failure = []() -> std::exception_ptr {
    try {
      const char* value = std::getenv(kCpuIsaEnv);
      if (value == nullptr || *value == '\0') return nullptr;
      const auto isa = cpu_attn::parse_isa(value);
      check_arg(isa.has_value(), "CPU_ATTN", kCpuIsaEnv, "avx512bf16, avx512, avx2 or scalar",
                fmt::format("'{}'", value));
      if (!cpu_attn::set_isa(*isa)) {
        throw_unsupported("CPU_ATTN", fmt::format("{}={} is not available on this CPU or build", kCpuIsaEnv, value));
      }
      return nullptr;
    } catch (...) {
      return std::current_exception();
    }
  }();
  if (failure) std::rethrow_exception(failure);
}

CpuAttnImpl::CpuAttnImpl(AttentionImplParams params)
    : AttentionImpl(std::move(params)),
      kv_storage_dtype_(kv_cache_storage_dtype(params_.kv_cache_dtype, params_.dtype)),
      dense_keys_(params_.attn_type == AttentionType::Encoder || params_.attn_type == AttentionType::EncoderOnly) {
  apply_cpu_isa_from_env();
  check_impl_params("CpuAttnImpl", params_);
}

ForwardShape CpuAttnImpl::check(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                                const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                                const TensorView& output, const TensorView& lse) const {
  const auto* md = dynamic_cast<const CpuAttnMetadata*>(&metadata);
  check_arg(md != nullptr, kWhere, "metadata", "CPU_ATTN metadata (from its builder)", "another backend's metadata");
  check_arg(md->num_kv_heads == params_.num_kv_heads, kWhere, "metadata num_kv_heads", params_.num_kv_heads,
            md->num_kv_heads);
  const DType output_dtypes[] = {params_.dtype};
  return check_forward_args(kWhere, params_, Device::cpu(), layer, query, key, value, kv_cache, *md, output,
                            lse, output_dtypes, supports_quant_query_input());
}

void CpuAttnImpl::check_forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                                const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                                const TensorView& output, const TensorView& lse) const {
  static_cast<void>(check(layer, query, key, value, kv_cache, metadata, output, lse));
}

void CpuAttnImpl::forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                          const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                          const TensorView& output, const TensorView& lse) {
  const ForwardShape shape = check(layer, query, key, value, kv_cache, metadata, output, lse);
  const auto& md = static_cast<const CpuAttnMetadata&>(metadata);
  const CommonAttentionMetadata& common = md.common;
  const cpu_attn::WorkList& plan = md.work;
  const int num_heads = params_.num_heads;
  const int kv_heads = params_.num_kv_heads;
  const int head_size = params_.head_size;

  cpu_attn::AttentionParams p;
  p.num_heads = num_heads;
  p.num_kv_heads = kv_heads;
  p.head_size = head_size;
  p.variant = make_attention_variant(params_, common.causal,
                                     params_.alibi_slopes.empty() ? nullptr : params_.alibi_slopes.data(),
                                     params_.sinks.empty() ? nullptr : params_.sinks.data(),
                                     host_mm_prefix_ranges(common));
  p.query_start_loc = common.query_start_loc_host().data();
  p.seq_lens = common.seq_lens_host().data();
  p.query = rows_operand(query);

  if (dense_keys_) {
    p.key = rows_operand(key);
    p.value = rows_operand(value);
    p.kv_dtype = params_.dtype;
  } else {
    p.block_table = common.block_table_cpu.data_as<const std::int32_t>();
    p.block_table_row_stride = common.block_table_cpu.stride(0);
    p.block_size = common.block_size;
    p.key_cache = cache_operand(kv_cache.key);
    p.key_cache.packing = kv_cache.key_packing;
    p.value_cache = cache_operand(kv_cache.value);
    p.kv_dtype = kv_storage_dtype_;
    if (shape.fp8) {
      p.k_scale = layer.k_scale.data_as<const float>();
      p.v_scale = layer.v_scale.data_as<const float>();
      p.per_head_kv_scales = shape.per_head_kv_scales;
    }
    if (shape.token_head_scales) {
      p.k_token_scale = token_scale_operand(kv_cache.key_scale);
      p.v_token_scale = token_scale_operand(kv_cache.value_scale);
    }
  }
  p.output = output.data();
  p.output_row_stride = output.stride(0);
  p.output_head_stride = output.stride(1);
  if (lse.defined()) {
    p.lse = lse.data_as<float>();
    p.lse_head_stride = lse.stride(0);
    p.lse_token_stride = lse.stride(1);
  }

  // The metadata's workspace, sized by the builder for its largest layer.
  const cpu_attn::Workspace& workspace = *md.workspace;
  const int group = num_heads / kv_heads;
  if (!workspace.size().holds(cpu_attn::plan_workspace(plan, head_size, group, 1))) {
    throw_invalid(kWhere, "metadata", "a builder whose num_heads and head_size cover the layer's",
                  fmt::format("num_heads {}, head_size {}", num_heads, head_size));
  }
  const cpu_attn::Workspace::Use use(workspace);
  const cpu_attn::PartialState partials{workspace.partials(), group};
  const cpu_attn::KernelVariant variant = cpu_attn::choose_kernel_variant(p, cpu_attn::active_isa());
  cpu_attn::ThreadPool& pool = cpu_attn::ThreadPool::instance();
  pool.run_slots(static_cast<int>(plan.items.size()), workspace.size().thread_slots, [&](int i, int slot) {
    cpu_attn::run_work_item(p, variant, plan.items[static_cast<std::size_t>(i)], partials, workspace.scratch(slot));
  });
  pool.run(static_cast<int>(plan.merges.size()),
           [&](int i) { cpu_attn::run_merge_item(p, plan.merges[static_cast<std::size_t>(i)], partials); });
}

void CpuAttnImpl::do_kv_cache_update(const LayerQuantState& layer, const TensorView& key, const TensorView& value,
                                     const KVCacheView& kv_cache, const TensorView& slot_mapping) {
  const KVWriteScales scales = kv_write_scales(params_.kv_cache_dtype, layer, kv_cache);
  reshape_and_cache(key, value, kv_cache.key, kv_cache.value, slot_mapping, params_.kv_cache_dtype, scales.k,
                    scales.v, kv_cache.key_packing);
}

}  // namespace pagedattn
