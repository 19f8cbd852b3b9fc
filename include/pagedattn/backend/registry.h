// The backend registry: one object per backend, registered by name, with its
// place in its device's priority list. Core knows backends only through here.
#pragma once

#include <pagedattn/backend/backend.h>

#include <memory>
#include <string_view>
#include <vector>

namespace pagedattn {

// Priority of a backend that is never auto-selected (only when asked by name).
inline constexpr int kOnlyWhenAsked = -1;

class BackendRegistry {
 public:
  // The process-wide registry, with the built-in backends registered.
  static BackendRegistry& instance();

  // `priority`: smaller = preferred within the backend's device type, or
  // kOnlyWhenAsked. Throws InvalidArgument on a duplicate name.
  void add(std::unique_ptr<AttentionBackend> backend, int priority);
  // Case-insensitive; nullptr when unknown.
  const AttentionBackend* find(std::string_view name) const;
  // Every registered backend, in registration order.
  std::vector<const AttentionBackend*> all() const;
  // Auto-selectable backends of a device type, most preferred first.
  std::vector<const AttentionBackend*> priority_list(DeviceType type) const;
  // Comma-separated names, for messages.
  std::string names() const;

 private:
  struct Entry {
    std::unique_ptr<AttentionBackend> backend;
    int priority;
  };
  std::vector<Entry> entries_;
};

// Defined by the backends' glue (src/backends/builtin.cpp), never by core:
// registers every backend compiled into the library.
void register_builtin_backends(BackendRegistry& registry);

}  // namespace pagedattn
