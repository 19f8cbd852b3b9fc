// merge_attn_states through its front-end: against a merge computed in double
// (vLLM's infinity rules included), strided and in-place outputs, and every
// validation error leaving the outputs untouched.
#include <gtest/gtest.h>
#include <pagedattn/ops.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/ops_test_util.h"
#include "testing/expect_error.h"

namespace pagedattn::test {
namespace {

// ---- merge_attn_states ----------------------------------------------------------------

struct MergeData {
  Tensor output, prefix_output, suffix_output;  // [T, H, D]
  Tensor prefix_lse, suffix_lse, output_lse;    // [H, T]
};

// LSE pairs covering vLLM's infinity rules, placed on head 0's first tokens.
const std::vector<std::pair<float, float>> kSpecialLse = {
    {-kInf, 1.5f},  {kInf, 0.25f}, {2.0f, -kInf}, {2.0f, kInf},
    {-kInf, -kInf}, {kInf, kInf},  {kInf, -kInf}, {3.0f, 3.0f},
};

MergeData make_merge_data(std::int64_t t, std::int64_t h, std::int64_t d, DType dtype, std::mt19937& rng) {
  MergeData m;
  m.prefix_output = random_tensor({t, h, d}, dtype, rng);
  m.suffix_output = random_tensor({t, h, d}, dtype, rng);
  m.output = Tensor::empty({t, h, d}, dtype);
  fill_tensor_bits(m.output, kPoison);
  std::vector<float> p = random_floats(static_cast<std::size_t>(h * t), rng, 3.0f);
  std::vector<float> s = random_floats(static_cast<std::size_t>(h * t), rng, 3.0f);
  for (std::size_t i = 0; i < kSpecialLse.size() && i < p.size(); ++i) std::tie(p[i], s[i]) = kSpecialLse[i];
  m.prefix_lse = Tensor::from_floats(p, {h, t}, DType::F32);
  m.suffix_lse = Tensor::from_floats(s, {h, t}, DType::F32);
  m.output_lse =
      Tensor::from_floats(std::vector<float>(static_cast<std::size_t>(h * t), 42.0f), {h, t}, DType::F32);
  return m;
}

// Checks `out` / `out_lse` against the merge computed in double from the same inputs.
void check_merge(const MergeData& m, const TensorView& out, const TensorView& out_lse, double rel_tol) {
  const std::int64_t t_count = out.size(0), h_count = out.size(1), d_count = out.size(2);
  const std::vector<float> po = to_float_vector(m.prefix_output);
  const std::vector<float> so = to_float_vector(m.suffix_output);
  const std::vector<std::uint8_t> po_bytes = to_byte_vector(m.prefix_output);
  const std::vector<float> pl = to_float_vector(m.prefix_lse);
  const std::vector<float> sl = to_float_vector(m.suffix_lse);
  const std::vector<float> o = to_float_vector(out);
  const std::vector<std::uint8_t> o_bytes = to_byte_vector(out);
  const std::vector<float> ol = out_lse.defined() ? to_float_vector(out_lse) : std::vector<float>();
  const std::size_t es = out.element_size();
  for (std::int64_t t = 0; t < t_count; ++t) {
    for (std::int64_t h = 0; h < h_count; ++h) {
      const auto li = static_cast<std::size_t>(h * t_count + t);
      const double p = std::isinf(pl[li]) ? -INFINITY : pl[li];
      const double s = std::isinf(sl[li]) ? -INFINITY : sl[li];
      const double mx = std::max(p, s);
      const auto row = static_cast<std::size_t>((t * h_count + h) * d_count);
      if (mx == -INFINITY) {
        EXPECT_EQ(0, std::memcmp(o_bytes.data() + row * es, po_bytes.data() + row * es,
                                 static_cast<std::size_t>(d_count) * es))
            << "token " << t << " head " << h << ": prefix output copied";
        if (!ol.empty()) {
          EXPECT_EQ(ol[li], -kInf);
        }
        continue;
      }
      const double wp = std::exp(p - mx), ws = std::exp(s - mx);
      for (std::int64_t d = 0; d < d_count; ++d) {
        const auto i = row + static_cast<std::size_t>(d);
        const double ref = (wp * po[i] + ws * so[i]) / (wp + ws);
        ASSERT_NEAR(o[i], ref, rel_tol * std::fabs(ref) + 1e-6)
            << "token " << t << " head " << h << " dim " << d;
      }
      if (!ol.empty()) {
        EXPECT_NEAR(ol[li], std::log(wp + ws) + mx, 1e-5 * (1 + std::fabs(mx))) << t << "," << h;
      }
    }
  }
}

class OpsMergeAttnStates : public ::testing::TestWithParam<DType> {};

TEST_P(OpsMergeAttnStates, MatchesDoublePrecisionMergeWithInfinityRules) {
  const DType dtype = GetParam();
  // Output rounding: half an ulp of the element type (float math otherwise).
  const double rel_tol = dtype == DType::F32 ? 1e-5 : dtype == DType::F16 ? 1e-3 : 8e-3;
  std::mt19937 rng(kSeed);
  const MergeData m = make_merge_data(11, 3, 16, dtype, rng);
  merge_attn_states(m.output, m.prefix_output, m.prefix_lse, m.suffix_output, m.suffix_lse, m.output_lse);
  check_merge(m, m.output, m.output_lse, rel_tol);

  // The exact cases: one side -inf gives the other side unchanged.
  const std::vector<float> o = to_float_vector(m.output);
  const std::vector<float> po = to_float_vector(m.prefix_output);
  const std::vector<float> so = to_float_vector(m.suffix_output);
  const std::vector<float> lse = to_float_vector(m.output_lse);
  const std::size_t row = 3 * 16;  // token stride in elements
  for (std::size_t d = 0; d < 16; ++d) {
    EXPECT_EQ(o[0 * row + d], so[0 * row + d]);  // prefix -inf
    EXPECT_EQ(o[1 * row + d], so[1 * row + d]);  // prefix +inf
    EXPECT_EQ(o[2 * row + d], po[2 * row + d]);  // suffix -inf
    EXPECT_EQ(o[3 * row + d], po[3 * row + d]);  // suffix +inf
  }
  EXPECT_EQ(lse[0], 1.5f);
  EXPECT_EQ(lse[2], 2.0f);
  EXPECT_EQ(lse[4], -kInf);
  EXPECT_EQ(lse[5], -kInf);
  EXPECT_EQ(lse[6], -kInf);
  EXPECT_FLOAT_EQ(lse[7], 3.0f + std::log(2.0f));
}

TEST_P(OpsMergeAttnStates, StridedInPlaceAndWithoutOutputLse) {
  const DType dtype = GetParam();
  const double rel_tol = dtype == DType::F32 ? 1e-5 : dtype == DType::F16 ? 1e-3 : 8e-3;
  constexpr std::int64_t kT = 9, kH = 2, kD = 8;
  std::mt19937 rng(kSeed + 1);
  MergeData m = make_merge_data(kT, kH, kD, dtype, rng);
  // Suffix rows inside a wider buffer; output LSE as a transposed [T, H] tensor.
  const Tensor wide = random_tensor({kT, kH, 2 * kD}, dtype, rng);
  m.suffix_output = wide.slice(2, kD, 2 * kD);
  const Tensor lse_th = Tensor::zeros({kT, kH}, DType::F32);
  const MergeData original{
      m.prefix_output.clone(), m.prefix_output.clone(), m.suffix_output, m.prefix_lse, m.suffix_lse, {}};
  // In place: the output is the prefix buffer.
  merge_attn_states(m.prefix_output, m.prefix_output, m.prefix_lse, m.suffix_output, m.suffix_lse,
                    lse_th.permute({1, 0}));
  check_merge(original, m.prefix_output, lse_th.permute({1, 0}), rel_tol);

  MergeData fresh = make_merge_data(kT, kH, kD, dtype, rng);
  merge_attn_states(fresh.output, fresh.prefix_output, fresh.prefix_lse, fresh.suffix_output,
                    fresh.suffix_lse);
  check_merge(fresh, fresh.output, TensorView(), rel_tol);
}

INSTANTIATE_TEST_SUITE_P(Ops, OpsMergeAttnStates, ::testing::Values(DType::F32, DType::F16, DType::BF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

struct MergeArgs {
  TensorView output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse;
};

TEST(OpsMergeAttnStatesErrors, EveryErrorNamesItsArgumentAndWritesNothing) {
  using K = std::vector<Tensor>;
  using Mutate = std::function<void(MergeArgs&, K&)>;
  const std::vector<std::tuple<std::string, Mutate, std::string>> cases = {
      {"output rank", [](MergeArgs& a, K&) { a.output = a.output.select(0, 0); },
       "merge_attn_states: output rank must be 3"},
      {"prefix_output rank", [](MergeArgs& a, K&) { a.prefix_output = a.prefix_output.view({-1}); },
       "prefix_output rank must be 3"},
      {"suffix_lse rank", [](MergeArgs& a, K&) { a.suffix_lse = a.suffix_lse.select(0, 0); },
       "suffix_lse rank must be 2"},
      {"output_lse rank",
       [](MergeArgs& a, K&) {
         a.output_lse = a.output_lse.view({1, 3, 5});
       },
       "output_lse rank must be 2"},
      {"prefix_output device",
       [](MergeArgs& a, K&) { a.prefix_output = on_device(a.prefix_output, Device::cuda(0)); },
       "prefix_output device must be cpu, got cuda:0"},
      {"suffix_lse device", [](MergeArgs& a, K&) { a.suffix_lse = on_device(a.suffix_lse, Device::cuda(0)); },
       "suffix_lse device must be cpu"},
      {"output_lse device", [](MergeArgs& a, K&) { a.output_lse = on_device(a.output_lse, Device::cuda(0)); },
       "output_lse device must be cpu"},
      {"output dtype",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({5, 3, 4}, DType::I32));
         a.output = a.prefix_output = a.suffix_output = k.back();
       },
       "output dtype must be f32, f16 or bf16, got i32"},
      {"suffix_output dtype",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({5, 3, 4}, DType::F16));
         a.suffix_output = k.back();
       },
       "suffix_output dtype must be bf16, got f16"},
      {"prefix_lse dtype",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({3, 5}, DType::BF16));
         a.prefix_lse = k.back();
       },
       "prefix_lse dtype must be f32, got bf16"},
      {"output_lse dtype",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({3, 5}, DType::F16));
         a.output_lse = k.back();
       },
       "output_lse dtype must be f32"},
      {"suffix_output shape", [](MergeArgs& a, K&) { a.suffix_output = a.suffix_output.slice(2, 0, 2); },
       "suffix_output shape must be [5, 3, 4] (the shape of output), got [5, 3, 2]"},
      {"prefix_lse transposed",
       [](MergeArgs& a, K&) {
         a.prefix_lse = a.prefix_lse.permute({1, 0});
       },
       "prefix_lse size(0) must be 3"},
      {"suffix_lse tokens", [](MergeArgs& a, K&) { a.suffix_lse = a.suffix_lse.slice(1, 0, 4); },
       "suffix_lse size(1) must be 5"},
      {"output last dim",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({5, 3, 8}, DType::BF16));
         a.output = TensorView(k.back().data(), DType::BF16, Device::cpu(), {5, 3, 4}, {24, 8, 2});
       },
       "merge_attn_states: output stride(-1) must be 1"},
      {"prefix_output last dim",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({5, 3, 8}, DType::BF16));
         a.prefix_output = TensorView(k.back().data(), DType::BF16, Device::cpu(), {5, 3, 4}, {24, 8, 2});
       },
       "prefix_output stride(-1) must be 1"},
  };
  for (const auto& [name, mutate, message] : cases) {
    SCOPED_TRACE(name);
    std::mt19937 rng(kSeed);
    const MergeData m = make_merge_data(5, 3, 4, DType::BF16, rng);
    MergeArgs a{m.output, m.prefix_output, m.prefix_lse, m.suffix_output, m.suffix_lse, m.output_lse};
    K keep;
    mutate(a, keep);
    const std::vector<std::uint8_t> out_before = to_byte_vector(m.output);
    const std::vector<std::uint8_t> lse_before = to_byte_vector(m.output_lse);
    expect_invalid(
        [&] {
          merge_attn_states(a.output, a.prefix_output, a.prefix_lse, a.suffix_output, a.suffix_lse,
                            a.output_lse);
        },
        message);
    EXPECT_EQ(to_byte_vector(m.output), out_before);
    EXPECT_EQ(to_byte_vector(m.output_lse), lse_before);
  }
}

}  // namespace
}  // namespace pagedattn::test
