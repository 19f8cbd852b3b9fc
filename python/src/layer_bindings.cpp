// The layer API from Python: ModelContext, the Attention layer (vLLM's seed
// constructor), its caches (allocate_kv_caches), a Step (one step's metadata
// for every layer of a model, ModelMetadataBuilder's output) and the KV cache
// manager that hands out blocks and block tables.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <pagedattn/attention.h>
#include <pagedattn/kv_cache.h>
#include <pagedattn/kv_cache_manager.h>

#include <memory>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "tensor_arg.h"

namespace pagedattn::python {
namespace {

constexpr std::string_view kForwardWhere = "Attention.forward";

// A tensor the library owns, handed to Python without a copy: the capsule
// keeps the storage alive while any array viewing it lives. CPU tensors
// become NumPy arrays (bf16 as its uint16 bits, fp8 as bytes: NumPy has no
// such dtypes of its own), CUDA tensors PyTorch tensors.
nb::object to_array(const Tensor& t) {
  auto* owner = new Tensor(t);
  nb::capsule capsule(owner, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  std::vector<std::size_t> shape(t.shape().begin(), t.shape().end());
  std::vector<std::int64_t> strides(t.strides().begin(), t.strides().end());
  const bool cuda = t.device().is_cuda();
  nb::dlpack::dtype dt{};
  switch (t.dtype()) {
    case DType::F32: dt = nb::dtype<float>(); break;
    case DType::I32: dt = nb::dtype<std::int32_t>(); break;
    case DType::I64: dt = nb::dtype<std::int64_t>(); break;
    case DType::I8: dt = nb::dtype<std::int8_t>(); break;
    case DType::F16: dt = {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1}; break;
    case DType::BF16:
      dt = cuda ? nb::dlpack::dtype{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1}
                : nb::dtype<std::uint16_t>();
      break;
    default: dt = nb::dtype<std::uint8_t>(); break;
  }
  if (cuda) {
    return nb::cast(nb::ndarray<nb::pytorch>(t.data(), t.dim(), shape.data(), capsule, strides.data(), dt,
                                             nb::device::cuda::value, t.device().index));
  }
  return nb::cast(nb::ndarray<nb::numpy>(t.data(), t.dim(), shape.data(), capsule, strides.data(), dt,
                                         nb::device::cpu::value, 0));
}

// One step's metadata for every layer of a model (vLLM's per-step
// attn_metadata), built from each request's (query_len, seq_len, blocks).
struct Step {
  LayerMetadataMap metadata;
  Device device;
  int num_tokens = 0;
};

Step make_step(const ModelContext& model, const std::vector<std::tuple<int, int, std::vector<std::int32_t>>>& requests,
               int block_size, bool causal) {
  std::vector<RequestSpec> specs;
  specs.reserve(requests.size());
  for (const auto& [query_len, seq_len, blocks] : requests) specs.push_back({query_len, seq_len, blocks});
  MetadataOptions options;
  options.block_size = block_size;
  options.causal = causal;
  options.device = model.device();
  const CommonAttentionMetadata common = make_common_metadata(specs, options);
  ModelMetadataBuilder builder(model);
  return {builder.build(common), model.device(), common.num_actual_tokens};
}

nb::object forward(Attention& layer, const Step& step, nb::handle query, nb::handle key, nb::handle value,
                   const nb::object& output, std::optional<std::uintptr_t> stream) {
  const TensorView out = view_of(output, kForwardWhere, "output");
  ForwardContext context;
  context.layer_metadata = step.metadata;
  context.stream = resolve_stream(step.device, stream, query);
  ForwardContextScope scope(std::move(context));
  Tensor result = layer.forward(view_of(query, kForwardWhere, "query"), view_of(key, kForwardWhere, "key"),
                                view_of(value, kForwardWhere, "value"), out);
  return output.is_none() ? to_array(result) : output;
}

AttentionOptions layer_options(std::optional<int> num_kv_heads,
                      std::optional<std::vector<float>> alibi_slopes, std::optional<int> block_size,
                      const std::string& cache_dtype, std::optional<float> logits_soft_cap,
                      std::optional<int> per_layer_sliding_window, const std::string& prefix,
                      const std::string& attn_type, std::optional<std::vector<float>> sinks,
                      std::optional<int> attention_chunk_size) {
  constexpr std::string_view where = "Attention";
  AttentionOptions o;
  o.num_kv_heads = num_kv_heads;
  o.alibi_slopes = std::move(alibi_slopes);
  CacheConfig cache;
  cache.block_size = block_size;
  cache.cache_dtype = cache_dtype_arg(cache_dtype, where, "cache_dtype");
  o.cache_config = cache;
  o.logits_soft_cap = logits_soft_cap;
  o.per_layer_sliding_window = per_layer_sliding_window;
  o.prefix = prefix;
  const std::optional<AttentionType> t = parse_attention_type(attn_type);
  if (!t) throw_invalid(where, "attn_type", "decoder, encoder, encoder_only or encoder_decoder", attn_type);
  o.attn_type = *t;
  o.sinks = std::move(sinks);
  o.attention_chunk_size = attention_chunk_size;
  return o;
}

// The model contexts entered with `with`, innermost last (vLLM's
// set_current_vllm_config): Attention without model= registers in the
// innermost one. Guarded by the GIL.
std::vector<ModelContext*>& entered_models() {
  static std::vector<ModelContext*> stack;
  return stack;
}

ModelContext& model_for(ModelContext* given) {
  if (given != nullptr) return *given;
  check_arg(!entered_models().empty(), "Attention", "model",
            "given, or a ModelContext entered with `with` (vLLM's current config)", "neither");
  return *entered_models().back();
}

}  // namespace

void register_layer(nb::module_& m) {
  using nb::arg;
  nb::class_<ModelContext>(m, "ModelContext", "The layers of one model: registry, dtype, device, backend choice.")
      .def("__init__",
           [](ModelContext* self, const std::string& dtype, const std::string& device, const std::string& backend,
              bool batch_invariant) {
             new (self) ModelContext({.dtype = dtype_arg(dtype, "ModelContext"),
                                      .device = device_arg(device, "ModelContext"),
                                      .backend = backend,
                                      .batch_invariant = batch_invariant});
           },
           nb::kw_only(), arg("dtype") = "bf16", arg("device") = "cpu", arg("backend") = "",
           arg("batch_invariant") = false)
      .def("__enter__",
           [](ModelContext& self) -> ModelContext& {
             entered_models().push_back(&self);
             return self;
           },
           nb::rv_policy::reference)
      .def("__exit__",
           [](ModelContext& self, nb::handle, nb::handle, nb::handle) {
             auto& stack = entered_models();
             if (!stack.empty() && stack.back() == &self) stack.pop_back();
           },
           arg("exc_type").none(), arg("exc_value").none(), arg("traceback").none())
      .def_prop_ro("layer_names", [](const ModelContext& self) {
        std::vector<std::string> names;
        for (const Attention* layer : self.layers()) names.push_back(layer->layer_name());
        return names;
      });

  nb::class_<Attention>(m, "Attention", "vLLM's Attention layer: writes K/V into its paged cache and attends.")
      .def("__init__",
           [](Attention* self, int num_heads, int head_size, float scale, std::optional<int> num_kv_heads,
              std::optional<std::vector<float>> alibi_slopes, std::optional<int> block_size,
              const std::string& cache_dtype, std::optional<float> logits_soft_cap,
              std::optional<int> per_layer_sliding_window, const std::string& prefix, const std::string& attn_type,
              std::optional<std::vector<float>> sinks, std::optional<int> attention_chunk_size, ModelContext* model) {
             // Built in place: the layer registers its own address with the model.
             new (self) Attention(model_for(model), num_heads, head_size, scale,
                                  layer_options(num_kv_heads, std::move(alibi_slopes), block_size, cache_dtype,
                                                logits_soft_cap, per_layer_sliding_window, prefix, attn_type,
                                                std::move(sinks), attention_chunk_size));
           },
           arg("num_heads"), arg("head_size"), arg("scale"), arg("num_kv_heads").none() = nb::none(),
           arg("alibi_slopes").none() = nb::none(), nb::kw_only(), arg("block_size").none() = nb::none(),
           arg("cache_dtype") = "auto", arg("logits_soft_cap").none() = nb::none(),
           arg("per_layer_sliding_window").none() = nb::none(), arg("prefix") = "", arg("attn_type") = "decoder",
           arg("sinks").none() = nb::none(), arg("attention_chunk_size").none() = nb::none(),
           arg("model").none() = nb::none(),
           "The seed constructor's arguments; the layer registers in `model`, or in the ModelContext entered with "
           "`with` when model is None.")
      .def("forward", &forward, arg("step"), arg("query"), arg("key").none(), arg("value").none(),
           arg("output").none() = nb::none(), arg("stream").none() = nb::none(),
           "Stores key/value at the step's slots and attends; returns the output [T, H*D].")
      .def("extra_repr", &Attention::extra_repr)
      .def_prop_ro("layer_name", &Attention::layer_name)
      .def_prop_ro("backend", [](const Attention& a) { return std::string(a.backend().name()); })
      .def_prop_ro("block_size", &Attention::block_size)
      .def_prop_ro("num_heads", &Attention::num_heads)
      .def_prop_ro("num_kv_heads", &Attention::num_kv_heads)
      .def_prop_ro("head_size", &Attention::head_size)
      .def_prop_ro("sliding_window", &Attention::sliding_window)
      .def_prop_ro("kv_cache",
                   [](const Attention& a) -> nb::object {
                     const Tensor& t = a.kv_cache(0);
                     if (!t.defined()) return nb::none();
                     return to_array(t);
                   },
                   "The bound cache of virtual engine 0 (the backend's kv_cache_shape), or None.");

  m.def(
      "allocate_kv_caches",
      [](ModelContext& model, std::int64_t num_blocks, bool reserve_null_block) {
        const KVCacheAllocation a = allocate_kv_caches(model, {num_blocks, reserve_null_block});
        return std::make_tuple(a.num_blocks, a.first_usable_block, a.bytes);
      },
      arg("model"), arg("num_blocks"), arg("reserve_null_block") = false,
      "Allocates and binds every layer's cache; returns (num_blocks, first_usable_block, bytes).");

  nb::class_<Step>(m, "Step", "One step's attention metadata for every layer of a model.")
      .def("__init__",
           [](Step* self, const ModelContext& model,
              const std::vector<std::tuple<int, int, std::vector<std::int32_t>>>& requests, int block_size,
              bool causal) { new (self) Step(make_step(model, requests, block_size, causal)); },
           arg("model"), arg("requests"), arg("block_size"), arg("causal") = true,
           "requests: (query_len, seq_len, block ids) per request, in token order.")
      .def_ro("num_tokens", &Step::num_tokens);

  nb::class_<KVCacheManager>(m, "KVCacheManager", "Blocks, block tables and prefix caching for a paged cache.")
      .def("__init__",
           [](KVCacheManager* self, int num_blocks, int block_size, bool enable_prefix_caching,
              std::optional<int> sliding_window) {
             new (self) KVCacheManager({num_blocks, block_size, enable_prefix_caching, sliding_window});
           },
           arg("num_blocks"), arg("block_size") = 16, nb::kw_only(), arg("enable_prefix_caching") = true,
           arg("sliding_window").none() = nb::none())
      .def("add_request", [](KVCacheManager& self, std::uint64_t id, std::vector<std::int32_t> prompt) {
             self.add_request(id, std::move(prompt));
           }, arg("request_id"), arg("prompt"))
      .def("append_tokens", [](KVCacheManager& self, std::uint64_t id, const std::vector<std::int32_t>& tokens) {
             self.append_tokens(id, tokens);
           }, arg("request_id"), arg("tokens"))
      .def("allocate_slots",
           [](KVCacheManager& self, std::uint64_t id, int num_new_tokens) {
             return self.allocate_slots(id, num_new_tokens);
           },
           arg("request_id"), arg("num_new_tokens"),
           "Reserves slots for the request's next tokens; False (and no change) when the pool is short.")
      .def("free", &KVCacheManager::free, arg("request_id"))
      .def("block_table",
           [](const KVCacheManager& self, std::uint64_t id) {
             const auto t = self.block_table(id);
             return std::vector<std::int32_t>(t.begin(), t.end());
           },
           arg("request_id"))
      .def("num_computed_tokens", &KVCacheManager::num_computed_tokens, arg("request_id"))
      .def("num_tokens", &KVCacheManager::num_tokens, arg("request_id"))
      .def_prop_ro("block_size", &KVCacheManager::block_size);
}

}  // namespace pagedattn::python
