// The Attention layer (vLLM's `Attention` nn.Module) and the model-level
// context it registers in (vLLM's static_forward_context plus the model
// config the constructor reads).
//
// A model builds its layers against one ModelContext, allocates their caches
// (kv_cache.h: allocate_kv_caches), then per step builds metadata
// (ModelMetadataBuilder), installs it with a ForwardContextScope and calls
// each layer's forward.
#pragma once

#include <pagedattn/backend/backend.h>
#include <pagedattn/cascade.h>
#include <pagedattn/forward_context.h>
#include <pagedattn/kv_cache.h>
#include <pagedattn/tensor.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pagedattn {

class Attention;

inline constexpr int kDefaultBlockSize = 16;
// Environment variable naming the KV-cache layout ("NHD" or "HND") when the
// cache config does not set one (vLLM's VLLM_KV_CACHE_LAYOUT).
inline constexpr const char* kKVCacheLayoutEnv = "PAGEDATTN_KV_CACHE_LAYOUT";

struct ModelOptions {
  DType dtype = DType::BF16;  // activation dtype (torch.get_default_dtype() in vLLM)
  Device device = Device::cpu();
  int pipeline_parallel_size = 1;  // virtual engines: one KV cache per stage
  // Backend name for every layer (vLLM's AttentionConfig.backend); empty or
  // "auto" = automatic (PAGEDATTN_BACKEND is still consulted).
  std::string backend{};
  // Only backends whose results for a request do not depend on the rest of
  // the batch (vLLM's VLLM_BATCH_INVARIANT): the selector filters on it.
  bool batch_invariant = false;
};

// The model-level state layers read at construction, and the layer registry
// (name -> layer, in registration order). Not thread-safe. Layers unregister
// themselves when destroyed; layers outliving the context are detached.
class ModelContext {
 public:
  // Throws InvalidArgument on pipeline_parallel_size < 1 or a non-float dtype.
  explicit ModelContext(ModelOptions options = {});
  ~ModelContext();
  ModelContext(const ModelContext&) = delete;
  ModelContext& operator=(const ModelContext&) = delete;
  ModelContext(ModelContext&&) = delete;
  ModelContext& operator=(ModelContext&&) = delete;

  DType dtype() const { return options_.dtype; }
  Device device() const { return options_.device; }
  int pipeline_parallel_size() const { return options_.pipeline_parallel_size; }
  const std::string& requested_backend() const { return options_.backend; }
  bool batch_invariant() const { return options_.batch_invariant; }

  // nullptr when no layer has that name.
  Attention* find_layer(std::string_view name) const;
  // Throws InvalidArgument naming the layer when unknown.
  Attention& layer(std::string_view name) const;
  // Registration order.
  const std::vector<Attention*>& layers() const { return order_; }

 private:
  friend class Attention;
  void register_layer(const std::string& name, Attention* layer);
  void unregister_layer(const std::string& name) noexcept;

  ModelOptions options_;
  std::map<std::string, Attention*, std::less<>> by_name_;
  std::vector<Attention*> order_;
};

// vLLM's CacheConfig, the fields the layer reads.
struct CacheConfig {
  // Unset = the backend's preferred size (16 when it supports it), and the
  // selector does not filter backends on it.
  std::optional<int> block_size{};
  CacheDType cache_dtype = CacheDType::Auto;
  std::optional<int> sliding_window{};  // model-level window
  bool calculate_kv_scales = false;     // compute fp8 scales from the first batch
  // Unset = PAGEDATTN_KV_CACHE_LAYOUT, else NHD. A backend's required layout
  // overrides either.
  std::optional<KVCacheLayout> kv_cache_layout{};
};

// Placeholder for vLLM's QuantizationConfig, reduced to its KV-cache part.
// A KV-cache scheme with cache dtype "auto" forces "fp8" and turns
// calculate_kv_scales off (llm-compressor checkpoints). Checkpoint scales are
// applied by process_weights_after_loading; without them the scales are 1.0.
struct QuantConfig {
  bool has_kv_cache_scheme = false;
  // Scheme strategy "attn_head": k/v scales are [num_kv_heads], not [1].
  bool per_head_scales = false;
  std::optional<std::vector<float>> k_scale{};  // [1] or [num_kv_heads]
  std::optional<std::vector<float>> v_scale{};  // same size as k_scale
  std::optional<float> q_scale{};
};

