// `pagedattn`: inspect backends, explain selection, run the conformance grid
// and the main job. Every failure ends in one `error (<kind>): ...` line on
// stderr and a documented exit code (commands.h): no input crashes the CLI.
#include <fmt/format.h>
#include <pagedattn/error.h>

#include <exception>
#include <new>
#include <system_error>

#include "commands.h"

namespace pagedattn::cli {
namespace {

int exit_code_of(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidArgument:
    case ErrorKind::Unsupported:
      return kExitUsage;
    case ErrorKind::OutOfMemory:
      return kExitOutOfMemory;
    case ErrorKind::Device:
      return kExitRuntime;
  }
  return kExitRuntime;
}

int report(std::string_view kind, std::string_view message, int code) {
  fmt::print(stderr, "error ({}): {}\n", kind, message);
  return code;
}

// The CLI proper; main only supplies the arguments.
int run_cli(int argc, char** argv) {
  CLI::App app{"pagedattn: vLLM-style paged attention layer"};
  app.require_subcommand(1);
  app.set_version_flag("--version", fmt::format("pagedattn {}", PAGEDATTN_VERSION),
                       "Print the version and exit");
  app.footer(std::string(kExitCodesHelp));
  // Usage errors in the same one-line form as every other error.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return fmt::format("error (usage): {} (see --help)\n", e.what());
  });
  int exit_code = kExitOk;
  add_info_command(app, exit_code);
  add_select_command(app, exit_code);
  add_conformance_command(app, exit_code);
  add_run_command(app, exit_code);
  add_bench_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version arrive here too, as successes.
    return app.exit(e) == kExitOk ? kExitOk : kExitUsage;
  } catch (const Error& e) {
    return report(error_kind_name(e.kind()), e.what(), exit_code_of(e.kind()));
  } catch (const std::bad_alloc& e) {
    return report("out of memory", fmt::format("an allocation failed ({}); try a smaller workload", e.what()),
                  kExitOutOfMemory);
  } catch (const std::system_error& e) {
    return report("system", e.what(), kExitRuntime);
  } catch (const std::exception& e) {
    return report("internal", e.what(), kExitRuntime);
  } catch (...) {
    return report("internal", "an exception of unknown type", kExitRuntime);
  }
  return exit_code;
}

}  // namespace
}  // namespace pagedattn::cli

int main(int argc, char** argv) { return pagedattn::cli::run_cli(argc, argv); }
