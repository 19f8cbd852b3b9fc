#include <pagedattn/conformance.h>
#include <pagedattn/registry.h>

#include "commands.h"

namespace pagedattn::cli {
namespace {

struct ConformanceOptions {
  std::string backend;
  std::vector<std::string> filters;
  std::string device = "cpu";
  int threads = 2;
  bool verbose = false;
  bool list = false;
};

ConformanceSummary run_one_backend(const AttentionBackend& backend, const ConformanceOptions& o, Device device) {
  fmt::print("backend {} on {}\n", backend.name(), device);
  const auto on_case = [&](const ConformanceCase& c, const CaseResult& r) {
    if (r.status == CaseStatus::Passed && !o.verbose) return;
    fmt::print("  {} {}{}{}\n", case_status_name(r.status), c.id(), r.message.empty() ? "" : ": ", r.message);
  };
  const ConformanceSummary summary =
      run_conformance(backend, std::span<const std::string>(o.filters), device, on_case, o.threads);
  fmt::print("  {}: {}\n", backend.name(), format_summary(summary));
  return summary;
}

int run_conformance_command(const ConformanceOptions& o) {
  const auto device = parse_device(o.device);
  if (!device) throw_invalid("conformance", "--device", "cpu or cuda[:N]", o.device);
  if (o.list) {
    for (const ConformanceCase& c : conformance_grid()) {
      if (matches_any(c, o.filters)) fmt::print("{}\n", c.id());
    }
    return kExitOk;
  }
  std::vector<const AttentionBackend*> backends;
  if (!o.backend.empty()) {
    const AttentionBackend* b = BackendRegistry::instance().find(o.backend);
    if (b == nullptr) {
      throw_invalid("conformance", "--backend", fmt::format("one of {}", BackendRegistry::instance().names()),
                    o.backend);
    }
    backends.push_back(b);
  } else {
    for (const AttentionBackend* b : BackendRegistry::instance().all()) {
      if (b->device_type() == device->type) backends.push_back(b);
    }
  }
  ConformanceSummary total;
  for (const AttentionBackend* b : backends) {
    const ConformanceSummary s = run_one_backend(*b, o, *device);
    total.passed += s.passed;
    total.failed += s.failed;
    total.skipped += s.skipped;
  }
  fmt::print("{}\n", format_summary(total));
  return total.ok() ? kExitOk : kExitFailed;
}

}  // namespace

void add_conformance_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("conformance", "Run the conformance grid against the dense fp64 oracle");
  auto o = std::make_shared<ConformanceOptions>();
  cmd->add_option("--backend", o->backend, "Backend to check (default: every backend of the device)");
  // One text per --filter, taken whole: ids are bracketed, which CLI11 would
  // otherwise split at their commas as a list.
  cmd->add_option("--filter", o->filters,
                  "Run only cases whose id contains this text (an id reproduces one case); repeatable: any of them")
      ->allow_extra_args(false);
  cmd->add_option("--device", o->device, "cpu or cuda[:N]")->capture_default_str();
  cmd->add_option("--threads", o->threads, "Cases run in parallel")->capture_default_str()->check(CLI::Range(1, 256));
  cmd->add_flag("--verbose", o->verbose, "Print passing cases too");
  cmd->add_flag("--list", o->list, "List the case ids (after --filter) and exit");
  cmd->callback([o, &exit_code] { exit_code = run_conformance_command(*o); });
}

}  // namespace pagedattn::cli
