#include "bench/batch_spec.h"

#include <gtest/gtest.h>
#include <pagedattn/error.h>

#include "testing/expect_error.h"

namespace pagedattn::bench {
namespace {

using test::expect_invalid;

TEST(BatchSpecTest, ParsesVllmExamples) {
  EXPECT_EQ(parse_batch_spec("q2k"), (std::vector<BatchRequest>{{2048, 2048}}));
  EXPECT_EQ(parse_batch_spec("8q1s8k"), std::vector<BatchRequest>(8, BatchRequest{1, 8192}));
  EXPECT_EQ(parse_batch_spec("q4s1k"), (std::vector<BatchRequest>{{4, 1024}}));
  EXPECT_EQ(parse_batch_spec("8q1kv1k"), std::vector<BatchRequest>(8, BatchRequest{1, 1024}));
  const auto mixed = parse_batch_spec("q1k_16q1s4k");
  ASSERT_EQ(mixed.size(), 17u);
  EXPECT_EQ(mixed.front(), (BatchRequest{1024, 1024}));
  EXPECT_EQ(mixed.back(), (BatchRequest{1, 4096}));
  EXPECT_EQ(parse_batch_spec("2q2k_32q1s1k").size(), 34u);
  EXPECT_EQ(parse_batch_spec("q100s300"), (std::vector<BatchRequest>{{100, 300}}));
}

TEST(BatchSpecTest, RejectsMalformedGroups) {
  for (const char* bad : {"", "8", "q", "qk", "8q1s", "q1x", "0q1", "q1s8k_", "_q1", "q8s4", "q1s2k3",
                          "99999999999q1"}) {
    EXPECT_THROW(parse_batch_spec(bad), Error) << bad;
  }
}

// Every parsed batch can be handed to make_common_metadata: its query tokens
// fit int32, and its request count stays within kMaxBatchRequests.
TEST(BatchSpecTest, RejectsBatchesTooLargeToRepresent) {
  expect_invalid([] { parse_batch_spec("2q2147483647"); },
                 "batch spec: total query tokens must be <= 2147483647, got 4294967294");
  expect_invalid([] { parse_batch_spec("q2147483647_q1"); }, "total query tokens must be <= 2147483647");
  expect_invalid([] { parse_batch_spec("65537q1"); }, "requests must be <= 65536, got 65537");
  expect_invalid([] { parse_batch_spec("2147483647q1"); }, "requests must be <= 65536, got 2147483647");
  expect_invalid([] { parse_batch_spec("64kq1_1kq1"); }, "requests must be <= 65536, got 66560");
  EXPECT_EQ(parse_batch_spec("64kq1").size(), 65536u);
  EXPECT_EQ(parse_batch_spec("q2147483647").size(), 1u);
}

// The message quotes the group; raw bytes once cut it short (a NUL ends what()).
TEST(BatchSpecTest, MessagesEscapeUnprintableBytes) {
  using namespace std::string_view_literals;
  expect_invalid([] { parse_batch_spec("q1_\xe4\x00q\\"sv); },
                 "batch spec: group '\\xe4\\x00q\\x5c' must be [count]q<q_len>[s<seq_len>] with optional k "
                 "suffixes, got no 'q'");
}

TEST(BatchSpecTest, FormatRoundTrips) {
  for (const char* spec : {"q2k", "8q1s8k", "q1k_16q1s4k", "3q5s77"}) {
    EXPECT_EQ(format_batch_spec(parse_batch_spec(spec)), spec);
  }
}

}  // namespace
}  // namespace pagedattn::bench
