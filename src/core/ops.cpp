// Front-ends of the cache and state ops: every argument is validated here,
// before any implementation touches memory, so a rejected call changes
// nothing. The implementation is then chosen by the tensors' device type.
//
// Slot and block indices (and fp8 scales) are checked against the cache by
// reading their values on the host. For tensors on a device this copies them
// to the host and synchronizes. That host read happens only here, in the
// validating front-ends; a path that must not sync (CUDA graph capture) has
// to call the device's OpsImpl directly, with slots validated when the step's
// metadata was built.
#include <pagedattn/backend/backend.h>
#include <pagedattn/ops.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops/cpu/cpu_ops.h"

namespace pagedattn {
namespace {

constexpr int kNumDeviceTypes = 2;         // DeviceType::CPU, DeviceType::CUDA
constexpr int kBlockMappingPairWidth = 2;  // (src, dst)

std::array<std::atomic<OpsImpl*>, kNumDeviceTypes>& ops_registry() {
  static std::array<std::atomic<OpsImpl*>, kNumDeviceTypes> registry{};
  return registry;
}

bool is_activation_dtype(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

void check_activation_dtype(const TensorView& t, std::string_view where, std::string_view name) {
  if (!is_activation_dtype(t.dtype())) {
    throw_invalid(where, fmt::format("{} dtype", name), "f32, f16 or bf16", dtype_name(t.dtype()));
  }
}

void check_same_shape(const TensorView& t, const TensorView& like, std::string_view where,
                      std::string_view name, std::string_view like_name) {
  if (t.shape() != like.shape()) {
    throw_invalid(where, fmt::format("{} shape", name),
                  fmt::format("{} (the shape of {})", like.shape().str(), like_name), t.shape().str());
  }
}

// Host copy of an i64 tensor's values (row-major).
std::vector<std::int64_t> host_i64(const TensorView& t) {
  const std::vector<std::uint8_t> bytes = to_byte_vector(t);
  std::vector<std::int64_t> values(bytes.size() / sizeof(std::int64_t));
  // An empty tensor's vectors may hold null pointers, which memcpy must not
  // get even for zero bytes.
  if (!values.empty()) std::memcpy(values.data(), bytes.data(), values.size() * sizeof(std::int64_t));
  return values;
}

// The cache element type a CacheDType requires, or nullopt for Auto (any: it
// then only has to match the key).
std::optional<DType> required_cache_dtype(CacheDType kv_cache_dtype, DType key_dtype) {
  if (kv_cache_dtype == CacheDType::Auto) return std::nullopt;
  return kv_cache_storage_dtype(kv_cache_dtype, key_dtype);
}

void check_scale(const TensorView& scale, std::string_view where, std::string_view name, Device device,
                 std::int64_t num_kv_heads, bool quantized, CacheDType kv_cache_dtype) {
  if (!scale.defined()) {
    if (!quantized) return;
    throw_invalid(where, name,
                  fmt::format("a [1] or [{}] f32 tensor for kv_cache_dtype {}", num_kv_heads,
                              cache_dtype_name(kv_cache_dtype)),
                  "undefined");
  }
  check_rank(scale, where, name, 1);
  check_device(scale, where, name, device);
  check_dtype(scale, where, name, DType::F32);
  if (scale.size(0) != 1 && scale.size(0) != num_kv_heads) {
    throw_invalid(where, fmt::format("{} size(0)", name), fmt::format("1 or {} (num_kv_heads)", num_kv_heads),
                  fmt::format("{}", scale.size(0)));
  }
}

void check_scale_values(const TensorView& scale, std::string_view where, std::string_view name) {
  const std::vector<float> values = to_float_vector(scale);
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!(values[i] > 0.0f) || std::isinf(values[i])) {
      throw_invalid(where, fmt::format("{}[{}]", name, i), "finite and > 0", fmt::format("{}", values[i]));
    }
  }
}

}  // namespace

