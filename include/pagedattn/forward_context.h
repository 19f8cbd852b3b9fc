// The per-step forward context (vLLM's ForwardContext / set_forward_context):
// the model runner installs one per step with an RAII scope; every
// Attention::forward of that step reads its metadata, slot mapping and virtual
// engine from it instead of taking them as arguments.
#pragma once

#include <pagedattn/backend/backend.h>
#include <pagedattn/tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>

namespace pagedattn {

// Backend metadata per layer name (layers of one KV-cache group and backend
// share one object).
using LayerMetadataMap = std::map<std::string, std::shared_ptr<const BackendMetadata>, std::less<>>;
// Slot mapping per layer name: [N] i64, overriding the metadata's own.
using LayerSlotMappingMap = std::map<std::string, Tensor, std::less<>>;

struct ForwardContext {
  // Either one metadata object for every layer (`metadata`) or one per layer
  // (`layer_metadata`); the per-layer map wins when a layer is listed in it.
  std::shared_ptr<const BackendMetadata> metadata;
  LayerMetadataMap layer_metadata;
  LayerSlotMappingMap slot_mappings;
  // Which of a layer's per-pipeline-stage KV caches this step uses.
  int virtual_engine = 0;
  // Opaque device stream (cudaStream_t on CUDA); null = the default stream.
  void* stream = nullptr;

  // Throws InvalidArgument naming the layer when neither field covers it.
  const BackendMetadata& metadata_for(std::string_view layer_name) const;
  // The layer's slot mapping override, or nullptr when it has none.
  const Tensor* slot_mapping_for(std::string_view layer_name) const;
};

// Installs `context` for the current thread until destruction. Scopes nest: the
// innermost one is current, and destroying it restores the enclosing one.
class ForwardContextScope {
 public:
  explicit ForwardContextScope(ForwardContext context);
  ~ForwardContextScope();
  ForwardContextScope(const ForwardContextScope&) = delete;
  ForwardContextScope& operator=(const ForwardContextScope&) = delete;
  ForwardContextScope(ForwardContextScope&&) = delete;
  ForwardContextScope& operator=(ForwardContextScope&&) = delete;

  const ForwardContext& context() const { return context_; }

 private:
  ForwardContext context_;
};

// The current thread's innermost context; throws InvalidArgument
// "no forward context is set" when no scope is active.
const ForwardContext& get_forward_context();
bool has_forward_context();

}  // namespace pagedattn
