#include <pagedattn/error.h>

namespace pagedattn {

std::string_view error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidArgument:
      return "invalid argument";
    case ErrorKind::Unsupported:
      return "unsupported";
    case ErrorKind::OutOfMemory:
      return "out of memory";
    case ErrorKind::Device:
      return "device error";
  }
  return "error";
}

Error::Error(ErrorKind kind, std::string message) : std::runtime_error(std::move(message)), kind_(kind) {}

void throw_invalid(std::string_view where, std::string_view argument, std::string_view expected,
                   std::string_view actual) {
  throw Error(ErrorKind::InvalidArgument, fmt::format("{}: {} must be {}, got {}", where, argument, expected, actual));
}

void throw_unsupported(std::string_view where, std::string_view what) {
  throw Error(ErrorKind::Unsupported, fmt::format("{}: {}", where, what));
}

}  // namespace pagedattn