void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping,
                       CacheDType kv_cache_dtype, const TensorView& k_scale, const TensorView& v_scale,
                       KeyPacking key_packing) {
  constexpr std::string_view where = "reshape_and_cache";
  check_rank(key, where, "key", 3);
  check_rank(value, where, "value", 3);
  check_rank(key_cache, where, "key_cache", 4);
  check_rank(value_cache, where, "value_cache", 4);
  check_rank(slot_mapping, where, "slot_mapping", 1);

  const Device device = key.device();
  check_device(value, where, "value", device);
  check_device(key_cache, where, "key_cache", device);
  check_device(value_cache, where, "value_cache", device);
  check_device(slot_mapping, where, "slot_mapping", device);

  check_activation_dtype(key, where, "key");
  check_dtype(value, where, "value", key.dtype());
  check_dtype(slot_mapping, where, "slot_mapping", DType::I64);
  if (const std::optional<DType> required = required_cache_dtype(kv_cache_dtype, key.dtype())) {
    if (key_cache.dtype() != *required) {
      throw_invalid(where, "key_cache dtype",
                    fmt::format("{} (kv_cache_dtype {})", *required, cache_dtype_name(kv_cache_dtype)),
                    dtype_name(key_cache.dtype()));
    }
  }
  const bool quantized = is_quantized_kv_cache(kv_cache_dtype);
  // Unquantized caches store the key's bits unchanged, so the types must agree.
  if (!quantized) check_dtype(key, where, "key", key_cache.dtype());
  check_dtype(value_cache, where, "value_cache", key_cache.dtype());

  const std::int64_t num_tokens = key.size(0);
  const std::int64_t num_kv_heads = key.size(1);
  const std::int64_t head_size = key.size(2);
  check_same_shape(value, key, where, "value", "key");
  check_size(key_cache, 2, where, "key_cache", num_kv_heads);
  check_size(key_cache, 3, where, "key_cache", head_size);
  check_same_shape(value_cache, key_cache, where, "value_cache", "key_cache");
  check_last_dim_contiguous(key, where, "key");
  check_last_dim_contiguous(value, where, "value");
  check_last_dim_contiguous(key_cache, where, "key_cache");
  check_last_dim_contiguous(value_cache, where, "value_cache");
  if (slot_mapping.size(0) > num_tokens) {
    throw_invalid(where, "slot_mapping size(0)", fmt::format("<= {} (key size(0))", num_tokens),
                  fmt::format("{}", slot_mapping.size(0)));
  }

  const KVQuantMode mode = kv_quant_mode(kv_cache_dtype);
  if (kv_cache_uses_per_token_head_scales(kv_cache_dtype)) {
    check_token_scale_half(where, "k_scale", k_scale, key_cache, kv_cache_dtype, device);
    check_token_scale_half(where, "v_scale", v_scale, key_cache, kv_cache_dtype, device);
  } else {
    check_scale(k_scale, where, "k_scale", device, num_kv_heads, quantized, kv_cache_dtype);
    check_scale(v_scale, where, "v_scale", device, num_kv_heads, quantized, kv_cache_dtype);
    if (k_scale.defined() && v_scale.defined())
      check_same_shape(v_scale, k_scale, where, "v_scale", "k_scale");
    if (quantized) {
      check_scale_values(k_scale, where, "k_scale");
      check_scale_values(v_scale, where, "v_scale");
    }
  }

  check_key_packing(where, key_cache, key_packing);
  check_arg(key_packing == KeyPacking::None || !kv_cache_uses_per_token_head_scales(kv_cache_dtype), where,
            "key_packing", "none (per-token-head caches keep K row-major)", key_packing_name(key_packing));
  check_arg(ops_impl(device.type).writes_key_packing(key_packing), where, "key_packing",
            fmt::format("none (the {} cache op writes row-major K)", device_type_name(device.type)),
            key_packing_name(key_packing));

  const std::int64_t num_blocks = key_cache.size(0);
  const std::int64_t block_size = key_cache.size(1);
  const std::int64_t num_slots = num_blocks * block_size;
  const std::vector<std::int64_t> slots = host_i64(slot_mapping);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] >= num_slots) {
      throw_invalid(where, fmt::format("slot_mapping[{}]", i),
                    fmt::format("< {} (num_blocks {} * block_size {}), or < 0 to skip", num_slots, num_blocks,
                                block_size),
                    fmt::format("{}", slots[i]));
    }
  }

  ops_impl(device.type)
      .reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, mode,
                         key_packing);
}

void merge_attn_states(const TensorView& output, const TensorView& prefix_output,
                       const TensorView& prefix_lse, const TensorView& suffix_output,
                       const TensorView& suffix_lse, const TensorView& output_lse) {
  constexpr std::string_view where = "merge_attn_states";
  check_rank(output, where, "output", 3);
  check_rank(prefix_output, where, "prefix_output", 3);
  check_rank(suffix_output, where, "suffix_output", 3);
  check_rank(prefix_lse, where, "prefix_lse", 2);
  check_rank(suffix_lse, where, "suffix_lse", 2);
  if (output_lse.defined()) check_rank(output_lse, where, "output_lse", 2);

  const Device device = output.device();
  check_device(prefix_output, where, "prefix_output", device);
  check_device(suffix_output, where, "suffix_output", device);
  check_device(prefix_lse, where, "prefix_lse", device);
  check_device(suffix_lse, where, "suffix_lse", device);
  if (output_lse.defined()) check_device(output_lse, where, "output_lse", device);

  check_activation_dtype(output, where, "output");
  check_dtype(prefix_output, where, "prefix_output", output.dtype());
  check_dtype(suffix_output, where, "suffix_output", output.dtype());
  check_dtype(prefix_lse, where, "prefix_lse", DType::F32);
  check_dtype(suffix_lse, where, "suffix_lse", DType::F32);
  if (output_lse.defined()) check_dtype(output_lse, where, "output_lse", DType::F32);

  check_same_shape(prefix_output, output, where, "prefix_output", "output");
  check_same_shape(suffix_output, output, where, "suffix_output", "output");
  const std::int64_t num_tokens = output.size(0);
  const std::int64_t num_heads = output.size(1);
  for (const auto& [lse, name] : {std::pair{&prefix_lse, "prefix_lse"}, std::pair{&suffix_lse, "suffix_lse"},
                                  std::pair{&output_lse, "output_lse"}}) {
    if (!lse->defined()) continue;
    check_size(*lse, 0, where, name, num_heads);
    check_size(*lse, 1, where, name, num_tokens);
  }
  check_last_dim_contiguous(output, where, "output");
  check_last_dim_contiguous(prefix_output, where, "prefix_output");
  check_last_dim_contiguous(suffix_output, where, "suffix_output");

  ops_impl(device.type)
      .merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse);
}

