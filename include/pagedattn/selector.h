// Backend selection (vLLM's get_attn_backend): walk the device's priority list,
// return the first valid backend, cache the choice, log every rejection; an
// explicit request (argument or PAGEDATTN_BACKEND) that is invalid is an error.
#pragma once

#include <pagedattn/backend/backend.h>
#include <pagedattn/backend/registry.h>

#include <string>
#include <string_view>
#include <vector>

namespace pagedattn {

struct BackendVerdict {
  std::string name;
  std::vector<std::string> reasons;  // empty = valid for the config
  bool auto_selectable = false;      // on the config device's priority list
};

struct SelectionReport {
  const AttentionBackend* chosen = nullptr;  // nullptr when nothing fits
  bool explicit_request = false;
  // Every registered backend: the device's priority list first, in order, then the rest.
  std::vector<BackendVerdict> verdicts;
};

// Explains a selection without throwing for "nothing fits" (`chosen` null).
// `requested` empty or "auto" (any case) means automatic; otherwise a backend
// name (unknown names throw InvalidArgument listing the valid ones).
SelectionReport explain_selection(const SelectorConfig& cfg, std::string_view requested = {});
// The same against a given registry (tests use their own).
SelectionReport explain_selection(const BackendRegistry& registry, const SelectorConfig& cfg,
                                  std::string_view requested = {});

// The backend for `cfg`. When `requested` is empty the PAGEDATTN_BACKEND
// environment variable is consulted. Throws Unsupported with every backend's
// reasons when none fits, or with the requested backend's reasons when it is
// invalid. Automatic choices are cached per config.
const AttentionBackend& select_backend(const SelectorConfig& cfg, std::string_view requested = {});

void clear_selection_cache();

// "NAME: [reason, reason]; NAME: [...]" for messages.
std::string format_verdicts(const std::vector<BackendVerdict>& verdicts);

}  // namespace pagedattn
