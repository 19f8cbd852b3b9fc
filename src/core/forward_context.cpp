// The thread-local stack of forward contexts behind ForwardContextScope.
#include <pagedattn/forward_context.h>

#include <algorithm>
#include <vector>

namespace pagedattn {
namespace {

// Innermost scope last. Scopes are neither copied nor moved, so the pointers
// stay valid for as long as they are on the stack.
std::vector<const ForwardContext*>& context_stack() {
  thread_local std::vector<const ForwardContext*> stack;
  return stack;
}

}  // namespace

const BackendMetadata& ForwardContext::metadata_for(std::string_view layer_name) const {
  if (const auto it = layer_metadata.find(layer_name); it != layer_metadata.end() && it->second) {
    return *it->second;
  }
  if (metadata) return *metadata;
  throw Error(ErrorKind::InvalidArgument,
              fmt::format("forward context: no attention metadata for layer '{}' (the per-layer map has {} "
                          "entries and no metadata is set for all layers)",
                          layer_name, layer_metadata.size()));
}

const Tensor* ForwardContext::slot_mapping_for(std::string_view layer_name) const {
  const auto it = slot_mappings.find(layer_name);
  return it == slot_mappings.end() ? nullptr : &it->second;
}

ForwardContextScope::ForwardContextScope(ForwardContext context) : context_(std::move(context)) {
  context_stack().push_back(&context_);
}

ForwardContextScope::~ForwardContextScope() {
  // Scopes are lexical, so this one is normally on top; erasing by identity
  // keeps the stack consistent even if scopes end out of order.
  auto& stack = context_stack();
  const auto it = std::find(stack.rbegin(), stack.rend(), &context_);
  if (it != stack.rend()) stack.erase(std::next(it).base());
}

const ForwardContext& get_forward_context() {
  const auto& stack = context_stack();
  if (stack.empty())
    throw Error(ErrorKind::InvalidArgument, "get_forward_context: no forward context is set");
  return *stack.back();
}

bool has_forward_context() { return !context_stack().empty(); }

}  // namespace pagedattn
