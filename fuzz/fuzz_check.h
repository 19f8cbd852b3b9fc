// What the fuzz targets share: a violated invariant is a finding, so it
// prints what was violated and aborts, and libFuzzer keeps the input as
// crash-<sha1>. Library calls either succeed or throw pagedattn::Error; any
// other exception escapes LLVMFuzzerTestOneInput and aborts the same way.
#pragma once

#include <fmt/format.h>
#include <pagedattn/error.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>

namespace pagedattn::fuzz {

[[noreturn]] inline void violated(std::string_view what) {
  fmt::print(stderr, "invariant violated: {}\n", what);
  std::fflush(stderr);
  std::abort();
}

// The message is formatted only when the check fails, so hot loops pay for
// the comparison alone.
template <typename... Args>
void require(bool ok, fmt::format_string<Args...> what, Args&&... args) {
  if (!ok) violated(fmt::format(what, std::forward<Args>(args)...));
}

// An Error a call threw must have the given kind and, for InvalidArgument, a
// message that names the expected and the given value ("... must be
// <expected>, got <actual>"). For calls whose errors may come from layers
// below the API (a backend's own checks), so that `where` varies.
inline void require_error(const Error& e, ErrorKind kind) {
  const std::string message = e.what();
  require(e.kind() == kind, "'{}' is a {} error, expected {}", message, error_kind_name(e.kind()),
          error_kind_name(kind));
  if (kind == ErrorKind::InvalidArgument) {
    const std::size_t must = message.find(" must be ");
    require(must != std::string::npos && message.find(", got ", must) != std::string::npos,
            "'{}' does not name the expected and the given value", message);
  }
}

// As above, and the message starts with "<where>: ".
inline void require_error(const Error& e, ErrorKind kind, std::string_view where) {
  require_error(e, kind);
  const std::string message = e.what();
  require(message.starts_with(std::string(where) + ": "), "'{}' does not start with '{}: '", message, where);
}

}  // namespace pagedattn::fuzz

// The libFuzzer entry points of a target that runs CPU_ATTN, each input given
// to fuzz_one(FuzzedDataProvider&): one pool thread, as the fuzzer runs beside
// other work and the targets' bitwise checks rely on CPU_ATTN's results not
// depending on the thread count.
#define PAGEDATTN_FUZZ_CPU_ATTN_TARGET(fuzz_one)                                          \
  extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {                  \
    setenv("PAGEDATTN_NUM_THREADS", "1", /*overwrite=*/0);                                \
    return 0;                                                                             \
  }                                                                                       \
  extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {     \
    FuzzedDataProvider in(data, size);                                                    \
    fuzz_one(in);                                                                         \
    return 0;                                                                             \
  }
