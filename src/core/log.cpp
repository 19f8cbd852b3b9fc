#include <pagedattn/log.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace pagedattn {
namespace {

LogLevel level_from_env() {
  const char* env = std::getenv("PAGEDATTN_LOG_LEVEL");
  if (env == nullptr) return LogLevel::Warning;
  const std::string v(env);
  if (v == "debug") return LogLevel::Debug;
  if (v == "info") return LogLevel::Info;
  if (v == "error") return LogLevel::Error;
  if (v == "off") return LogLevel::Off;
  return LogLevel::Warning;
}

std::atomic<LogLevel>& level_slot() {
  static std::atomic<LogLevel> level{level_from_env()};
  return level;
}

std::string_view level_tag(LogLevel level) {
  switch (level) {
    case LogLevel::Debug:
      return "debug";
    case LogLevel::Info:
      return "info";
    case LogLevel::Warning:
      return "warning";
    case LogLevel::Error:
      return "error";
    case LogLevel::Off:
      break;
  }
  return "";
}

}  // namespace

LogLevel log_level() { return level_slot().load(std::memory_order_relaxed); }

void set_log_level(LogLevel level) { level_slot().store(level, std::memory_order_relaxed); }

void log_message(LogLevel level, std::string_view message) {
  if (level < log_level() || level == LogLevel::Off) return;
  const std::string line = fmt::format("[pagedattn {}] {}\n", level_tag(level), message);
  std::fputs(line.c_str(), stderr);
}

}  // namespace pagedattn
