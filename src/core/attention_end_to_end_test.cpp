// End-to-end runs of the Attention layer on the REFERENCE backend against
// dense attention computed here.
#include <gtest/gtest.h>
#include <pagedattn/attention.h>
#include <pagedattn/backend/registry.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/attention_test_util.h"
#include "testing/expect_error.h"

namespace pagedattn::test {
namespace {

// -------------------------------------------------- end to end (REFERENCE)

// Dense causal attention of one query row over a request's K/V history.
std::vector<float> naive_row(const std::vector<float>& q_row /*[H, D]*/,
                             const std::vector<float>& keys /*[S, Hkv, D]*/, const std::vector<float>& values,
                             int visible) {
  constexpr int kGroup = kHeads / kKVHeads;
  std::vector<float> out(kHeads * kHeadSize, 0.0f);
  for (int h = 0; h < kHeads; ++h) {
    const int kvh = h / kGroup;
    std::vector<double> scores(static_cast<std::size_t>(visible));
    double max_score = -INFINITY;
    for (int j = 0; j < visible; ++j) {
      double dot = 0.0;
      for (int d = 0; d < kHeadSize; ++d) {
        dot += static_cast<double>(q_row[h * kHeadSize + d]) * keys[(j * kKVHeads + kvh) * kHeadSize + d];
      }
      scores[static_cast<std::size_t>(j)] = dot * kScale;
      max_score = std::max(max_score, dot * kScale);
    }
    double denom = 0.0;
    for (double& s : scores) {
      s = std::exp(s - max_score);
      denom += s;
    }
    for (int d = 0; d < kHeadSize; ++d) {
      double acc = 0.0;
      for (int j = 0; j < visible; ++j) {
        acc += scores[static_cast<std::size_t>(j)] * values[(j * kKVHeads + kvh) * kHeadSize + d];
      }
      out[h * kHeadSize + d] = static_cast<float>(acc / denom);
    }
  }
  return out;
}

const AttentionBackend& reference_backend() {
  const AttentionBackend* backend = BackendRegistry::instance().find("REFERENCE");
  if (backend == nullptr) throw Error(ErrorKind::Unsupported, "REFERENCE backend is not registered");
  return *backend;
}

// Two decoder layers on REFERENCE (chosen by name through the model), the
// second sharing the first's KV cache, over two steps of a mixed batch; every
// output is compared with dense attention over the tokens seen so far.
TEST(AttentionEndToEnd, TwoStepsMatchDenseAttention) {
  ModelOptions m = f32_model();
  m.backend = "REFERENCE";
  ModelContext model(m);
  AttentionOptions o0 = options_for("model.layers.0.attn", reference_backend());
  o0.attn_backend = nullptr;  // selected through ModelOptions::backend
  Attention layer0(model, kHeads, kHeadSize, kScale, o0);
  AttentionOptions o1 = o0;
  o1.prefix = "model.layers.1.attn";
  o1.kv_sharing_target_layer_name = "model.layers.0.attn";
  Attention layer1(model, kHeads, kHeadSize, kScale, o1);
  ASSERT_EQ(&layer0.backend(), &reference_backend());
  EXPECT_EQ(layer0.extra_repr(),
            "head_size=8, num_heads=4, num_kv_heads=2, scale=0.25, backend=ReferenceAttentionImpl");
  allocate_kv_caches(model, {.num_blocks = kNumBlocks, .reserve_null_block = true});
  ModelMetadataBuilder builder(model);

  const std::vector<std::vector<std::int32_t>> blocks{{3, 1, 6}, {7, 5}};
  const std::vector<std::vector<int>> query_lens{{5, 3}, {1, 2}};
  std::vector<std::vector<float>> key_history(2);
  std::vector<std::vector<float>> value_history(2);
  std::vector<int> seq_lens{0, 0};
  constexpr int kRowKV = kKVHeads * kHeadSize;
  constexpr int kRowQ = kHeads * kHeadSize;
  for (std::size_t step = 0; step < query_lens.size(); ++step) {
    std::vector<RequestSpec> requests;
    int tokens = 0;
    for (std::size_t r = 0; r < 2; ++r) {
      seq_lens[r] += query_lens[step][r];
      requests.push_back(RequestSpec{query_lens[step][r], seq_lens[r], blocks[r]});
      tokens += query_lens[step][r];
    }
    MetadataOptions options;
    options.block_size = kBlock;
    ForwardContext context;
    context.layer_metadata = builder.build(make_common_metadata(requests, options));
    ForwardContextScope scope(std::move(context));

    const Tensor q0 = make_tensor({tokens, kRowQ}, 10 + static_cast<unsigned>(step));
    const Tensor q1 = make_tensor({tokens, kHeads, kHeadSize}, 20 + static_cast<unsigned>(step));
    const Tensor k = make_tensor({tokens, kRowKV}, 30 + static_cast<unsigned>(step));
    const Tensor v = make_tensor({tokens, kRowKV}, 40 + static_cast<unsigned>(step));
    const Tensor out0 = layer0.forward(q0, k, v);
    const Tensor out1 = layer1.forward(q1, k, v);

    const std::vector<float> kf = to_float_vector(k);
    const std::vector<float> vf = to_float_vector(v);
    const std::vector<float> q0f = to_float_vector(q0);
    const std::vector<float> q1f = to_float_vector(q1);
    const std::vector<float> o0f = to_float_vector(out0);
    const std::vector<float> o1f = to_float_vector(out1);
    int token = 0;
    for (std::size_t r = 0; r < 2; ++r) {
      const int q_len = query_lens[step][r];
      key_history[r].insert(key_history[r].end(), kf.begin() + token * kRowKV,
                            kf.begin() + (token + q_len) * kRowKV);
      value_history[r].insert(value_history[r].end(), vf.begin() + token * kRowKV,
                              vf.begin() + (token + q_len) * kRowKV);
      for (int i = 0; i < q_len; ++i, ++token) {
        const int visible = seq_lens[r] - q_len + i + 1;
        for (const auto& [qf, of] : {std::pair{&q0f, &o0f}, std::pair{&q1f, &o1f}}) {
          const std::vector<float> q_row(qf->begin() + token * kRowQ, qf->begin() + (token + 1) * kRowQ);
          const std::vector<float> expected = naive_row(q_row, key_history[r], value_history[r], visible);
          for (int e = 0; e < kRowQ; ++e) {
            ASSERT_NEAR((*of)[static_cast<std::size_t>(token * kRowQ + e)],
                        expected[static_cast<std::size_t>(e)], 1e-5f)
                << "step " << step << " request " << r << " token " << i << " element " << e;
          }
        }
      }
    }
  }
}

TEST(AttentionEndToEnd, RejectedForwardLeavesTheReferenceCacheUntouched) {
  ModelContext model(f32_model());
  Attention layer(model, kHeads, kHeadSize, kScale, options_for("layers.0.attn", reference_backend()));
  allocate_kv_caches(model, {.num_blocks = kNumBlocks});
  ModelMetadataBuilder builder(model);
  ForwardContext context;
  context.layer_metadata = builder.build(small_batch());
  ForwardContextScope scope(std::move(context));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  layer.forward(q, k, k);
  const std::vector<std::uint8_t> snapshot = to_byte_vector(layer.kv_cache(0));
  const Tensor wide_k = make_tensor({kBatchTokens, kKVHeads + 1, kHeadSize}, 3);
  expect_invalid([&] { layer.forward(q, wide_k, wide_k); }, "key size(1) must be 2");
  EXPECT_EQ(to_byte_vector(layer.kv_cache(0)), snapshot);
}

}  // namespace
}  // namespace pagedattn::test
