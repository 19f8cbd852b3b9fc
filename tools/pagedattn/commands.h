// Subcommands of the `pagedattn` CLI. Each add_* registers its options and a
// callback that stores the process exit code in `exit_code`.
#pragma once

#include <CLI/CLI.hpp>

namespace pagedattn::cli {

void add_info_command(CLI::App& app, int& exit_code);
void add_select_command(CLI::App& app, int& exit_code);
void add_conformance_command(CLI::App& app, int& exit_code);
void add_run_command(CLI::App& app, int& exit_code);
void add_bench_command(CLI::App& app, int& exit_code);

// Exit codes shared by the subcommands.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;  // a check failed / nothing fits
inline constexpr int kExitError = 2;   // bad usage or a library error

}  // namespace pagedattn::cli
