// Decode context parallelism: the slot-mapping convention, each rank's share
// of a step, and the end-to-end check that attention split over 2 and 4
// ranks (threads with a loopback communicator, one KV cache each) gives what
// one rank gives.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <pagedattn/attention.h>
#include <pagedattn/conformance.h>
#include <pagedattn/ops.h>
#include <pagedattn/parallel.h>
#include <pagedattn/backend/registry.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "parallel/dcp_test_step.h"
#include "testing/expect_error.h"
#include "testing/rank_threads.h"

namespace pagedattn {
namespace {

using test::expect_error;
using test::make_step;
using test::random_values;
using test::Result;
using test::run_rank;
using test::run_ranks;
using test::Step;


// ------------------------------------------------------------ slot mapping

TEST(DcpSlotMapping, OwnerAndLocalPosition) {
  // interleave 1 over 2 ranks: even positions on rank 0, odd on rank 1.
  const DcpConfig two{.size = 2, .rank = 0, .interleave = 1};
  EXPECT_EQ(dcp_owner_rank(8, two), 0);
  EXPECT_EQ(dcp_owner_rank(9, two), 1);
  EXPECT_EQ(dcp_local_position(9, two), 4);
  // interleave 2 over 2 ranks: positions 0-1 on rank 0, 2-3 on rank 1, 4-5 on rank 0, ...
  const DcpConfig pairs{.size = 2, .rank = 0, .interleave = 2};
  EXPECT_EQ(dcp_owner_rank(5, pairs), 0);
  EXPECT_EQ(dcp_owner_rank(6, pairs), 1);
  EXPECT_EQ(dcp_local_position(5, pairs), 3);
  EXPECT_EQ(dcp_local_position(6, pairs), 2);
}

TEST(DcpSlotMapping, VllmSlotsOfOneRequest) {
  // BS 4 over 2 ranks: block-table entry b covers positions [8b, 8b + 8), and
  // each rank keeps its 4 of them in its own block b. Position 9 is rank 1's
  // local position 4: block blocks[1] = 3, offset 0 -> slot 12.
  const std::vector<std::int32_t> blocks = {7, 3};
  const DcpConfig rank0{.size = 2, .rank = 0};
  const DcpConfig rank1{.size = 2, .rank = 1};
  EXPECT_EQ(dcp_slots_for_positions(blocks, 4, 6, 4, rank0), (std::vector<std::int64_t>{31, -1, 12, -1}));
  EXPECT_EQ(dcp_slots_for_positions(blocks, 4, 6, 4, rank1), (std::vector<std::int64_t>{-1, 31, -1, 12}));
  EXPECT_EQ(dcp_local_seq_len(10, rank0), 5);
  EXPECT_EQ(dcp_local_seq_len(10, rank1), 5);
  EXPECT_EQ(dcp_local_seq_len(11, rank1), 5);
}

TEST(DcpSlotMapping, EveryPositionOnExactlyOneRankInOrder) {
  constexpr int kBlockSize = 8;
  for (const int size : {1, 2, 3, 4}) {
    for (const int interleave : {1, 2, 8}) {
      constexpr int kSeqLen = 203;
      const int per_block = kBlockSize * size;
      std::vector<std::int32_t> blocks((kSeqLen + per_block - 1) / per_block);
      std::iota(blocks.begin(), blocks.end(), 1);
      std::vector<int> owners(kSeqLen, 0);
      int total = 0;
      for (int rank = 0; rank < size; ++rank) {
        const DcpConfig dcp{.size = size, .rank = rank, .interleave = interleave};
        const std::vector<std::int64_t> slots = dcp_slots_for_positions(blocks, kBlockSize, 0, kSeqLen, dcp);
        // The rank's slots are exactly those of its local positions 0, 1, ...
        // laid out as one ordinary sequence over the same block table.
        std::vector<std::int64_t> mine;
        for (int p = 0; p < kSeqLen; ++p) {
          if (slots[static_cast<std::size_t>(p)] < 0) continue;
          ++owners[static_cast<std::size_t>(p)];
          EXPECT_EQ(dcp_owner_rank(p, dcp), rank);
          mine.push_back(slots[static_cast<std::size_t>(p)]);
        }
        const int local = dcp_local_seq_len(kSeqLen, dcp);
        EXPECT_EQ(static_cast<int>(mine.size()), local) << size << " " << interleave << " " << rank;
        EXPECT_EQ(mine, slots_for_positions(blocks, kBlockSize, 0, local));
        total += local;
      }
      EXPECT_EQ(total, kSeqLen);
      EXPECT_TRUE(std::all_of(owners.begin(), owners.end(), [](int n) { return n == 1; }));
    }
  }
}

TEST(DcpSlotMapping, ConfigErrorsNameTheArgument) {
  const std::vector<std::int32_t> blocks = {1};
  const auto slots = [&](DcpConfig dcp) { dcp_slots_for_positions(blocks, 16, 0, 1, dcp); };
  expect_error(
      ErrorKind::InvalidArgument, [&] { slots({.size = 0}); }, "dcp.size must be >= 1, got 0");
  expect_error(
      ErrorKind::InvalidArgument, [&] { slots({.size = 2, .rank = 2}); },
      "dcp.rank must be in [0, 2) (dcp.size), got 2");
  expect_error(
      ErrorKind::InvalidArgument, [&] { slots({.size = 2, .interleave = 0}); },
      "dcp.interleave must be >= 1, got 0");
  expect_error(
      ErrorKind::InvalidArgument, [&] { slots({.size = 2, .interleave = 3}); },
      "dcp.interleave must be a divisor of block_size (16), got 3");
  expect_error(
      ErrorKind::InvalidArgument, [&] { dcp_slots_for_positions(blocks, 16, 30, 3, {.size = 2}); },
      "dcp_slots_for_positions: blocks size must be >= 2");
}

TEST(DcpSlotMapping, LocalBatchOfDecodeAndPrefill) {
  // A decode at position 9 and a 3-token prefill, BS 4 over 2 ranks.
  const std::vector<RequestSpec> requests = {{.query_len = 1, .seq_len = 10, .blocks = {7, 3}},
                                             {.query_len = 3, .seq_len = 3, .blocks = {5}}};
  const DcpLocalBatch r0 = make_dcp_local_batch(requests, {.block_size = 4}, {.size = 2, .rank = 0});
  const DcpLocalBatch r1 = make_dcp_local_batch(requests, {.block_size = 4}, {.size = 2, .rank = 1});
  EXPECT_EQ(r0.num_tokens, 4);
  // Rank 0 sees a key for every token (it holds position 0).
  EXPECT_EQ(r0.token_rows, (std::vector<std::int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(std::vector<std::int32_t>(r0.metadata.seq_lens_host().begin(), r0.metadata.seq_lens_host().end()),
            (std::vector<std::int32_t>{5, 1, 1, 2}));
  EXPECT_EQ(to_float_vector(r0.metadata.slot_mapping), (std::vector<float>{-1, 20, -1, 21}));
  // Rank 1 holds nothing of [0, 0], so the prefill's first token is left out.
  EXPECT_EQ(r1.token_rows, (std::vector<std::int32_t>{0, 2, 3}));
  EXPECT_EQ(std::vector<std::int32_t>(r1.metadata.seq_lens_host().begin(), r1.metadata.seq_lens_host().end()),
            (std::vector<std::int32_t>{5, 1, 1}));
  EXPECT_EQ(to_float_vector(r1.metadata.slot_mapping), (std::vector<float>{12, 20, -1}));
  // Interleave 4 over 4 ranks: the 10 positions fill ranks 0 to 2, none of rank 3.
  const DcpLocalBatch r3 =
      make_dcp_local_batch(requests, {.block_size = 4}, {.size = 4, .rank = 3, .interleave = 4});
  EXPECT_TRUE(r3.empty());
  EXPECT_EQ(r3.num_tokens, 4);
  expect_error(
      ErrorKind::InvalidArgument,
      [&] { make_dcp_local_batch(requests, {.block_size = 4, .num_padded_slots = 1}, {.size = 2}); },
      "options.num_padded_slots must be 0, got 1");
}

// ------------------------------------------------------ attention, merged

constexpr int kHeads = 4;
constexpr int kKVHeads = 2;
constexpr int kHeadSize = 64;
constexpr int kBlockSize = test::kDcpBlockSize;

// ------------------------------------------------------------------ merge

// dcp_merge of random partial states against the LSE-weighted sum in double,
// on the CPU and (when present) on a CUDA device, whose merge kernel must not
// read an LSE it writes. Ranks 1 and 3 saw no key for token 0.
TEST(DcpMerge, MatchesTheWeightedSum) {
  constexpr int kRanks = 4;
  constexpr int kTokens = 5;
  constexpr int kMergeHeads = 3;
  constexpr int kDim = 32;
  std::mt19937 rng(3);
  std::vector<std::vector<float>> outputs;  // per rank [T, H, D], bf16-rounded
  std::vector<std::vector<float>> lses;     // per rank [H, T]
  std::uniform_real_distribution<float> lse_dist(-3.0f, 6.0f);
  for (int r = 0; r < kRanks; ++r) {
    const Tensor o = Tensor::from_floats(random_values(kTokens * kMergeHeads * kDim, rng),
                                         {kTokens, kMergeHeads, kDim}, DType::BF16);
    outputs.push_back(to_float_vector(o));
    std::vector<float> lse(kMergeHeads * kTokens);
    for (float& x : lse) x = lse_dist(rng);
    if (r % 2 == 1) {
      for (int h = 0; h < kMergeHeads; ++h) {
        lse[static_cast<std::size_t>(h * kTokens)] = -std::numeric_limits<float>::infinity();
        for (int d = 0; d < kDim; ++d) outputs.back()[static_cast<std::size_t>(h * kDim + d)] = 0.0f;
      }
    }
    lses.push_back(lse);
  }
  std::vector<float> want_output(kTokens * kMergeHeads * kDim);
  std::vector<float> want_lse(kMergeHeads * kTokens);
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kMergeHeads; ++h) {
      const std::size_t l = static_cast<std::size_t>(h * kTokens + t);
      double sum = 0.0;
      for (int r = 0; r < kRanks; ++r) sum += std::exp(double(lses[static_cast<std::size_t>(r)][l]));
      want_lse[l] = static_cast<float>(std::log(sum));
      for (int d = 0; d < kDim; ++d) {
        const std::size_t o = static_cast<std::size_t>((t * kMergeHeads + h) * kDim + d);
        double acc = 0.0;
        for (int r = 0; r < kRanks; ++r) {
          acc += std::exp(double(lses[static_cast<std::size_t>(r)][l])) / sum *
                 outputs[static_cast<std::size_t>(r)][o];
        }
        want_output[o] = static_cast<float>(acc);
      }
    }
  }

  std::vector<Device> devices = {Device::cpu()};
  const DeviceAllocator* cuda = find_device_allocator(DeviceType::CUDA);
  if (cuda != nullptr && cuda->device_count() > 0) devices.push_back(Device::cuda(0));
  for (const Device device : devices) {
    LoopbackGroup group(kRanks);
    std::vector<Result> results(kRanks);
    run_ranks(kRanks, [&](int rank) {
      const auto r = static_cast<std::size_t>(rank);
      const Tensor local_output =
          Tensor::from_floats(outputs[r], {kTokens, kMergeHeads, kDim}, DType::BF16).to(device);
      const Tensor local_lse = Tensor::from_floats(lses[r], {kMergeHeads, kTokens}, DType::F32).to(device);
      const DcpMergeWorkspace ws =
          DcpMergeWorkspace::allocate(kRanks, kTokens, kMergeHeads, kDim, DType::BF16, device);
      const Tensor lse = Tensor::empty({kMergeHeads, kTokens}, DType::F32, device);
      // The merged output may overwrite the rank's own partial output.
      dcp_merge(group.communicator(rank), local_output, local_lse, ws, local_output, lse);
      results[r] = {to_float_vector(local_output), to_float_vector(lse)};
    });
    test::expect_ranks_match(results, {want_output, want_lse}, device.is_cuda() ? "cuda" : "cpu");
  }
}

TEST(DcpAttention, MatchesOneRank) {
  const AttentionBackend* reference = BackendRegistry::instance().find("REFERENCE");
  ASSERT_NE(reference, nullptr);
  // Decodes at many lengths (1: only rank 0 holds a key; 100: several blocks
  // per rank), a chunked prefill and a whole prefill; then a short batch that
  // leaves the upper ranks without any key at interleave 16.
  const Step long_step = make_step({{1, 1}, {1, 5}, {1, 37}, {1, 100}, {4, 20}, {6, 6}, {1, 64}}, 7);
  const Step short_step = make_step({{1, 3}, {2, 2}, {1, 12}}, 8);
  for (const Step* step : {&long_step, &short_step}) {
    const Result one = run_rank(*step, {}, nullptr, *reference);
    ASSERT_EQ(one.output.size(), static_cast<std::size_t>(step->query.numel()));
    for (const int size : {2, 4}) {
      for (const int interleave : {1, 4, 16}) {
        LoopbackGroup group(size);
        // Interleave 4 runs on a workspace larger than the step (the step
        // uses its leading part); the others allocate theirs per call.
        const test::DcpRunOptions run{.workspace_tokens = interleave == 4 ? step->query.size(0) + 5 : 0};
        std::vector<Result> results(static_cast<std::size_t>(size));
        run_ranks(size, [&](int rank) {
          const DcpConfig dcp{.size = size, .rank = rank, .interleave = interleave};
          results[static_cast<std::size_t>(rank)] =
              run_rank(*step, dcp, &group.communicator(rank), *reference, Device::cpu(), run);
        });
        const std::string what =
            fmt::format("{} requests, dcp {}, interleave {}", step->shape.size(), size, interleave);
        test::expect_ranks_match(results, one, what);
      }
    }
  }
}

TEST(DcpAttention, OneRankGroupIsTheSingleRankPath) {
  const AttentionBackend* reference = BackendRegistry::instance().find("REFERENCE");
  ASSERT_NE(reference, nullptr);
  const Step step = make_step({{1, 33}, {3, 9}}, 11);
  LoopbackGroup group(1);
  const Result one = run_rank(step, {}, nullptr, *reference);
  const Result dcp = run_rank(step, {}, &group.communicator(0), *reference);
  EXPECT_EQ(dcp.output, one.output);
  EXPECT_EQ(dcp.lse, one.lse);
}

TEST(DcpAttention, RejectsPositionDependentFeatures) {
  const AttentionBackend* reference = BackendRegistry::instance().find("REFERENCE");
  ASSERT_NE(reference, nullptr);
  ModelContext model({.dtype = DType::BF16});
  AttentionOptions opts;
  opts.num_kv_heads = kKVHeads;
  opts.cache_config = CacheConfig{.block_size = kBlockSize};
  opts.prefix = "windowed";
  opts.attn_backend = reference;
  opts.per_layer_sliding_window = 8;
  Attention layer(model, kHeads, kHeadSize, 0.125f, opts);
  LoopbackGroup group(1);
  const DcpLocalBatch batch =
      make_dcp_local_batch(std::vector<RequestSpec>{{.query_len = 1, .seq_len = 1, .blocks = {1}}},
                           {.block_size = kBlockSize}, {});
  const Tensor q = Tensor::zeros({1, kHeads, kHeadSize}, DType::BF16);
  const Tensor kv = Tensor::zeros({1, kKVHeads, kHeadSize}, DType::BF16);
  expect_error(
      ErrorKind::Unsupported,
      [&] { dcp_attention_forward(layer, batch, group.communicator(0), q, kv, kv, q); },
      "dcp_attention_forward: sliding windows with decode context parallelism");
  LoopbackGroup pair(2);
  expect_error(
      ErrorKind::InvalidArgument,
      [&] { dcp_attention_forward(layer, batch, pair.communicator(1), q, kv, kv, q); },
      "dcp_attention_forward: comm.size() must be 1 (batch.dcp.size), got 2");
}

}  // namespace
}  // namespace pagedattn
