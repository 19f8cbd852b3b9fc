// The loopback communicator: all_gather across threads, and its argument checks.
#include <gtest/gtest.h>
#include <pagedattn/parallel.h>

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "testing/rank_threads.h"

namespace pagedattn {
namespace {

using test::run_ranks;

TEST(DcpCommunicator, LoopbackAllGatherInRankOrder) {
  for (const DType dtype : {DType::F32, DType::BF16}) {
    for (const int size : {1, 2, 3, 4}) {
      LoopbackGroup group(size);
      std::vector<std::vector<float>> received(static_cast<std::size_t>(size));
      run_ranks(size, [&](int rank) {
        Communicator& comm = group.communicator(rank);
        EXPECT_EQ(comm.rank(), rank);
        EXPECT_EQ(comm.size(), size);
        // Two calls in a row: the second must not see the first's buffers.
        for (int call = 0; call < 2; ++call) {
          const std::vector<float> mine = {float(rank), float(10 * rank + call), -0.5f, float(call)};
          const Tensor send = Tensor::from_floats(mine, {2, 2}, dtype);
          const Tensor recv = Tensor::empty({size, 2, 2}, dtype);
          comm.all_gather(send, recv);
          received[static_cast<std::size_t>(rank)] = to_float_vector(recv);
        }
      });
      std::vector<float> want;
      for (int r = 0; r < size; ++r) {
        for (const float x : {float(r), float(10 * r + 1), -0.5f, 1.0f}) want.push_back(x);
      }
      for (int r = 0; r < size; ++r) EXPECT_EQ(received[static_cast<std::size_t>(r)], want) << "rank " << r;
    }
  }
}

TEST(DcpCommunicator, LocalArgumentErrorsThrowBeforeCommunicating) {
  // A one-rank group never waits, so each rejected call returns at once.
  LoopbackGroup group(1);
  Communicator& comm = group.communicator(0);
  const Tensor send = Tensor::zeros({2, 3}, DType::F32);
  const auto expect_invalid = [](const std::function<void()>& call, const std::string& fragment) {
    try {
      call();
      ADD_FAILURE() << "expected InvalidArgument containing '" << fragment << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_invalid([&] { comm.all_gather(send, Tensor::zeros({2, 2, 3}, DType::F32)); }, "recv");
  expect_invalid([&] { comm.all_gather(send, Tensor::zeros({1, 2, 3}, DType::BF16)); }, "recv");
  expect_invalid([&] { comm.all_gather(send, Tensor::zeros({1, 2, 4}, DType::F32)); }, "recv");
  expect_invalid(
      [&] {
        comm.all_gather(send.permute({1, 0}), Tensor::zeros({1, 3, 2}, DType::F32));
      },
      "send must be contiguous");
  expect_invalid([&] { group.communicator(1); },
                 "LoopbackGroup::communicator: rank must be in [0, 1) (size), got 1");
  expect_invalid([] { LoopbackGroup bad(0); }, "LoopbackGroup: size must be >= 1, got 0");
}

TEST(DcpCommunicator, MismatchedRanksAllThrow) {
  LoopbackGroup group(2);
  std::vector<int> failures(2, 0);
  run_ranks(2, [&](int rank) {
    const Tensor send = Tensor::zeros({rank + 1}, DType::F32);
    const Tensor recv = Tensor::zeros({2, rank + 1}, DType::F32);
    try {
      group.communicator(rank).all_gather(send, recv);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
      failures[static_cast<std::size_t>(rank)] = 1;
    }
  });
  EXPECT_EQ(failures, (std::vector<int>{1, 1}));
}

TEST(DcpCommunicator, NcclOneRank) {
  if (!nccl_available()) {
    try {
      make_nccl_unique_id();
      ADD_FAILURE() << "expected Unsupported without NCCL";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Unsupported) << e.what();
    }
    return;
  }
  const DeviceAllocator* cuda = find_device_allocator(DeviceType::CUDA);
  if (cuda == nullptr || cuda->device_count() == 0)
    GTEST_SKIP() << "NCCL is built in but no CUDA device is present";
  const std::unique_ptr<Communicator> comm = make_nccl_communicator(make_nccl_unique_id(), 1, 0, 0);
  const std::vector<float> values = {1.0f, -2.5f, 3.25f};
  const Tensor send = Tensor::from_floats(values, {3}, DType::BF16, Device::cuda(0));
  const Tensor recv = Tensor::zeros({1, 3}, DType::BF16, Device::cuda(0));
  comm->all_gather(send, recv);
  EXPECT_EQ(to_float_vector(recv), values);
}

}  // namespace
}  // namespace pagedattn
