// The Attention layer: constructor semantics of vLLM's Attention.__init__,
// the layer registry, forward through the forward context, and the per-step
// metadata helper.
#include <pagedattn/attention.h>
#include <pagedattn/ops.h>
#include <pagedattn/selector.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>

namespace pagedattn {
namespace {

constexpr float kUnitScale = 1.0f;

bool is_activation_dtype(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

// Every slot the cache update will write addresses the cache (kPadSlotId =
// skip). The values are read on the host (a device tensor through one copy),
// so a bad slot is rejected before any byte is written rather than bounded
// away inside a device kernel.
void check_slot_values(std::string_view where, const TensorView& slots, const KVCacheView& kv) {
  const std::int64_t num_slots = kv.num_blocks() * kv.block_size();
  const std::vector<std::uint8_t> bytes = to_byte_vector(slots);
  const std::size_t count = bytes.size() / sizeof(std::int64_t);
  for (std::size_t i = 0; i < count; ++i) {
    std::int64_t slot = 0;
    std::memcpy(&slot, bytes.data() + i * sizeof(std::int64_t), sizeof(slot));
    if (slot != kPadSlotId && (slot < 0 || slot >= num_slots)) {
      throw_invalid(where, fmt::format("slot_mapping[{}]", i), fmt::format("{} or in [0, {})", kPadSlotId, num_slots),
                    std::to_string(slot));
    }
  }
}

// vLLM's extract_layer_index: the one integer component of a dotted name
// ("model.layers.3.self_attn.attn" -> 3); nullopt when there is not exactly one.
std::optional<long> layer_index(std::string_view name) {
  std::optional<long> index;
  int count = 0;
  std::size_t start = 0;
  while (start <= name.size()) {
    const std::size_t end = std::min(name.find('.', start), name.size());
    const std::string_view part = name.substr(start, end - start);
    long value = 0;
    const auto [ptr, ec] = std::from_chars(part.data(), part.data() + part.size(), value);
    if (!part.empty() && ec == std::errc() && ptr == part.data() + part.size()) {
      index = value;
      ++count;
    }
    start = end + 1;
  }
  return count == 1 ? index : std::nullopt;
}

// vLLM's validate_kv_sharing_target, run before the layer registers itself.
void validate_kv_sharing_target(const ModelContext& model, const std::string& current,
                                const std::string& target, AttentionType attn_type) {
  const auto fail = [&](std::string_view reason) {
    throw Error(
        ErrorKind::InvalidArgument,
        fmt::format("Attention({}): kv_sharing_target_layer_name '{}' is not valid: target layer {} {}",
                    current, target, target, reason));
  };
  if (current == target) fail("cannot be the same as the current layer");
  const Attention* target_layer = model.find_layer(target);
  if (target_layer == nullptr) {
    // Unregistered: either it comes later in the model, or it does not exist.
    const auto current_index = layer_index(current);
    const auto target_index = layer_index(target);
    if (current_index && target_index && *current_index <= *target_index) {
      fail("must come before the current layer");
    }
    fail("is not a valid Attention layer in the model");
  }
  if (target_layer->attn_type() != attn_type) {
    fail(fmt::format("must be the same type as the current layer ({})", attention_type_name(attn_type)));
  }
}

void check_head_values(std::string_view where, std::string_view name,
                       const std::optional<std::vector<float>>& v, int num_heads) {
  if (!v) return;
  check_arg(static_cast<int>(v->size()) == num_heads, where, fmt::format("{} size", name),
            fmt::format("num_heads ({})", num_heads), v->size());
}

void check_scale_values(std::string_view where, std::string_view name, const std::vector<float>& values,
                        int num_kv_heads, bool per_head) {
  const bool size_ok = values.size() == 1 || (per_head && static_cast<int>(values.size()) == num_kv_heads);
  check_arg(size_ok, where, fmt::format("{} size", name),
            per_head ? fmt::format("1 or num_kv_heads ({})", num_kv_heads) : std::string("1"), values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    check_arg(std::isfinite(values[i]) && values[i] > 0.0f, where, fmt::format("{}[{}]", name, i),
              "a positive finite number", values[i]);
  }
}

KVCacheLayout resolve_layout(std::string_view where, const AttentionBackend& backend,
                             const std::optional<KVCacheLayout>& configured) {
  if (const auto required = backend.required_kv_cache_layout()) return *required;
  if (configured) return *configured;
  if (const char* env = std::getenv(kKVCacheLayoutEnv); env != nullptr && *env != '\0') {
    const auto parsed = parse_kv_cache_layout(env);
    check_arg(parsed.has_value(), where, kKVCacheLayoutEnv, "NHD or HND", env);
    return *parsed;
  }
  return KVCacheLayout::NHD;
}

// The explicitly passed backend (which must still fit the layer), else the
// selector's choice.
const AttentionBackend& choose_backend(std::string_view where, const SelectorConfig& selector,
                                       const AttentionBackend* explicit_backend, std::string_view requested) {
  if (explicit_backend == nullptr) return select_backend(selector, requested);
  check_arg(explicit_backend->device_type() == selector.device.type, where, "attn_backend device type",
            device_type_name(selector.device.type), device_type_name(explicit_backend->device_type()));
  const std::vector<std::string> reasons = explicit_backend->validate_configuration(selector);
  if (!reasons.empty()) {
    throw_unsupported(where, fmt::format("attn_backend {} does not support this layer: [{}]",
                                         explicit_backend->name(), fmt::join(reasons, ", ")));
  }
  return *explicit_backend;
}

// Views a [T, N*D] or [T, N, D] tensor as [T, N, D] with packed heads.
TensorView as_heads(const TensorView& t, std::string_view where, std::string_view name, int heads,
                    int head_size) {
  check_arg(t.dim() == 2 || t.dim() == 3, where, fmt::format("{} rank", name),
            fmt::format("2 ([T, {}]) or 3 ([T, {}, {}])", heads * head_size, heads, head_size), t.describe());
  check_last_dim_contiguous(t, where, name);
  if (t.dim() == 2) {
    check_size(t, 1, where, name, static_cast<std::int64_t>(heads) * head_size);
    return t.view({t.size(0), heads, head_size});
  }
  check_size(t, 1, where, name, heads);
  check_size(t, 2, where, name, head_size);
  return t;
}

}  // namespace

// ---------------------------------------------------------------- ModelContext

ModelContext::ModelContext(ModelOptions options) : options_(std::move(options)) {
  constexpr std::string_view where = "ModelContext";
  check_arg(options_.pipeline_parallel_size >= 1, where, "pipeline_parallel_size", ">= 1",
            options_.pipeline_parallel_size);
  check_arg(is_activation_dtype(options_.dtype), where, "dtype", "f32, f16 or bf16", options_.dtype);
}

ModelContext::~ModelContext() {
  for (Attention* layer : order_) layer->model_ = nullptr;
}

Attention* ModelContext::find_layer(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

Attention& ModelContext::layer(std::string_view name) const {
  Attention* found = find_layer(name);
  if (found == nullptr) {
    throw Error(
        ErrorKind::InvalidArgument,
        fmt::format("ModelContext::layer: no layer named '{}' ({} layers registered)", name, order_.size()));
  }
  return *found;
}

void ModelContext::register_layer(const std::string& name, Attention* layer) {
  if (by_name_.contains(name)) {
    throw Error(ErrorKind::InvalidArgument, fmt::format("Attention: Duplicate layer name: {}", name));
  }
  by_name_.emplace(name, layer);
  order_.push_back(layer);
}

void ModelContext::unregister_layer(const std::string& name) noexcept {
  const auto it = by_name_.find(name);
  if (it == by_name_.end()) return;
  order_.erase(std::remove(order_.begin(), order_.end(), it->second), order_.end());
  by_name_.erase(it);
}

// ------------------------------------------------------------------- Attention

Attention::Attention(ModelContext& model, int num_heads, int head_size, float scale, AttentionOptions options)
    : model_(&model),
      num_heads_(num_heads),
      head_size_(head_size),
      scale_(scale),
      attn_type_(options.attn_type),
      layer_name_(std::move(options.prefix)),
      forward_where_(fmt::format("Attention({}).forward", layer_name_)),
      kv_sharing_target_(std::move(options.kv_sharing_target_layer_name)),
      quant_config_(std::move(options.quant_config)),
      dtype_(model.dtype()),
      device_(model.device()) {
  const std::string where = fmt::format("Attention({})", layer_name_);
  check_arg(num_heads > 0, where, "num_heads", "> 0", num_heads);
  check_arg(head_size > 0, where, "head_size", "> 0", head_size);
  check_arg(std::isfinite(scale) && scale > 0.0f, where, "scale", "a positive finite number", scale);
  num_kv_heads_ = options.num_kv_heads.value_or(num_heads);
  check_arg(num_kv_heads_ > 0, where, "num_kv_heads", "> 0", num_kv_heads_);
  if (num_heads % num_kv_heads_ != 0) {
    throw Error(ErrorKind::InvalidArgument,
                fmt::format("{}: num_heads ({}) is not divisible by num_kv_heads ({})", where, num_heads,
                            num_kv_heads_));
  }
  check_head_values(where, "alibi_slopes", options.alibi_slopes, num_heads);
  check_head_values(where, "sinks", options.sinks, num_heads);
  has_sink_ = options.sinks.has_value();
  if (options.logits_soft_cap) {
    check_arg(std::isfinite(*options.logits_soft_cap) && *options.logits_soft_cap > 0.0f, where,
              "logits_soft_cap", "> 0 when set", *options.logits_soft_cap);
  }

  // Sliding window: the layer's own, else the model's, else none.
  const CacheConfig cache = options.cache_config.value_or(CacheConfig{});
  if (options.per_layer_sliding_window) {
    check_arg(*options.per_layer_sliding_window > 0, where, "per_layer_sliding_window", "> 0 when set",
              *options.per_layer_sliding_window);
    sliding_window_ = options.per_layer_sliding_window;
  } else if (cache.sliding_window) {
    check_arg(*cache.sliding_window > 0, where, "cache_config.sliding_window", "> 0 when set",
              *cache.sliding_window);
    sliding_window_ = cache.sliding_window;
  }
  if (cache.block_size) {
    check_arg(*cache.block_size > 0, where, "cache_config.block_size", "> 0 when set", *cache.block_size);
  }

  const bool per_head_scales = init_kv_cache_quant(where, cache);

  if (kv_sharing_target_) validate_kv_sharing_target(model, layer_name_, *kv_sharing_target_, attn_type_);
  if (model.find_layer(layer_name_) != nullptr) {
    throw Error(ErrorKind::InvalidArgument, fmt::format("Attention: Duplicate layer name: {}", layer_name_));
  }

  SelectorConfig selector;
  selector.head_size = head_size;
  selector.dtype = dtype_;
  selector.kv_cache_dtype = kv_cache_dtype_;
  selector.block_size = cache.block_size;
  selector.has_sink = has_sink_;
  selector.use_per_head_quant_scales = per_head_scales;
  selector.attn_type = attn_type_;
  selector.use_non_causal = options.use_non_causal;
  selector.use_mm_prefix = options.use_mm_prefix;
  selector.use_batch_invariant = model.batch_invariant();
  selector.device = device_;
  selector.capability = device_capability(device_);
  backend_ = &choose_backend(where, selector, options.attn_backend, model.requested_backend());
  // An unset block size follows the backend (vLLM's update_block_size_for_backend).
  block_size_ = cache.block_size.value_or(backend_->preferred_block_size(kDefaultBlockSize));
  kv_cache_layout_ = resolve_layout(where, *backend_, cache.kv_cache_layout);

  AttentionImplParams params;
  params.num_heads = num_heads;
  params.head_size = head_size;
  params.scale = scale;
  params.num_kv_heads = num_kv_heads_;
  params.alibi_slopes = options.alibi_slopes.value_or(std::vector<float>{});
  params.sliding_window = sliding_window_;
  params.kv_cache_dtype = kv_cache_dtype_;
  params.logits_soft_cap = options.logits_soft_cap;
  params.attn_type = attn_type_;
  params.kv_sharing_target_layer_name = kv_sharing_target_;
  params.sinks = options.sinks.value_or(std::vector<float>{});
  if (options.attention_chunk_size) {
    const int chunk = *options.attention_chunk_size;
    check_arg(chunk > 0 && chunk % block_size_ == 0, where, "attention_chunk_size",
              fmt::format("a positive multiple of the block size ({})", block_size_), chunk);
    check_arg(attn_type_ == AttentionType::Decoder, where, "attention_chunk_size", "unset for non-decoder attention",
              chunk);
    if (!backend_->supports_chunked_local_attention()) {
      throw_unsupported(where, fmt::format("backend {} does not run chunked local attention", backend_->name()));
    }
    params.attention_chunk_size = chunk;
  }
  if (options.use_mm_prefix) {
    check_arg(attn_type_ == AttentionType::Decoder && !options.use_non_causal, where, "use_mm_prefix",
              "only with causal decoder attention (PrefixLM widens a causal mask)",
              options.use_non_causal ? "with use_non_causal" : attention_type_name(attn_type_));
    check_arg(!options.attention_chunk_size, where, "use_mm_prefix",
              "not with attention_chunk_size (chunked local attention and PrefixLM do not compose)",
              fmt::format("with attention_chunk_size {}", options.attention_chunk_size.value_or(0)));
    params.use_mm_prefix = true;
  }
  params.dtype = dtype_;
  params.device = device_;
  // Features the selector does not ask about (window, soft cap, ALiBi) are
  // rejected here rather than at the first forward.
  require_supported(
      backend_->problem_support(make_attention_problem(params, block_size_, nullptr, false, per_head_scales)),
      backend_->name());
  impl_ = backend_->make_impl(params);
  check_arg(impl_ != nullptr, where, "attn_backend impl", "an impl", "null");
  quant_.quantize_query = impl_->quantizes_query();

  const auto engines = static_cast<std::size_t>(model.pipeline_parallel_size());
  kv_cache_.assign(engines, Tensor{});
  kv_cache_scales_.assign(engines, Tensor{});
  kv_cache_views_.assign(engines, KVCacheView{});
  model.register_layer(layer_name_, this);
}

// vLLM's _init_kv_cache_quant: the KV-cache dtype a quantization scheme
// implies, the checkpoint scales' shapes, and unit scale tensors. Returns
// whether the k/v scales are per KV head.
bool Attention::init_kv_cache_quant(std::string_view where, const CacheConfig& cache) {
  kv_cache_dtype_ = cache.cache_dtype;
  calculate_kv_scales_ = cache.calculate_kv_scales;
  bool per_head_scales = false;
  if (quant_config_) {
    const QuantConfig& qc = *quant_config_;
    const bool has_checkpoint_scales = qc.k_scale || qc.v_scale || qc.q_scale;
    check_arg(qc.has_kv_cache_scheme || !has_checkpoint_scales, where, "quant_config",
              "a KV-cache scheme when checkpoint scales are given", "scales without a scheme");
    if (qc.has_kv_cache_scheme) {
      if (kv_cache_dtype_ == CacheDType::Auto) {
        kv_cache_dtype_ = CacheDType::Fp8;
        calculate_kv_scales_ = false;
      }
      if (kv_cache_dtype_ == CacheDType::Fp8E5M2) {
        throw_unsupported(where, "fp8_e5m2 kv-cache is not supported with fp8 checkpoints");
      }
      per_head_scales = qc.per_head_scales;
    }
    check_arg(qc.k_scale.has_value() == qc.v_scale.has_value(), where, "quant_config.v_scale",
              "given together with quant_config.k_scale", qc.v_scale ? "only v_scale" : "only k_scale");
    if (qc.k_scale) {
      check_scale_values(where, "quant_config.k_scale", *qc.k_scale, num_kv_heads_, per_head_scales);
      check_scale_values(where, "quant_config.v_scale", *qc.v_scale, num_kv_heads_, per_head_scales);
      check_arg(qc.k_scale->size() == qc.v_scale->size(), where, "quant_config.v_scale size",
                fmt::format("quant_config.k_scale size ({})", qc.k_scale->size()), qc.v_scale->size());
    }
    if (qc.q_scale) check_scale_values(where, "quant_config.q_scale", {*qc.q_scale}, num_kv_heads_, false);
  }
  const std::int64_t kv_scale_size = per_head_scales ? num_kv_heads_ : 1;
  quant_.q_scale = Tensor::from_floats(std::vector<float>{kUnitScale}, {1}, DType::F32, device_);
  quant_.prob_scale = Tensor::from_floats(std::vector<float>{kUnitScale}, {1}, DType::F32, device_);
  const std::vector<float> unit_kv(static_cast<std::size_t>(kv_scale_size), kUnitScale);
  quant_.k_scale = Tensor::from_floats(unit_kv, {kv_scale_size}, DType::F32, device_);
  quant_.v_scale = Tensor::from_floats(unit_kv, {kv_scale_size}, DType::F32, device_);

  return per_head_scales;
}

Attention::~Attention() {
  if (model_ != nullptr) model_->unregister_layer(layer_name_);
}

DType Attention::kv_cache_storage_dtype() const {
  return pagedattn::kv_cache_storage_dtype(kv_cache_dtype_, dtype_);
}

Tensor Attention::forward(const TensorView& query, const TensorView& key, const TensorView& value,
                          const TensorView& output, const TensorView& lse) {
  const std::string_view where = forward_where_;
  check_arg(query.defined(), where, "query", "a tensor", "undefined");
  const TensorView q = as_heads(query, where, "query", num_heads_, head_size_);  // [T, H, D]
  check_dtype(q, where, "query", dtype_);
  check_device(q, where, "query", device_);
  const std::int64_t num_tokens = q.size(0);

  check_arg(key.defined() == value.defined(), where, "key and value", "both given or both undefined",
            key.defined() ? "only key" : "only value");
  const bool self_attention_without_cache =
      attn_type_ == AttentionType::Encoder || attn_type_ == AttentionType::EncoderOnly;
  check_arg(key.defined() || !self_attention_without_cache, where, "key", "given for encoder attention",
            "undefined");
  TensorView k;  // [Tk, Hkv, D]
  TensorView v;  // [Tk, Hkv, D]
  if (key.defined()) {
    k = as_heads(key, where, "key", num_kv_heads_, head_size_);
    v = as_heads(value, where, "value", num_kv_heads_, head_size_);
    check_dtype(k, where, "key", dtype_);
    check_dtype(v, where, "value", dtype_);
    check_device(k, where, "key", device_);
    check_device(v, where, "value", device_);
    check_size(v, 0, where, "value", k.size(0));
    // Cross-attention keys are the encoder tokens; otherwise one key per query.
    if (attn_type_ != AttentionType::EncoderDecoder) check_size(k, 0, where, "key", num_tokens);
  }

  const ForwardContext& context = get_forward_context();
  const BackendMetadata& metadata = context.metadata_for(layer_name_);
  const CommonAttentionMetadata& common = metadata.common;
  check_arg(common.num_actual_tokens <= num_tokens, where, "metadata num_actual_tokens",
            fmt::format("<= query tokens ({})", num_tokens), common.num_actual_tokens);
  const int engine = context.virtual_engine;
  check_arg(engine >= 0 && engine < num_virtual_engines(), where, "forward context virtual_engine",
            fmt::format("in [0, {})", num_virtual_engines()), engine);
  const KVCacheView& kv = kv_cache_views_[static_cast<std::size_t>(engine)];
  if (!self_attention_without_cache) {
    check_arg(kv.defined(), where, fmt::format("kv_cache[{}]", engine), "bound (allocate_kv_caches)",
              "unbound");
    check_arg(common.block_size == block_size_, where, "metadata block_size",
              fmt::format("the layer's block size ({})", block_size_), common.block_size);
  }

  TensorView out;  // [T, H, D]
  Tensor allocated;
  if (output.defined()) {
    out = as_heads(output, where, "output", num_heads_, head_size_);
    check_size(out, 0, where, "output", num_tokens);
    check_dtype(out, where, "output", q.dtype());
    check_device(out, where, "output", device_);
    // The result is returned as [T, H*D], which needs packed heads.
    check_arg(out.stride(1) == head_size_, where, "output stride(1)", head_size_, out.stride(1));
  } else {
    allocated = Tensor::empty({num_tokens, num_heads_, head_size_}, q.dtype(), device_);
    out = allocated;
  }
  if (lse.defined()) {
    check_arg(backend_->can_return_lse(), where, "lse",
              fmt::format("undefined (backend {} cannot return it)", backend_->name()), lse.describe());
    check_rank(lse, where, "lse", 2);
    check_size(lse, 0, where, "lse", num_heads_);
    check_size(lse, 1, where, "lse", num_tokens);
    check_dtype(lse, where, "lse", DType::F32);
    check_device(lse, where, "lse", device_);
  }

  const bool writes_cache = k.defined() && !kv_sharing_target_ && !self_attention_without_cache &&
                            !backend_->forward_includes_kv_cache_update();
  const Tensor* layer_slots = context.slot_mapping_for(layer_name_);
  const TensorView& slots = layer_slots != nullptr ? *layer_slots : common.slot_mapping;  // [N] i64
  if (writes_cache) {
    check_rank(slots, where, "slot_mapping", 1);
    check_dtype(slots, where, "slot_mapping", DType::I64);
    check_device(slots, where, "slot_mapping", device_);
    check_arg(slots.size(0) <= k.size(0), where, "slot_mapping size",
              fmt::format("<= key tokens ({})", k.size(0)), slots.size(0));
    check_slot_values(where, slots, kv);
  }
  // The impl's own checks (metadata against the cache, its kernels' limits)
  // run before the cache update too, so a rejected forward writes nothing.
  check_planned_forward(*impl_, quant_, q, k, v, kv, metadata, out, lse);

  // Every argument is valid: from here on state changes.
  if (calculate_kv_scales_ && k.defined()) calc_kv_scales(q, k, v);
  if (writes_cache) impl_->do_kv_cache_update(quant_, k, v, kv, slots);
  planned_forward(*impl_, quant_, q, k, v, kv, metadata, out, lse);

  const TensorView flat = out.view({num_tokens, static_cast<std::int64_t>(num_heads_) * head_size_});
  return output.defined() ? Tensor(Tensor{}, flat) : Tensor(allocated, flat);
}

void Attention::set_scales(float q, const std::vector<float>& k, const std::vector<float>& v) {
  const auto apply = [&](const Tensor& target, const std::vector<float>& values) {
    if (values.size() == 1) {
      fill_tensor(target, values[0]);
    } else {
      copy_tensor(target, Tensor::from_floats(values, {static_cast<std::int64_t>(values.size())}, DType::F32,
                                              target.device()));
    }
    // Per-head scales keep the largest one as the float copy (the per-tensor
    // bound); impls that honour per-head scales read the tensor.
    return *std::max_element(values.begin(), values.end());
  };
  fill_tensor(quant_.q_scale, q);
  quant_.q_scale_float = q;
  quant_.k_scale_float = apply(quant_.k_scale, k);
  quant_.v_scale_float = apply(quant_.v_scale, v);
  fill_tensor(quant_.prob_scale, kUnitScale);
  quant_.prob_scale_float = kUnitScale;
}

void Attention::calc_kv_scales(const TensorView& query, const TensorView& key, const TensorView& value) {
  const KVScales scales = pagedattn::calc_kv_scales(query, key, value);
  set_scales(scales.q_scale, {scales.k_scale}, {scales.v_scale});
  calculate_kv_scales_ = false;
}

void Attention::process_weights_after_loading(DType act_dtype) {
  const std::vector<float> unit{kUnitScale};
  if (quant_config_ && quant_config_->k_scale) {
    set_scales(quant_config_->q_scale.value_or(kUnitScale), *quant_config_->k_scale, *quant_config_->v_scale);
  } else {
    set_scales(quant_config_ ? quant_config_->q_scale.value_or(kUnitScale) : kUnitScale, unit, unit);
  }
  impl_->process_weights_after_loading(act_dtype);
}

std::optional<KVCacheSpec> Attention::get_kv_cache_spec() const {
  if (kv_sharing_target_) return std::nullopt;
  const DType storage = kv_cache_storage_dtype();
  const KVQuantMode mode = kv_quant_mode(kv_cache_dtype_);
  switch (attn_type_) {
    case AttentionType::Decoder:
      if (sliding_window_) {
        return SlidingWindowSpec{.block_size = block_size_,
                                 .num_kv_heads = num_kv_heads_,
                                 .head_size = head_size_,
                                 .dtype = storage,
                                 .head_size_v = head_size_,
                                 .kv_quant_mode = mode,
                                 .sliding_window = *sliding_window_};
      }
      return FullAttentionSpec{.block_size = block_size_,
                               .num_kv_heads = num_kv_heads_,
                               .head_size = head_size_,
                               .dtype = storage,
                               .head_size_v = head_size_,
                               .kv_quant_mode = mode};
    case AttentionType::EncoderDecoder:
      return CrossAttentionSpec{.block_size = block_size_,
                                .num_kv_heads = num_kv_heads_,
                                .head_size = head_size_,
                                .dtype = storage,
                                .head_size_v = head_size_,
                                .kv_quant_mode = mode};
    case AttentionType::Encoder:
    case AttentionType::EncoderOnly:
      return std::nullopt;
  }
  return std::nullopt;
}

std::string Attention::extra_repr() const {
  const AttentionImplParams& p = impl_->params();
  return fmt::format("head_size={}, num_heads={}, num_kv_heads={}, scale={:g}, backend={}", p.head_size,
                     p.num_heads, p.num_kv_heads, p.scale, impl_->class_name());
}

void Attention::bind_kv_cache(int virtual_engine, const Tensor& kv_cache, const Tensor& kv_scales) {
  const std::string where = fmt::format("Attention({}).bind_kv_cache", layer_name_);
  check_virtual_engine(where, virtual_engine);
  check_arg(kv_cache.defined(), where, "kv_cache", "a tensor", "undefined");
  check_dtype(kv_cache, where, "kv_cache", kv_cache_storage_dtype());
  check_device(kv_cache, where, "kv_cache", device_);
  if (kv_cache_uses_per_token_head_scales(kv_cache_dtype_)) {
    check_arg(kv_scales.defined(), where, "kv_scales",
              fmt::format("a [NB, 2, {}, {}] f32 tensor ({}) for kv_cache_dtype {}", num_kv_heads_,
                          block_size_, kScaleDims, cache_dtype_name(kv_cache_dtype_)),
              "undefined");
    check_device(kv_scales, where, "kv_scales", device_);
  } else {
    check_arg(!kv_scales.defined(), where, "kv_scales",
              fmt::format("undefined for kv_cache_dtype {}", cache_dtype_name(kv_cache_dtype_)),
              kv_scales.describe());
  }
  const KVCacheView view = backend_->unbind_kv_cache(kv_cache, kv_scales);
  for (const auto& [half, name] :
       {std::pair{view.key, "kv_cache key half"}, std::pair{view.value, "kv_cache value half"}}) {
    check_rank(half, where, name, 4);
    check_size(half, 1, where, name, block_size_);
    check_size(half, 2, where, name, num_kv_heads_);
    check_size(half, 3, where, name, head_size_);
  }
  check_size(view.value, 0, where, "kv_cache value half", view.key.size(0));
  kv_cache_[static_cast<std::size_t>(virtual_engine)] = kv_cache;
  kv_cache_scales_[static_cast<std::size_t>(virtual_engine)] = kv_scales;
  kv_cache_views_[static_cast<std::size_t>(virtual_engine)] = view;
}

void Attention::check_virtual_engine(std::string_view where, int virtual_engine) const {
  check_arg(virtual_engine >= 0 && virtual_engine < num_virtual_engines(), where, "virtual_engine",
            fmt::format("in [0, {})", num_virtual_engines()), virtual_engine);
}

const Tensor& Attention::kv_cache(int virtual_engine) const {
  check_virtual_engine(fmt::format("Attention({}).kv_cache", layer_name_), virtual_engine);
  return kv_cache_[static_cast<std::size_t>(virtual_engine)];
}

const Tensor& Attention::kv_cache_scales(int virtual_engine) const {
  check_virtual_engine(fmt::format("Attention({}).kv_cache_scales", layer_name_), virtual_engine);
  return kv_cache_scales_[static_cast<std::size_t>(virtual_engine)];
}

const KVCacheView& Attention::kv_cache_view(int virtual_engine) const {
  check_virtual_engine(fmt::format("Attention({}).kv_cache_view", layer_name_), virtual_engine);
  return kv_cache_views_[static_cast<std::size_t>(virtual_engine)];
}

// -------------------------------------------------------- ModelMetadataBuilder

ModelMetadataBuilder::ModelMetadataBuilder(const ModelContext& model, std::vector<std::string> layer_names,
                                           bool cascade) {
  std::vector<const Attention*> layers;
  if (layer_names.empty()) {
    layers.assign(model.layers().begin(), model.layers().end());
  } else {
    for (const std::string& name : layer_names) layers.push_back(&model.layer(name));
  }
  using Key = std::tuple<const AttentionBackend*, int, int, int, int>;
  std::vector<Key> keys;
  for (const Attention* layer : layers) {
    const Key key{&layer->backend(), layer->block_size(), layer->num_kv_heads(), layer->head_size(),
                  layer->attention_chunk_size().value_or(0)};
    const auto it = std::find(keys.begin(), keys.end(), key);
    if (it != keys.end()) {
      groups_[static_cast<std::size_t>(it - keys.begin())].layers.push_back(layer);
      continue;
    }
    keys.push_back(key);
    groups_.push_back(Group{nullptr, {layer}, layer->attention_chunk_size().value_or(0)});
  }
  for (Group& group : groups_) {
    const Attention& first = *group.layers.front();
    BuilderParams params;
    params.block_size = first.block_size();
    params.num_kv_heads = first.num_kv_heads();
    params.head_size = first.head_size();
    params.device = model.device();
    params.batch_invariant = model.batch_invariant();
    // A cascade plan depends on which requests share a prefix: never batch-invariant.
    bool allow = cascade && !model.batch_invariant();
    for (const Attention* layer : group.layers) {
      params.layer_names.push_back(layer->layer_name());
      params.num_heads = std::max(params.num_heads, layer->num_heads());
      allow = allow && cascade_applies(layer->impl().params());
    }
    group.builder = std::make_unique<CascadeBuilder>(first.backend(), params, model.dtype(), allow);
  }
}

LayerMetadataMap ModelMetadataBuilder::build(const CommonAttentionMetadata& common) {
  // Every bound cache of the group must hold the addressed blocks.
  std::int64_t num_blocks = 0;
  for (const Group& group : groups_) {
    for (const Attention* layer : group.layers) {
      for (int engine = 0; engine < layer->num_virtual_engines(); ++engine) {
        const KVCacheView& kv = layer->kv_cache_view(engine);
        if (kv.defined())
          num_blocks = num_blocks == 0 ? kv.num_blocks() : std::min(num_blocks, kv.num_blocks());
      }
    }
  }
  common.validate("ModelMetadataBuilder::build", num_blocks);
  LayerMetadataMap result;
  // Chunked local layers read the step split into per-chunk virtual requests,
  // made once per chunk size.
  std::vector<std::pair<int, CommonAttentionMetadata>> split;
  for (Group& group : groups_) {
    const CommonAttentionMetadata* step = &common;
    if (group.chunk_size > 0) {
      auto it = std::find_if(split.begin(), split.end(), [&](const auto& s) { return s.first == group.chunk_size; });
      if (it == split.end()) {
        split.emplace_back(group.chunk_size, make_local_attention_virtual_batches(common, group.chunk_size));
        it = split.end() - 1;
      }
      step = &it->second;
    }
    const std::shared_ptr<const BackendMetadata> metadata = group.builder->build(*step);
    for (const Attention* layer : group.layers) result.emplace(layer->layer_name(), metadata);
  }
  return result;
}

bool ModelMetadataBuilder::last_step_used_cascade() const {
  return std::any_of(groups_.begin(), groups_.end(), [](const Group& g) { return g.builder->last_used_cascade(); });
}

}  // namespace pagedattn
