#include <fmt/ranges.h>
#include <pagedattn/conformance.h>
#include <pagedattn/backend/registry.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "commands.h"

namespace pagedattn::cli {
namespace {

struct ConformanceOptions {
  std::string backend;
  std::vector<std::string> filters;
  std::string device;  // empty: the backend's device type, index 0 (cpu without --backend)
  int threads = 2;
  bool verbose = false;
  bool list = false;
  std::string digests;  // file for one "<backend> <case id> <status> <digest>" line per case
};

ConformanceSummary run_one_backend(const AttentionBackend& backend, const ConformanceOptions& o, Device device,
                                   std::FILE* digests) {
  fmt::print("backend {} on {}\n", backend.name(), device);
  const auto on_case = [&](const ConformanceCase& c, const CaseResult& r) {
    if (digests != nullptr) {
      fmt::print(digests, "{} {} {} {:016x}\n", backend.name(), c.id(), case_status_name(r.status), r.digest);
    }
    if (r.status == CaseStatus::Passed && !o.verbose) return;
    fmt::print("  {} {}{}{}\n", case_status_name(r.status), c.id(), r.message.empty() ? "" : ": ", r.message);
  };
  const ConformanceSummary summary =
      run_conformance(backend, std::span<const std::string>(o.filters), device, on_case, o.threads);
  fmt::print("  {}: {}\n", backend.name(), format_summary(summary));
  return summary;
}

// The explicit --device, else device 0 of the backend's type, else the CPU.
Device choose_device(const ConformanceOptions& o, const AttentionBackend* backend) {
  if (o.device.empty()) return Device{backend != nullptr ? backend->device_type() : DeviceType::CPU, 0};
  const auto device = parse_device(o.device);
  if (!device) throw_invalid("conformance", "--device", "cpu or cuda[:N]", o.device);
  if (backend != nullptr && device->type != backend->device_type()) {
    throw_invalid("conformance", "--device",
                  fmt::format("a {} device (backend {} runs on {})", device_type_name(backend->device_type()),
                              backend->name(), device_type_name(backend->device_type())),
                  o.device);
  }
  return *device;
}

int run_conformance_command(const ConformanceOptions& o) {
  if (o.list) {
    int listed = 0;
    for (const ConformanceCase& c : conformance_grid()) {
      if (!matches_any(c, o.filters)) continue;
      fmt::print("{}\n", c.id());
      ++listed;
    }
    if (listed > 0) return kExitOk;
    fmt::print(stderr, "error (nothing ran): no case id contains --filter '{}'\n", fmt::join(o.filters, "' or '"));
    return kExitNothingRan;
  }
  const AttentionBackend* requested = nullptr;
  if (!o.backend.empty()) {
    requested = BackendRegistry::instance().find(o.backend);
    if (requested == nullptr) {
      throw_invalid("conformance", "--backend", fmt::format("one of {}", BackendRegistry::instance().names()),
                    o.backend);
    }
  }
  const Device device = choose_device(o, requested);
  const std::vector<Device> devices = available_devices();
  if (std::find(devices.begin(), devices.end(), device) == devices.end()) {
    fmt::print(stderr, "error (nothing ran): device {} is not available on this machine (devices: {})\n",
               device, fmt::join(devices, ", "));
    return kExitNothingRan;
  }
  std::vector<const AttentionBackend*> backends;
  if (requested != nullptr) {
    backends.push_back(requested);
  } else {
    for (const AttentionBackend* b : BackendRegistry::instance().all()) {
      if (b->device_type() == device.type) backends.push_back(b);
    }
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> digests(nullptr, &std::fclose);
  if (!o.digests.empty()) {
    digests.reset(std::fopen(o.digests.c_str(), "w"));
    if (!digests) throw_invalid("conformance", "--digests", "a writable file", o.digests);
  }
  ConformanceSummary total;
  for (const AttentionBackend* b : backends) {
    const ConformanceSummary s = run_one_backend(*b, o, device, digests.get());
    total.passed += s.passed;
    total.failed += s.failed;
    total.skipped += s.skipped;
  }
  fmt::print("{}\n", format_summary(total));
  if (total.passed + total.failed > 0) return total.ok() ? kExitOk : kExitFailed;
  // A run that checked nothing proves nothing: say why and fail.
  if (backends.empty()) {
    fmt::print(stderr, "error (nothing ran): no backend runs on {}\n", device);
  } else if (total.skipped == 0) {
    fmt::print(stderr, "error (nothing ran): no case id contains --filter '{}'\n", fmt::join(o.filters, "' or '"));
  } else {
    fmt::print(stderr, "error (nothing ran): all {} cases were skipped on {} (reasons above)\n",
               total.skipped, device);
  }
  return kExitNothingRan;
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
  cmd->add_option("--device", o->device,
                  "cpu or cuda[:N] (default: device 0 of the --backend's type; cpu without --backend)");
  cmd->add_option("--threads", o->threads, "Cases run in parallel")
      ->capture_default_str()
      ->check(in_range(1, kMaxThreads));
  cmd->add_flag("--verbose", o->verbose, "Print passing cases too");
  cmd->add_flag("--list", o->list, "List the case ids (after --filter) and exit");
  cmd->add_option("--digests", o->digests,
                  "Write '<backend> <case id> <status> <digest>' per case: a hash of its output and LSE bits, "
                  "to compare two builds with diff");
  cmd->callback([o, &exit_code] { exit_code = run_conformance_command(*o); });
}

}  // namespace pagedattn::cli
