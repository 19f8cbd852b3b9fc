// Decode context parallelism on CUDA devices (issue 6): the same step on one
// GPU without DCP and on N GPUs, one thread per rank on device `rank`, each
// with its own KV cache holding only its tokens, CUDA_FLASH for attention,
// NCCL for the all-gather and a preallocated workspace. Every rank's output
// and LSE must be within the bf16 tolerances of the one-GPU result (itself
// checked against REFERENCE on the CPU), and all ranks bitwise equal.
//
// OneRankNcclGroup runs on any machine with a GPU and NCCL (N = 1 through
// NCCL); MatchesOneGpu runs N = 2, 4, 8 as far as the visible devices allow
// and skips below two. A wrong slot mapping, gather, scatter or merge moves
// the output by far more than the tolerance (the CPU test, same helper,
// shows it on REFERENCE).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <pagedattn/parallel.h>
#include <pagedattn/backend/registry.h>

#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "parallel/dcp_test_step.h"
#include "testing/rank_threads.h"

namespace pagedattn {
namespace {

using test::Result;
using test::Step;

// Llama-3-8B's attention shape (GQA 32/8, head size 128), bf16, block 16.
constexpr test::DcpStepDims kDims{.heads = 32, .kv_heads = 8, .head_size = 128};
constexpr int kMultiGpuSizes[] = {2, 4, 8};
constexpr int kInterleaves[] = {1, 16};
// The workspace is sized beyond the step, as an engine sizes it for its
// largest step, so each step uses a leading part of it.
constexpr std::int64_t kWorkspaceSlackTokens = 7;

// The backend when this machine can run the test; otherwise why not.
struct GpuSetup {
  const AttentionBackend* flash = nullptr;
  int devices = 0;
  std::string missing;  // empty when runnable
};

GpuSetup gpu_setup() {
  GpuSetup g;
  if (!nccl_available()) {
    g.missing = "this build has no NCCL (configure with CUDA and NCCL found)";
    return g;
  }
  g.flash = BackendRegistry::instance().find("CUDA_FLASH");
  const DeviceAllocator* cuda = find_device_allocator(DeviceType::CUDA);
  g.devices = cuda == nullptr ? 0 : cuda->device_count();
  if (g.flash == nullptr) g.missing = "this build has no CUDA_FLASH backend";
  if (g.devices == 0) g.missing = "no CUDA device";
  return g;
}

// Decodes at lengths from 1 (only rank 0 holds a key) past several blocks
// per rank, some shorter than N * interleave for every N (so upper ranks hold
// nothing of them); a chunked prefill (16 new tokens after 184) and a whole
// prefill of 6.
Step gpu_step() {
  return test::make_step(
      {{1, 1}, {1, 5}, {1, 37}, {1, 100}, {1, 129}, {1, 300}, {1, 1000}, {16, 200}, {6, 6}}, 21, kDims);
}

// The one-GPU result, checked against REFERENCE on the CPU.
Result one_gpu_result(const Step& step, const AttentionBackend& flash) {
  const Result one = test::run_rank(step, {}, nullptr, flash, Device::cuda(0));
  const AttentionBackend* reference = BackendRegistry::instance().find("REFERENCE");
  EXPECT_NE(reference, nullptr);
  if (reference != nullptr)
    test::expect_ranks_match({one}, test::run_rank(step, {}, nullptr, *reference), "one GPU");
  return one;
}

// The step on `size` GPUs through NCCL, for each interleave.
void expect_dcp_matches(const Step& step, const Result& one_gpu, int size, const AttentionBackend& flash) {
  const std::int64_t workspace_tokens = step.query.size(0) + kWorkspaceSlackTokens;
  for (const int interleave : kInterleaves) {
    const NcclUniqueId id = make_nccl_unique_id();
    std::vector<Result> results(static_cast<std::size_t>(size));
    test::run_ranks(size, [&](int rank) {
      const std::unique_ptr<Communicator> comm = make_nccl_communicator(id, size, rank, rank);
      const DcpConfig dcp{.size = size, .rank = rank, .interleave = interleave};
      results[static_cast<std::size_t>(rank)] = test::run_rank(
          step, dcp, comm.get(), flash, Device::cuda(rank), {.workspace_tokens = workspace_tokens});
    });
    test::expect_ranks_match(results, one_gpu, fmt::format("{} GPUs, interleave {}", size, interleave));
  }
}

TEST(DcpMultiGpu, OneRankNcclGroupMatchesOneGpu) {
  const GpuSetup g = gpu_setup();
  if (!g.missing.empty()) GTEST_SKIP() << g.missing;
  const Step step = gpu_step();
  const Result one = one_gpu_result(step, *g.flash);
  expect_dcp_matches(step, one, 1, *g.flash);
}

TEST(DcpMultiGpu, MatchesOneGpu) {
  const GpuSetup g = gpu_setup();
  if (!g.missing.empty()) GTEST_SKIP() << g.missing;
  if (g.devices < kMultiGpuSizes[0]) {
    GTEST_SKIP() << "needs " << kMultiGpuSizes[0] << " or more CUDA devices, found " << g.devices;
  }
  const Step step = gpu_step();
  const Result one = one_gpu_result(step, *g.flash);
  std::string ran;
  std::string skipped;
  for (const int size : kMultiGpuSizes) {
    if (size > g.devices) {
      skipped += fmt::format(" {}", size);
      continue;
    }
    expect_dcp_matches(step, one, size, *g.flash);
    ran += fmt::format(" {}", size);
  }
  // Which group sizes this machine proved, in the log and the XML report.
  RecordProperty("dcp_sizes_run", ran);
  std::cout << "[ DCP      ] " << g.devices << " CUDA devices: ran N =" << ran
            << (skipped.empty() ? "" : "; not enough devices for N =" + skipped) << "\n";
}

}  // namespace
}  // namespace pagedattn
