// Batch invariance on CPU_ATTN (issue 32): with batch_invariant set, a
// request's output and LSE are the same bits alone and inside batches of 2,
// 17 and 64 other requests (testing/batch_invariance.h).
#include <gtest/gtest.h>

#include <tuple>

#include "backends/cpu_attn/cpu_attn_plan.h"
#include "testing/batch_invariance.h"

namespace pagedattn {
namespace {

using test::InvarianceRequest;

class CpuAttnBatchInvarianceTest : public ::testing::TestWithParam<std::tuple<DType, InvarianceRequest>> {};

TEST_P(CpuAttnBatchInvarianceTest, ARequestIsTheSameBitsAloneAndInAnyBatch) {
  const auto [dtype, target] = GetParam();
  BatchAttentionOptions options;
  options.num_heads = 4;
  options.num_kv_heads = 1;
  options.head_size = 64;
  options.dtype = dtype;
  test::BatchInvarianceCheck check(options, 2 * cpu_attn::kSplitKeys + 100);  // long enough for split decodes
  check.expect_invariant("CPU_ATTN", target, {1, 1, 1, 3, cpu_attn::kSplitMaxQueryTokens, 20, 70});
}

INSTANTIATE_TEST_SUITE_P(
    Targets, CpuAttnBatchInvarianceTest,
    ::testing::Combine(::testing::Values(DType::BF16, DType::F32),
                       ::testing::Values(InvarianceRequest{1, 3000}, InvarianceRequest{1, 200},
                                         InvarianceRequest{5, 2500}, InvarianceRequest{37, 2100})));

}  // namespace
}  // namespace pagedattn
