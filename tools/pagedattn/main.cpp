// `pagedattn`: inspect backends, explain selection, run the conformance grid
// and the main job.
#include <fmt/format.h>
#include <pagedattn/error.h>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"pagedattn: vLLM-style paged attention layer"};
  app.require_subcommand(1);
  int exit_code = pagedattn::cli::kExitOk;
  pagedattn::cli::add_info_command(app, exit_code);
  pagedattn::cli::add_select_command(app, exit_code);
  pagedattn::cli::add_conformance_command(app, exit_code);
  pagedattn::cli::add_run_command(app, exit_code);
  pagedattn::cli::add_bench_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const pagedattn::Error& e) {
    fmt::print(stderr, "error ({}): {}\n", pagedattn::error_kind_name(e.kind()), e.what());
    return pagedattn::cli::kExitError;
  }
  return exit_code;
}
