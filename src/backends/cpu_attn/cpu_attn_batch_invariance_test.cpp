// Batch invariance (issue 32): with batch_invariant set, a request's output
// and LSE are the same bits alone and inside batches of 2, 17 and 64 other
// requests (decodes, split decodes, prefills), whatever its place in the batch.
#include <pagedattn/batch_attention.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "backends/cpu_attn/cpu_attn_plan.h"
#include "testing/normal_tensors.h"

namespace pagedattn {
namespace {

constexpr int kHeads = 4;
constexpr int kKvHeads = 1;
constexpr int kHeadSize = 64;
constexpr int kBlockSize = 16;
constexpr int kMaxKeys = 2 * cpu_attn::kSplitKeys + 100;  // long enough for split decodes
constexpr int kBlocksPerRequest = (kMaxKeys + kBlockSize - 1) / kBlockSize;
constexpr int kMaxOthers = 64;
constexpr std::int64_t kNumBlocks = static_cast<std::int64_t>(kMaxOthers + 1) * kBlocksPerRequest;

struct Request {
  int query_len;
  int seq_len;
};

class CpuAttnBatchInvarianceTest : public ::testing::TestWithParam<std::tuple<DType, Request>> {};

// Runs `target` at position `place` among `others`; returns its output and LSE bytes.
std::vector<std::uint8_t> run_target(BatchAttention& attn, const KVCacheView& cache, const Tensor& target_q,
                                     Request target, const std::vector<Request>& others, std::size_t place,
                                     DType dtype, test::NormalTensors& random) {
  std::vector<Request> batch = others;
  batch.insert(batch.begin() + static_cast<std::ptrdiff_t>(place), target);
  std::vector<std::int32_t> qsl{0};
  std::vector<std::int32_t> seq_lens;
  std::vector<std::int32_t> table;
  for (std::size_t r = 0; r < batch.size(); ++r) {
    qsl.push_back(qsl.back() + batch[r].query_len);
    seq_lens.push_back(batch[r].seq_len);
    // The target always reads blocks [0, kBlocksPerRequest); the others the rest.
    const std::int64_t first = r == place ? 0 : static_cast<std::int64_t>(r < place ? r + 1 : r) * kBlocksPerRequest;
    for (int b = 0; b < kBlocksPerRequest; ++b) table.push_back(static_cast<std::int32_t>(first + b));
  }
  const int tokens = qsl.back();
  const int target_row = qsl[place];
  Tensor q = random({tokens, kHeads, kHeadSize}, dtype);
  copy_tensor(q.slice(0, target_row, target_row + target.query_len), target_q);
  Tensor out = Tensor::zeros({tokens, kHeads, kHeadSize}, dtype);
  Tensor lse = Tensor::zeros({kHeads, tokens}, DType::F32);
  attn.plan(qsl, seq_lens, table, kBlocksPerRequest);
  attn.run(q, {}, {}, cache, out, lse);
  std::vector<std::uint8_t> bits = to_byte_vector(out.slice(0, target_row, target_row + target.query_len));
  const std::vector<std::uint8_t> lse_bits = to_byte_vector(lse.slice(1, target_row, target_row + target.query_len));
  bits.insert(bits.end(), lse_bits.begin(), lse_bits.end());
  return bits;
}

TEST_P(CpuAttnBatchInvarianceTest, ARequestIsTheSameBitsAloneAndInAnyBatch) {
  const auto [dtype, target] = GetParam();
  std::mt19937 rng(7);  // the other requests' lengths
  test::NormalTensors random(7);
  const Tensor key_cache = random({kNumBlocks, kBlockSize, kKvHeads, kHeadSize}, dtype);
  const Tensor value_cache = random({kNumBlocks, kBlockSize, kKvHeads, kHeadSize}, dtype);
  const KVCacheView cache{key_cache, value_cache};
  BatchAttentionOptions options;
  options.num_heads = kHeads;
  options.num_kv_heads = kKvHeads;
  options.head_size = kHeadSize;
  options.dtype = dtype;
  options.block_size = kBlockSize;
  options.batch_invariant = true;
  BatchAttention attn(options);
  ASSERT_EQ(attn.backend().name(), "CPU_ATTN");
  const Tensor target_q = random({target.query_len, kHeads, kHeadSize}, dtype);

  const std::vector<std::uint8_t> alone = run_target(attn, cache, target_q, target, {}, 0, dtype, random);
  std::uniform_int_distribution<int> keys(1, kMaxKeys);
  const std::vector<int> query_lens{1, 1, 1, 3, cpu_attn::kSplitMaxQueryTokens, 20, 70};
  for (const int count : {2, 17, kMaxOthers}) {
    std::vector<Request> others;
    for (int i = 0; i < count; ++i) {
      const int seq = keys(rng);
      others.push_back({std::min(seq, query_lens[static_cast<std::size_t>(i) % query_lens.size()]), seq});
    }
    for (const std::size_t place : {std::size_t{0}, static_cast<std::size_t>(count / 2), static_cast<std::size_t>(count)}) {
      EXPECT_EQ(run_target(attn, cache, target_q, target, others, place, dtype, random), alone)
          << "with " << count << " other requests, at position " << place;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Targets, CpuAttnBatchInvarianceTest,
    ::testing::Combine(::testing::Values(DType::BF16, DType::F32),
                       ::testing::Values(Request{1, 3000}, Request{1, 200}, Request{5, 2500}, Request{37, 2100})));

}  // namespace
}  // namespace pagedattn
