#include <pagedattn/log.h>
#include <pagedattn/backend/registry.h>
#include <pagedattn/selector.h>

#include "core/strings.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <mutex>

namespace pagedattn {
namespace {

constexpr std::string_view kBackendEnvVar = "PAGEDATTN_BACKEND";
constexpr std::string_view kAutoName = "auto";
constexpr std::string_view kOnlyWhenAskedReason = "selected only when requested by name";

bool is_auto(std::string_view name) { return name.empty() || detail::iequals(name, kAutoName); }

// Reasons a backend cannot serve `cfg`, device mismatch first.
std::vector<std::string> reasons_for(const AttentionBackend& backend, const SelectorConfig& cfg) {
  std::vector<std::string> reasons;
  if (backend.device_type() != cfg.device.type) {
    reasons.push_back(fmt::format("runs on {}, not {}", device_type_name(backend.device_type()),
                                  device_name(cfg.device)));
  }
  for (std::string& r : backend.validate_configuration(cfg)) reasons.push_back(std::move(r));
  return reasons;
}

std::string join_reasons(const std::vector<std::string>& reasons) {
  std::string out = "[";
  for (std::size_t i = 0; i < reasons.size(); ++i) out += (i ? ", " : "") + reasons[i];
  return out + "]";
}

struct SelectionCache {
  std::mutex mutex;
  std::map<std::string, const AttentionBackend*> chosen;
};

SelectionCache& selection_cache() {
  static SelectionCache cache;
  return cache;
}

}  // namespace

std::string format_verdicts(const std::vector<BackendVerdict>& verdicts) {
  std::string out;
  for (const BackendVerdict& v : verdicts) {
    out += fmt::format("{}{}: {}", out.empty() ? "" : "; ", v.name, join_reasons(v.reasons));
  }
  return out;
}

SelectionReport explain_selection(const SelectorConfig& cfg, std::string_view requested) {
  return explain_selection(BackendRegistry::instance(), cfg, requested);
}

SelectionReport explain_selection(const BackendRegistry& registry, const SelectorConfig& cfg,
                                  std::string_view requested) {
  SelectionReport report;
  if (!is_auto(requested)) {
    const AttentionBackend* backend = registry.find(requested);
    if (backend == nullptr) {
      throw_invalid("select_backend", "backend", fmt::format("one of auto, {}", registry.names()),
                    fmt::format("'{}'", requested));
    }
    report.explicit_request = true;
    BackendVerdict verdict{std::string(backend->name()), reasons_for(*backend, cfg), false};
    if (verdict.reasons.empty()) report.chosen = backend;
    report.verdicts.push_back(std::move(verdict));
    return report;
  }
  const std::vector<const AttentionBackend*> priority = registry.priority_list(cfg.device.type);
  for (const AttentionBackend* backend : priority) {
    BackendVerdict verdict{std::string(backend->name()), reasons_for(*backend, cfg), true};
    if (verdict.reasons.empty() && report.chosen == nullptr) report.chosen = backend;
    report.verdicts.push_back(std::move(verdict));
  }
  for (const AttentionBackend* backend : registry.all()) {
    if (std::find(priority.begin(), priority.end(), backend) != priority.end()) continue;
    std::vector<std::string> reasons = reasons_for(*backend, cfg);
    if (backend->device_type() == cfg.device.type) reasons.insert(reasons.begin(), std::string(kOnlyWhenAskedReason));
    report.verdicts.push_back(BackendVerdict{std::string(backend->name()), std::move(reasons), false});
  }
  return report;
}

const AttentionBackend& select_backend(const SelectorConfig& cfg, std::string_view requested) {
  std::string request(requested);
  if (request.empty()) {
    if (const char* env = std::getenv(kBackendEnvVar.data())) request = env;
  }
  if (!is_auto(request)) {
    const SelectionReport report = explain_selection(cfg, request);
    if (report.chosen == nullptr) {
      throw Error(ErrorKind::Unsupported,
                  fmt::format("select_backend: selected backend {} is not valid for this configuration. "
                              "Reason: {} ({})",
                              report.verdicts.front().name, join_reasons(report.verdicts.front().reasons),
                              cfg.str()));
    }
    log_at(LogLevel::Info, "Using {} attention backend (requested)", report.chosen->name());
    return *report.chosen;
  }

  SelectionCache& cache = selection_cache();
  const std::string key = cfg.str();
  {
    std::lock_guard<std::mutex> lock(cache.mutex);
    if (auto it = cache.chosen.find(key); it != cache.chosen.end()) return *it->second;
  }
  const SelectionReport report = explain_selection(cfg, {});
  std::string candidates;
  for (const BackendVerdict& v : report.verdicts) {
    if (!v.reasons.empty()) log_at(LogLevel::Info, "Rejected backend {}: {}", v.name, join_reasons(v.reasons));
    if (v.auto_selectable) candidates += (candidates.empty() ? "" : ", ") + v.name;
  }
  if (report.chosen == nullptr) {
    throw Error(ErrorKind::Unsupported,
                fmt::format("select_backend: no valid attention backend found for {} with {}. Reasons: {{{}}}",
                            device_name(cfg.device), cfg.str(), format_verdicts(report.verdicts)));
  }
  log_at(LogLevel::Info, "Using {} attention backend out of potential backends: [{}]", report.chosen->name(),
         candidates);
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.chosen.emplace(key, report.chosen);
  return *report.chosen;
}

void clear_selection_cache() {
  SelectionCache& cache = selection_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.chosen.clear();
}

}  // namespace pagedattn
