#include <pagedattn/backend/registry.h>
#include <pagedattn/support_matrix.h>

#include "commands.h"

namespace pagedattn::cli {

void add_info_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("info", "Version, build options, devices and the backends' support matrix");
  auto markdown = std::make_shared<bool>(false);
  cmd->add_flag("--markdown", *markdown, "Print only the support matrix as Markdown (docs/support_matrix.md)");
  cmd->callback([markdown, &exit_code] {
    const auto backends = BackendRegistry::instance().all();
    if (*markdown) {
      fmt::print("{}", support_matrix_markdown(backends));
      exit_code = kExitOk;
      return;
    }
    fmt::print("pagedattn {}\n", PAGEDATTN_VERSION);
    fmt::print("build: CUDA {}, compiler {} {}\n", PAGEDATTN_HAVE_CUDA ? "compiled in" : "not compiled",
               PAGEDATTN_COMPILER_ID, PAGEDATTN_COMPILER_VERSION);
    fmt::print("devices:\n");
    for (const Device& d : available_devices()) {
      const DeviceCapability cap = device_allocator(d.type).capability(d);
      if (d.is_cuda()) {
        fmt::print("  {} (compute capability {}.{})\n", d, cap.major, cap.minor);
      } else {
        fmt::print("  {}\n", d);
      }
    }
    fmt::print("backends:\n");
    for (const AttentionBackend* b : backends) {
      fmt::print("  {:<12} {}\n", b->name(), b->description());
    }
    fmt::print("support matrix:\n");
    const auto rows = support_matrix(backends);
    std::size_t width = 0;
    for (const SupportRow& r : rows) width = std::max(width, r.feature.size());
    fmt::print("  {:<{}}", "backend", width);
    for (const AttentionBackend* b : backends) fmt::print("  | {}", b->name());
    fmt::print("\n");
    for (const SupportRow& r : rows) {
      fmt::print("  {:<{}}", r.feature, width);
      for (const std::string& c : r.cells) fmt::print("  | {}", c);
      fmt::print("\n");
    }
    exit_code = kExitOk;
  });
}

}  // namespace pagedattn::cli
