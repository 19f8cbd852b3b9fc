// Subcommands of the `pagedattn` CLI. Each add_* registers its options and a
// callback that stores the process exit code in `exit_code`.
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

namespace pagedattn::cli {

void add_info_command(CLI::App& app, int& exit_code);
void add_select_command(CLI::App& app, int& exit_code);
void add_conformance_command(CLI::App& app, int& exit_code);
void add_run_command(CLI::App& app, int& exit_code);
void add_bench_command(CLI::App& app, int& exit_code);

// Exit codes of every subcommand (README's CLI section, `--help`'s footer).
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;       // a check failed, or no backend fits
inline constexpr int kExitUsage = 2;        // bad command line, invalid argument or unsupported configuration
inline constexpr int kExitNothingRan = 3;   // nothing was checked or run: every case skipped or filtered
                                            // out, every request rejected
inline constexpr int kExitOutOfMemory = 4;  // an allocation failed
inline constexpr int kExitRuntime = 5;      // a device or I/O failure, or an internal error

// `--help`'s footer.
inline constexpr std::string_view kExitCodesHelp =
    "Exit codes:\n"
    "  0  success\n"
    "  1  a check failed, or no backend fits\n"
    "  2  bad usage: command line, invalid argument, unsupported configuration\n"
    "  3  nothing ran: every case skipped or filtered out, every request rejected\n"
    "  4  out of memory\n"
    "  5  device, I/O or internal error\n";

// Upper bounds of the model-shape options shared by the subcommands: far above
// any real model, low enough that products of them stay far from overflow.
inline constexpr int kMaxHeads = 1024;
inline constexpr int kMaxHeadSize = 4096;
inline constexpr int kMaxBlockSize = 1 << 16;
inline constexpr int kMaxThreads = 1024;

// A validator for an integer or floating-point option in [min, max]. Its
// message names the range as the user would write it (CLI::Range spells a
// double's bounds out to 300 digits), and it rejects NaN and infinities.
template <typename T>
CLI::Validator in_range(T min, T max) {
  static_assert(std::is_arithmetic_v<T>);
  return CLI::Validator(
      [min, max](std::string& input) -> std::string {
        T value{};
        bool parsed = false;
        if constexpr (std::is_integral_v<T>) {
          const auto [end, ec] = std::from_chars(input.data(), input.data() + input.size(), value);
          parsed = ec == std::errc{} && end == input.data() + input.size();
        } else {
          char* end = nullptr;
          value = static_cast<T>(std::strtod(input.c_str(), &end));
          parsed = !input.empty() && end == input.c_str() + input.size();
        }
        if (parsed && value >= min && value <= max) return {};
        return fmt::format("must be {} in [{}, {}], got {}",
                           std::is_integral_v<T> ? "an integer" : "a number", min, max, input);
      },
      fmt::format("in [{}, {}]", min, max));
}

}  // namespace pagedattn::cli
