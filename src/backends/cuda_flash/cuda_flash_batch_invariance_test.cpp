// Batch invariance on CUDA_FLASH (issue 32): with batch_invariant set, a
// request's output and LSE are the same bits alone and inside batches of 2,
// 17 and 64 other requests (testing/batch_invariance.h): splits come from the
// request alone (kInvariantSplitKeys) and every step runs the mixed kernel.
// Skipped without a CUDA device.
#include <gtest/gtest.h>
#include <pagedattn/backend/registry.h>

#include <tuple>

#include "flash_planner.h"
#include "testing/batch_invariance.h"

namespace pagedattn {
namespace {

using test::InvarianceRequest;

class CudaFlashBatchInvarianceTest : public ::testing::TestWithParam<std::tuple<DType, InvarianceRequest>> {};

TEST_P(CudaFlashBatchInvarianceTest, ARequestIsTheSameBitsAloneAndInAnyBatch) {
  BackendRegistry::instance();
  const DeviceAllocator* cuda = find_device_allocator(DeviceType::CUDA);
  if (cuda == nullptr || cuda->device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const auto [dtype, target] = GetParam();
  BatchAttentionOptions options;
  options.num_heads = 8;
  options.num_kv_heads = 2;
  options.head_size = 128;
  options.dtype = dtype;
  options.device = Device::cuda();
  test::BatchInvarianceCheck check(options, 3 * cuda_flash::kInvariantSplitKeys + 100);  // split decodes
  check.expect_invariant("CUDA_FLASH", target, {1, 1, 1, 3, cuda_flash::kDecodeMaxTokens, 20, 70, 300});
}

INSTANTIATE_TEST_SUITE_P(
    Targets, CudaFlashBatchInvarianceTest,
    ::testing::Combine(::testing::Values(DType::BF16, DType::F16),
                       ::testing::Values(InvarianceRequest{1, 1600}, InvarianceRequest{1, 200},
                                         InvarianceRequest{3, 1300}, InvarianceRequest{37, 1000},
                                         InvarianceRequest{300, 1500})));

}  // namespace
}  // namespace pagedattn
