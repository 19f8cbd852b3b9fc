// Minimal leveled logging to stderr. The level comes from PAGEDATTN_LOG_LEVEL
// (debug, info, warning, error, off; default warning) or set_log_level.
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace pagedattn {

enum class LogLevel { Debug = 0, Info = 1, Warning = 2, Error = 3, Off = 4 };

LogLevel log_level();
void set_log_level(LogLevel level);
void log_message(LogLevel level, std::string_view message);

template <typename... Args>
void log_at(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (level >= log_level()) log_message(level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace pagedattn
