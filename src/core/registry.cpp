#include <pagedattn/backend/registry.h>

#include "core/strings.h"

#include <algorithm>
#include <cctype>
#include <mutex>

namespace pagedattn {
BackendRegistry& BackendRegistry::instance() {
  // Never destroyed: layers and caches may outlive static destruction order.
  static BackendRegistry* registry = [] {
    auto* r = new BackendRegistry();
    register_builtin_backends(*r);
    return r;
  }();
  return *registry;
}

void BackendRegistry::add(std::unique_ptr<AttentionBackend> backend, int priority) {
  check_arg(backend != nullptr, "BackendRegistry::add", "backend", "non-null", "null");
  check_arg(find(backend->name()) == nullptr, "BackendRegistry::add", "backend name", "unique",
            backend->name());
  check_arg(priority >= 0 || priority == kOnlyWhenAsked, "BackendRegistry::add", "priority",
            ">= 0 or kOnlyWhenAsked", priority);
  entries_.push_back(Entry{std::move(backend), priority});
}

const AttentionBackend* BackendRegistry::find(std::string_view name) const {
  for (const Entry& e : entries_) {
    if (detail::iequals(e.backend->name(), name)) return e.backend.get();
  }
  return nullptr;
}

std::vector<const AttentionBackend*> BackendRegistry::all() const {
  std::vector<const AttentionBackend*> out;
  for (const Entry& e : entries_) out.push_back(e.backend.get());
  return out;
}

std::vector<const AttentionBackend*> BackendRegistry::priority_list(DeviceType type) const {
  std::vector<const Entry*> matching;
  for (const Entry& e : entries_) {
    if (e.priority != kOnlyWhenAsked && e.backend->device_type() == type) matching.push_back(&e);
  }
  std::stable_sort(matching.begin(), matching.end(),
                   [](const Entry* a, const Entry* b) { return a->priority < b->priority; });
  std::vector<const AttentionBackend*> out;
  for (const Entry* e : matching) out.push_back(e->backend.get());
  return out;
}

std::string BackendRegistry::names() const {
  std::string out;
  for (const Entry& e : entries_) out += (out.empty() ? "" : ", ") + std::string(e.backend->name());
  return out;
}

}  // namespace pagedattn
