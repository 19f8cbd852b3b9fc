// Test helper shared by the test files: a call must throw pagedattn::Error of
// one kind, with a message that names what was wrong.
#pragma once

#include <gtest/gtest.h>
#include <pagedattn/error.h>

#include <functional>
#include <string>

namespace pagedattn::test {

inline void expect_error(ErrorKind kind, const std::function<void()>& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "expected an error containing '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message '" << e.what() << "' lacks '" << fragment << "'";
  }
}

inline void expect_invalid(const std::function<void()>& call, const std::string& fragment) {
  expect_error(ErrorKind::InvalidArgument, call, fragment);
}

}  // namespace pagedattn::test
