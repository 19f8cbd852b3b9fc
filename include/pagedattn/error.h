// The one exception type of the library and the helpers that build its
// messages. Library code never aborts on user input: it throws Error, naming
// the argument, the value it expected and the value it was given.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace pagedattn {

enum class ErrorKind {
  InvalidArgument,  // the caller passed something malformed
  Unsupported,      // well-formed, but no backend/kernel implements it
  OutOfMemory,      // an allocation failed
  Device,           // the device runtime reported a failure
};

std::string_view error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message);
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

// Throws InvalidArgument: "<where>: <argument> must be <expected>, got <actual>".
[[noreturn]] void throw_invalid(std::string_view where, std::string_view argument,
                                std::string_view expected, std::string_view actual);

// Throws Unsupported: "<where>: <what>".
[[noreturn]] void throw_unsupported(std::string_view where, std::string_view what);

// Checks `cond`; on failure throws InvalidArgument with the formatted pieces.
template <typename Expected, typename Actual>
void check_arg(bool cond, std::string_view where, std::string_view argument, const Expected& expected,
               const Actual& actual) {
  if (!cond) throw_invalid(where, argument, fmt::format("{}", expected), fmt::format("{}", actual));
}

}  // namespace pagedattn