// Every seed constructor argument besides num_heads, head_size and scale.
struct AttentionOptions {
  std::optional<int> num_kv_heads{};                 // default: num_heads
  std::optional<std::vector<float>> alibi_slopes{};  // [num_heads]
  std::optional<CacheConfig> cache_config{};
  std::optional<QuantConfig> quant_config{};
  std::optional<float> logits_soft_cap{};
  std::optional<int> per_layer_sliding_window{};
  std::string prefix{};  // the layer's unique name in the model
  AttentionType attn_type = AttentionType::Decoder;
  std::optional<std::string> kv_sharing_target_layer_name{};
  const AttentionBackend* attn_backend = nullptr;  // bypasses the selector
  std::optional<std::vector<float>> sinks{};       // [num_heads] sink logits
  bool use_non_causal = false;                     // bidirectional decoder (selector filter)
  // Chunked local attention (Llama 4): a query sees only keys of its own
  // chunk of this many tokens; a positive multiple of the block size.
  std::optional<int> attention_chunk_size{};
  // PrefixLM (vLLM's use_mm_prefix, set for is_mm_prefix_lm models): queries
  // inside the step's mm_prefix_ranges see their whole range (selector
  // filter); causal decoder layers without attention_chunk_size only.
  bool use_mm_prefix = false;
};

class Attention {
 public:
  // Validates every argument, picks the backend (unless options.attn_backend),
  // builds its impl and registers under options.prefix. Throws InvalidArgument
  // on bad sizes, "num_heads (X) is not divisible by num_kv_heads (Y)",
  // "Duplicate layer name: X" and invalid KV-sharing targets; Unsupported when
  // no backend fits.
  Attention(ModelContext& model, int num_heads, int head_size, float scale, AttentionOptions options = {});
  ~Attention();
  Attention(const Attention&) = delete;
  Attention& operator=(const Attention&) = delete;
  Attention(Attention&&) = delete;
  Attention& operator=(Attention&&) = delete;

  // Stores key/value into the KV cache and computes attention for the current
  // forward context's metadata (get_forward_context()).
  //   query   [T, H*D] or [T, H, D]          rows may be strided, last dim contiguous
  //   key     [Tk, Hkv*D] or [Tk, Hkv, D]    or undefined (nothing to store)
  //   value   like key
  //   output  [T, H*D] or [T, H, D], dtype of query; undefined = allocate
  //   lse     [H, T] f32 or undefined
  // Tk == T except for cross-attention, where key/value are the encoder tokens.
  // Returns the output as [T, H*D]; when `output` was given, the result is a
  // view of the caller's buffer and does not own it. Every argument is checked
  // before the cache is touched.
  Tensor forward(const TensorView& query, const TensorView& key, const TensorView& value,
                 const TensorView& output = {}, const TensorView& lse = {});

  // Sets the q/k/v scales to max|x| / (200, 200, 100) and stops further
  // calculation (forward calls it once when calculate_kv_scales is on).
  void calc_kv_scales(const TensorView& query, const TensorView& key, const TensorView& value);

  // Applies the checkpoint scales of the quant config, or resets the scales to
  // 1.0 when it has none, then lets the impl post-process.
  void process_weights_after_loading(DType act_dtype);

  // nullopt for layers that own no cache: encoder and encoder-only layers, and
  // KV-sharing layers (they read their target's cache).
  std::optional<KVCacheSpec> get_kv_cache_spec() const;

  // "head_size=128, num_heads=32, num_kv_heads=8, scale=0.0883883, backend=ReferenceAttentionImpl"
  std::string extra_repr() const;

  // Binds the cache of one virtual engine: logical shape of the backend's
  // kv_cache_shape for this layer (any strides), storage dtype, model device;
  // with a per-token-head dtype also its scales, kv_cache_scale_shape f32
  // (allocate_layer_kv_cache makes both), else no scales.
  void bind_kv_cache(int virtual_engine, const Tensor& kv_cache, const Tensor& kv_scales = {});
  // Undefined until bound.
  const Tensor& kv_cache(int virtual_engine) const;
  // Undefined until bound, and for dtypes without per-token-head scales.
  const Tensor& kv_cache_scales(int virtual_engine) const;
  // Its K and V halves, [NB, BS, Hkv, D] each; undefined until bound.
  const KVCacheView& kv_cache_view(int virtual_engine) const;
  int num_virtual_engines() const { return static_cast<int>(kv_cache_.size()); }