void copy_blocks(const std::vector<TensorView>& caches, const TensorView& block_mapping) {
  constexpr std::string_view where = "copy_blocks";
  check_rank(block_mapping, where, "block_mapping", 2);
  check_size(block_mapping, 1, where, "block_mapping", kBlockMappingPairWidth);
  check_dtype(block_mapping, where, "block_mapping", DType::I64);
  const Device device = block_mapping.device();
  if (caches.empty()) return;
  const std::int64_t num_blocks = caches.front().defined() ? caches.front().size(0) : 0;
  for (std::size_t i = 0; i < caches.size(); ++i) {
    const std::string name = fmt::format("caches[{}]", i);
    if (!caches[i].defined()) throw_invalid(where, name, "a defined tensor [NB, ...]", "undefined");
    check_device(caches[i], where, name, device);
    check_size(caches[i], 0, where, name, num_blocks);
  }
  const std::vector<std::int64_t> pairs = host_i64(block_mapping);
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    if (pairs[i] < 0 || pairs[i] >= num_blocks) {
      throw_invalid(
          where, fmt::format("block_mapping[{}][{}]", i / kBlockMappingPairWidth, i % kBlockMappingPairWidth),
          fmt::format("in [0, {}) (num_blocks)", num_blocks), fmt::format("{}", pairs[i]));
    }
  }
  ops_impl(device.type).copy_blocks(caches, block_mapping);
}

void index_select(const TensorView& dst, const TensorView& src, int dim, const TensorView& index,
                  float fill_value) {
  constexpr std::string_view where = "index_select";
  check_arg(dst.defined(), where, "dst", "a defined tensor", "undefined");
  check_rank(src, where, "src", dst.dim());
  check_arg(dim >= 0 && dim < dst.dim(), where, "dim", fmt::format("in [0, {}) (dst rank)", dst.dim()), dim);
  check_rank(index, where, "index", 1);
  check_dtype(src, where, "src", dst.dtype());
  check_dtype(index, where, "index", DType::I32);
  check_device(src, where, "src", dst.device());
  check_device(index, where, "index", dst.device());
  check_size(index, 0, where, "index", dst.size(dim));
  for (int d = 0; d < dst.dim(); ++d) {
    if (d != dim) check_size(src, d, where, "src", dst.size(d));
  }
  std::uint64_t fill_bits = 0;
  store_from_float(&fill_bits, dst.dtype(), fill_value);
  ops_impl(dst.device().type).index_select(dst, src, dim, index, fill_bits);
}

KVScales calc_kv_scales(const TensorView& query, const TensorView& key, const TensorView& value) {
  constexpr std::string_view where = "calc_kv_scales";
  const std::array<std::pair<const TensorView*, std::string_view>, 3> inputs{
      {{&query, "query"}, {&key, "key"}, {&value, "value"}}};
  for (const auto& [t, name] : inputs) {
    if (!t->defined()) throw_invalid(where, name, "a defined tensor", "undefined");
    check_activation_dtype(*t, where, name);
    check_device(*t, where, name, query.device());
  }
  OpsImpl& impl = ops_impl(query.device().type);
  // vLLM's max|x| / range; an all-zero (or empty) input carries no range
  // information, so its scale stays at the neutral 1 instead of becoming a
  // zero that every later fp8 store would divide by.
  const auto scale = [&](const TensorView& t, float range) {
    const float amax = impl.abs_max(t);
    return amax == 0.0f ? 1.0f : amax / range;
  };
  return KVScales{scale(query, kQScaleRange), scale(key, kKScaleRange), scale(value, kVScaleRange)};
}

void register_ops_impl(DeviceType type, OpsImpl* impl) {
  ops_registry()[static_cast<std::size_t>(type)].store(impl);
}

OpsImpl& ops_impl(DeviceType type) {
  if (OpsImpl* impl = ops_registry()[static_cast<std::size_t>(type)].load()) return *impl;
  if (type == DeviceType::CPU) return cpu_ops_impl();
  throw_unsupported(
      "ops_impl", fmt::format("no ops implementation registered for device type {}", device_type_name(type)));
}

}  // namespace pagedattn
