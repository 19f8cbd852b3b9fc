// The batch-invariance check (issue 32) shared by the backends that declare
// it: with batch_invariant set, a request's output and LSE must be the same
// bits alone and inside batches of 2, 17 and 64 other requests (decodes,
// split decodes, prefills), at the front, the middle and the end.
#pragma once

#include <pagedattn/batch_attention.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <random>
#include <string_view>
#include <vector>

#include "testing/normal_tensors.h"

namespace pagedattn::test {

struct InvarianceRequest {
  int query_len;
  int seq_len;
};

// gtest's name for a parameter: q<query_len>s<seq_len>.
inline void PrintTo(const InvarianceRequest& r, std::ostream* os) { *os << "q" << r.query_len << "s" << r.seq_len; }

inline constexpr int kInvarianceBlockSize = 16;
inline constexpr int kInvarianceMaxOthers = 64;

// One target request run among other requests by a BatchAttention whose
// cache holds a block range per request (the target always reads the first).
class BatchInvarianceCheck {
 public:
  // `max_keys`: the longest context drawn (long enough for split decodes).
  BatchInvarianceCheck(BatchAttentionOptions options, int max_keys)
      : options_(options),
        blocks_per_request_((max_keys + kInvarianceBlockSize - 1) / kInvarianceBlockSize),
        max_keys_(max_keys) {
    options_.block_size = kInvarianceBlockSize;
    options_.batch_invariant = true;
    const std::int64_t num_blocks = static_cast<std::int64_t>(kInvarianceMaxOthers + 1) * blocks_per_request_;
    const Dims shape{num_blocks, kInvarianceBlockSize, options_.num_kv_heads, options_.head_size};
    key_cache_ = random_(shape, options_.dtype).to(options_.device);
    value_cache_ = random_(shape, options_.dtype).to(options_.device);
  }

  // Expects `target` (its queries drawn once) to give the same bits alone and
  // in every batch; `backend`: the backend the options must select.
  void expect_invariant(std::string_view backend, InvarianceRequest target, const std::vector<int>& other_query_lens) {
    BatchAttention attn(options_);
    ASSERT_EQ(attn.backend().name(), backend);
    const Tensor target_q = random_({target.query_len, options_.num_heads, options_.head_size}, options_.dtype);
    const std::vector<std::uint8_t> alone = run(attn, target_q, target, {}, 0);
    std::mt19937 rng(7);  // the other requests' lengths
    std::uniform_int_distribution<int> keys(1, max_keys_);
    for (const int count : {2, 17, kInvarianceMaxOthers}) {
      std::vector<InvarianceRequest> others;
      for (int i = 0; i < count; ++i) {
        const int seq = keys(rng);
        others.push_back({std::min(seq, other_query_lens[static_cast<std::size_t>(i) % other_query_lens.size()]), seq});
      }
      for (const std::size_t place : {std::size_t{0}, static_cast<std::size_t>(count / 2), static_cast<std::size_t>(count)}) {
        EXPECT_EQ(run(attn, target_q, target, others, place), alone)
            << "with " << count << " other requests, at position " << place;
      }
    }
  }

 private:
  // Runs `target` at position `place` among `others`; returns its output and LSE bytes.
  std::vector<std::uint8_t> run(BatchAttention& attn, const Tensor& target_q, InvarianceRequest target,
                                const std::vector<InvarianceRequest>& others, std::size_t place) {
    std::vector<InvarianceRequest> batch = others;
    batch.insert(batch.begin() + static_cast<std::ptrdiff_t>(place), target);
    std::vector<std::int32_t> qsl{0};
    std::vector<std::int32_t> seq_lens;
    std::vector<std::int32_t> table;
    for (std::size_t r = 0; r < batch.size(); ++r) {
      qsl.push_back(qsl.back() + batch[r].query_len);
      seq_lens.push_back(batch[r].seq_len);
      const std::int64_t first =
          r == place ? 0 : static_cast<std::int64_t>(r < place ? r + 1 : r) * blocks_per_request_;
      for (int b = 0; b < blocks_per_request_; ++b) table.push_back(static_cast<std::int32_t>(first + b));
    }
    const int tokens = qsl.back();
    const int target_row = qsl[place];
    Tensor q = random_({tokens, options_.num_heads, options_.head_size}, options_.dtype);
    copy_tensor(q.slice(0, target_row, target_row + target.query_len), target_q);
    Tensor out = Tensor::zeros({tokens, options_.num_heads, options_.head_size}, options_.dtype, options_.device);
    Tensor lse = Tensor::zeros({options_.num_heads, tokens}, DType::F32, options_.device);
    attn.plan(qsl, seq_lens, table, blocks_per_request_);
    attn.run(q.to(options_.device), {}, {}, KVCacheView{key_cache_, value_cache_}, out, lse);
    const Tensor out_host = out.to(Device::cpu());
    const Tensor lse_host = lse.to(Device::cpu());
    std::vector<std::uint8_t> bits = to_byte_vector(out_host.slice(0, target_row, target_row + target.query_len));
    const std::vector<std::uint8_t> lse_bits =
        to_byte_vector(lse_host.slice(1, target_row, target_row + target.query_len));
    bits.insert(bits.end(), lse_bits.begin(), lse_bits.end());
    return bits;
  }

  BatchAttentionOptions options_;
  int blocks_per_request_;
  int max_keys_;
  NormalTensors random_{7};
  Tensor key_cache_;
  Tensor value_cache_;
};

}  // namespace pagedattn::test