  const AttentionBackend& backend() const { return *backend_; }
  AttentionImpl& impl() { return *impl_; }
  const AttentionImpl& impl() const { return *impl_; }
  const std::string& layer_name() const { return layer_name_; }
  AttentionType attn_type() const { return attn_type_; }
  int num_heads() const { return num_heads_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int head_size() const { return head_size_; }
  float scale() const { return scale_; }
  std::optional<int> sliding_window() const { return sliding_window_; }
  std::optional<int> attention_chunk_size() const { return impl_->params().attention_chunk_size; }
  bool use_mm_prefix() const { return impl_->params().use_mm_prefix; }
  CacheDType kv_cache_dtype() const { return kv_cache_dtype_; }
  DType kv_cache_storage_dtype() const;
  int block_size() const { return block_size_; }
  KVCacheLayout kv_cache_layout() const { return kv_cache_layout_; }
  bool has_sink() const { return has_sink_; }
  bool calculate_kv_scales() const { return calculate_kv_scales_; }
  // True when the impl takes fp8 queries (AttentionImpl::quantizes_query):
  // quant_state().quantize_query is set, and the impl quantizes the query
  // itself with quant_state().q_scale.
  bool quantizes_query() const { return quant_.quantize_query; }
  const std::optional<std::string>& kv_sharing_target_layer_name() const { return kv_sharing_target_; }
  const LayerQuantState& quant_state() const { return quant_; }
  DType dtype() const { return dtype_; }

 private:
  friend class ModelContext;
  bool init_kv_cache_quant(std::string_view where, const CacheConfig& cache);
  void set_scales(float q, const std::vector<float>& k, const std::vector<float>& v);
  void check_virtual_engine(std::string_view where, int virtual_engine) const;

  ModelContext* model_;  // null once the model context is gone
  int num_heads_;
  int head_size_;
  float scale_;
  int num_kv_heads_ = 0;
  AttentionType attn_type_ = AttentionType::Decoder;
  std::string layer_name_;
  std::string forward_where_;  // "Attention(<name>).forward", built once for messages
  std::optional<int> sliding_window_;
  CacheDType kv_cache_dtype_ = CacheDType::Auto;
  int block_size_ = kDefaultBlockSize;
  KVCacheLayout kv_cache_layout_ = KVCacheLayout::NHD;
  bool calculate_kv_scales_ = false;
  bool has_sink_ = false;
  std::optional<std::string> kv_sharing_target_;
  std::optional<QuantConfig> quant_config_;
  DType dtype_ = DType::BF16;
  Device device_ = Device::cpu();
  const AttentionBackend* backend_ = nullptr;
  std::unique_ptr<AttentionImpl> impl_;
  LayerQuantState quant_;
  std::vector<Tensor> kv_cache_;             // one per virtual engine
  std::vector<Tensor> kv_cache_scales_;      // per-token-head dtypes: one per virtual engine
  std::vector<KVCacheView> kv_cache_views_;  // its K/V halves
};

// Builds each step's per-layer metadata: one builder per distinct (backend,
// block size, KV heads, head size) among the chosen layers, made once, and
// one build per step shared by all its layers. The layers passed together form
// one KV-cache group: they share one CommonAttentionMetadata (one block table
// and slot mapping), as in vLLM. Layers with an attention_chunk_size build
// from the step split into per-chunk virtual requests
// (make_local_attention_virtual_batches), once per chunk size.
class ModelMetadataBuilder {
 public:
  // `layer_names` empty = every layer of the model, in registration order.
  // The layers must outlive the builder.
  // `cascade`: plan steps whose requests share a long prefix as cascades
  // (cascade.h) for the groups whose layers allow it (never for a
  // batch-invariant model: a cascade depends on the other requests).
  explicit ModelMetadataBuilder(const ModelContext& model, std::vector<std::string> layer_names = {},
                                bool cascade = true);

  // Validates `common` against the layers' bound caches (block ids and slots
  // below their num_blocks), then maps every layer name to its backend's
  // metadata. The result goes into ForwardContext::layer_metadata.
  LayerMetadataMap build(const CommonAttentionMetadata& common);
  // Whether the last build planned a cascade for any group.
  bool last_step_used_cascade() const;

 private:
  struct Group {
    std::unique_ptr<CascadeBuilder> builder;
    std::vector<const Attention*> layers;
    int chunk_size = 0;  // the layers' attention_chunk_size, 0 for none
  };
  std::vector<Group> groups_;
};

}  // namespace pagedattn
