// CPU_ATTN against REFERENCE where docs/semantics.md's NaN and empty-row rules
// decide the result, on every ISA and with f32 and bf16 models: a row whose
// every visible score is NaN is NaN (output and LSE), a row with no visible
// key is zeros with LSE -inf.
#include <gtest/gtest.h>
#include <pagedattn/metadata.h>

#include <cmath>
#include <limits>
#include <vector>

#include "backends/cpu_attn/cpu_attn_backend.h"
#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cpu_attn/cpu_attn_test_problem.h"

namespace pagedattn {
namespace {

using cpu_attn_test::for_each_isa;
using cpu_attn_test::LayerSpec;
using cpu_attn_test::PagedProblem;

const CpuAttnBackend kBackend;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr DType kModelDTypes[] = {DType::F32, DType::BF16};
// Head size 64 takes the AVX512-BF16 decode tiles (multiples of 64) too.
constexpr int kHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadSize = 64;
constexpr int kNanDim = 5;
// A decode long enough to be split (its rows finish in the merge).
constexpr int kSplitDecodeKeys = cpu_attn::kSplitKeys + 300;

LayerSpec layer(DType dtype, bool sinks) {
  LayerSpec spec;
  spec.heads = kHeads;
  spec.kv_heads = kKvHeads;
  spec.head_size = kHeadSize;
  spec.dtype = dtype;
  spec.sinks = sinks;
  return spec;
}

// `problem` on every ISA against REFERENCE, which must hold some NaN.
void expect_matches_reference(const PagedProblem& problem) {
  const cpu_attn_test::ForwardResult want = problem.run(cpu_attn_test::reference_backend());
  ASSERT_TRUE(std::any_of(want.lse.begin(), want.lse.end(), [](float x) { return std::isnan(x); }))
      << problem.describe();
  for_each_isa([&](cpu_attn::Isa isa) {
    const auto failure = compare_with_reference(want, problem.run(kBackend), problem);
    EXPECT_FALSE(failure.has_value())
        << cpu_attn::isa_name(isa) << " " << problem.describe() << ": " << failure.value_or("");
  });
}

// A NaN in the one key a row sees: a decode over one key; the first token of
// a fresh prefill (tiled: 20 tokens x 4 heads); a window of one key over a
// split decode, whose first split sees nothing and second only the NaN key;
// a speculative step under the same window. With and without sinks.
TEST(CpuAttnNanRule, NanInTheOnlyVisibleKeyMakesTheRowNaN) {
  std::uint32_t seed = 20;
  for (const DType dtype : kModelDTypes) {
    for (const bool sinks : {false, true}) {
      PagedProblem one_key(layer(dtype, sinks), {{1, 1}, {1, 40}}, seed++);
      one_key.key(0, 0, 0, kNanDim) = kNaN;
      expect_matches_reference(one_key);

      PagedProblem fresh(layer(dtype, sinks), {{20, 20}}, seed++);
      fresh.key(0, 0, 1, kNanDim) = kNaN;
      expect_matches_reference(fresh);

      LayerSpec windowed = layer(dtype, sinks);
      windowed.window = 1;
      PagedProblem split(windowed, {{1, kSplitDecodeKeys}, {6, kSplitDecodeKeys}}, seed++);
      split.key(0, kSplitDecodeKeys - 1, 0, kNanDim) = kNaN;
      split.key(1, kSplitDecodeKeys - 3, 1, kNanDim) = kNaN;
      expect_matches_reference(split);
    }
  }
}

// A NaN query element makes every score of its row NaN: a split decode, a
// speculative step and a prefill tile (one NaN row each).
TEST(CpuAttnNanRule, NanInTheQueryMakesItsRowNaN) {
  std::uint32_t seed = 40;
  for (const DType dtype : kModelDTypes) {
    for (const bool sinks : {false, true}) {
      PagedProblem p(layer(dtype, sinks), {{1, kSplitDecodeKeys}, {5, 40}, {20, 100}}, seed++);
      p.query(0, 1, kNanDim) = kNaN;
      p.query(1 + 3, 6, kNanDim) = kNaN;
      p.query(1 + 5 + 17, 2, kNanDim) = kNaN;
      expect_matches_reference(p);
    }
  }
}

// Cross-attention over an empty encoder beside a non-empty one (V all ones):
// the empty request's rows see no key and are zeros with LSE -inf, also with
// a sink; the other request's rows are finite and positive.
TEST(CpuAttnNanRule, RowWithoutVisibleKeysIsZeroWithMinusInfLse) {
  constexpr int kEncoderTokens = 40;
  constexpr int kBlockSize = 16;
  constexpr int kBlocks = 5;  // the null block and the requests' 1 + 3
  constexpr int kTokens = 3;  // one query of the empty request, then two
  const std::vector<RequestSpec> requests{{1, 1, {1}}, {2, 2, {2, 3, 4}}};
  const std::vector<int> encoder_lens{0, kEncoderTokens};
  for (const DType dtype : kModelDTypes) {
    for (const bool sinks : {false, true}) {
      AttentionImplParams params;
      params.num_heads = kHeads;
      params.num_kv_heads = kKvHeads;
      params.head_size = kHeadSize;
      params.scale = 0.125f;
      params.dtype = dtype;
      params.attn_type = AttentionType::EncoderDecoder;
      if (sinks) params.sinks.assign(kHeads, 1.0f);
      MetadataOptions options;
      options.block_size = kBlockSize;
      const BuilderParams bp = cpu_attn_test::builder_params(kBlockSize, kKvHeads, kHeadSize, kHeads);
      const Tensor storage = Tensor::zeros(
          kBackend.kv_cache_shape(kBlocks, kBlockSize, kKvHeads, kHeadSize, CacheDType::Auto), dtype);
      const KVCacheView cache = kBackend.unbind_kv_cache(storage);
      const auto impl = kBackend.make_impl(params);
      const std::vector<float> ones(static_cast<std::size_t>(kEncoderTokens) * kKvHeads * kHeadSize, 1.0f);
      const Tensor kv = Tensor::from_floats(ones, {kEncoderTokens, kKvHeads, kHeadSize}, dtype);
      impl->do_kv_cache_update(
          {}, kv, kv, cache,
          Tensor::from_i64(slots_for_positions(requests[1].blocks, kBlockSize, 0, kEncoderTokens),
                           {kEncoderTokens}));
      const auto md = kBackend.make_builder(bp)->build(
          make_cross_attention_metadata(requests, encoder_lens, false, options));
      const Tensor query = Tensor::from_floats(std::vector<float>(kTokens * kHeads * kHeadSize, 0.5f),
                                               {kTokens, kHeads, kHeadSize}, dtype);
      for_each_isa([&](cpu_attn::Isa isa) {
        const Tensor out = Tensor::empty({kTokens, kHeads, kHeadSize}, dtype);
        fill_tensor(out, 7.0f);
        const Tensor lse = Tensor::zeros({kHeads, kTokens}, DType::F32);
        impl->forward({}, query, {}, {}, cache, *md, out, lse);
        const std::vector<float> o = to_float_vector(out);
        const std::vector<float> l = to_float_vector(lse);
        for (std::size_t i = 0; i < o.size(); ++i) {
          const bool empty_row = i < static_cast<std::size_t>(kHeads * kHeadSize);  // token 0
          EXPECT_TRUE(empty_row ? o[i] == 0.0f : std::isfinite(o[i]) && o[i] > 0.0f)
              << cpu_attn::isa_name(isa) << " element " << i << ": " << o[i];
        }
        for (int h = 0; h < kHeads; ++h) {
          EXPECT_EQ(l[static_cast<std::size_t>(h) * kTokens], -std::numeric_limits<float>::infinity())
              << cpu_attn::isa_name(isa) << " head " << h;
          EXPECT_TRUE(std::isfinite(l[static_cast<std::size_t>(h) * kTokens + 1])) << cpu_attn::isa_name(isa);
        }
      });
    }
  }
}

}  // namespace
}  // namespace pagedattn
