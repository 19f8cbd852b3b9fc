#include <gtest/gtest.h>
#include <pagedattn/conformance.h>
#include <pagedattn/error.h>

#include <cmath>
#include <limits>

namespace pagedattn {
namespace {

constexpr double kEps = 1e-12;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// One KV head of size 1 per request unless stated: values are easy to follow.
OracleProblem problem(int heads, int kv_heads, int head_size) {
  OracleProblem pb;
  pb.num_heads = heads;
  pb.num_kv_heads = kv_heads;
  pb.head_size = head_size;
  pb.scale = 1.0;
  return pb;
}

// A request with zero queries (uniform scores) and value j + 1 for key j.
OracleRequest counting_request(int q_len, int kv_len, int heads = 1) {
  OracleRequest rq;
  rq.query_len = q_len;
  rq.kv_len = kv_len;
  rq.query.assign(static_cast<std::size_t>(q_len * heads), 0.0f);
  rq.key.assign(static_cast<std::size_t>(kv_len), 0.0f);
  for (int j = 0; j < kv_len; ++j) rq.value.push_back(static_cast<float>(j + 1));
  return rq;
}

TEST(OracleTest, SingleKeyReturnsItsValue) {
  OracleProblem pb = problem(1, 1, 2);
  pb.scale = 0.5;
  pb.requests.push_back({1, 1, {1.0f, 2.0f}, {3.0f, 4.0f}, {-5.0f, 7.0f}});
  const OracleOutput out = dense_attention(pb);
  ASSERT_EQ(out.num_tokens, 1);
  EXPECT_NEAR(out.output[0], -5.0, kEps);
  EXPECT_NEAR(out.output[1], 7.0, kEps);
  EXPECT_NEAR(out.lse[0], 0.5 * (3.0 + 8.0), kEps);
}

TEST(OracleTest, UniformScoresGiveTheMean) {
  OracleProblem pb = problem(1, 1, 1);
  pb.causal = false;
  pb.requests.push_back(counting_request(1, 4));
  const OracleOutput out = dense_attention(pb);
  EXPECT_NEAR(out.output[0], 2.5, kEps);
  EXPECT_NEAR(out.lse[0], std::log(4.0), kEps);
}

TEST(OracleTest, SinkJoinsTheDenominatorOnly) {
  OracleProblem pb = problem(1, 1, 1);
  pb.sinks = {2.0f};
  pb.requests.push_back(counting_request(1, 3));
  const OracleOutput out = dense_attention(pb);
  const double denom = std::exp(2.0) + 3.0;
  EXPECT_NEAR(out.output[0], (1.0 + 2.0 + 3.0) / denom, kEps);
  EXPECT_NEAR(out.lse[0], std::log(denom), kEps);
}

TEST(OracleTest, CausalIsBottomRightAligned) {
  OracleProblem pb = problem(1, 1, 1);
  pb.requests.push_back(counting_request(2, 4));  // positions 2 and 3
  const OracleOutput out = dense_attention(pb);
  EXPECT_NEAR(out.output[0], 2.0, kEps);  // keys 0..2
  EXPECT_NEAR(out.output[1], 2.5, kEps);  // keys 0..3
  pb.causal = false;
  EXPECT_NEAR(dense_attention(pb).output[0], 2.5, kEps);
}

TEST(OracleTest, DecoderWindowKeepsWKeysIncludingSelf) {
  OracleProblem pb = problem(1, 1, 1);
  pb.sliding_window = 2;
  pb.requests.push_back(counting_request(2, 5));  // positions 3 and 4
  const OracleOutput out = dense_attention(pb);
  EXPECT_NEAR(out.output[0], (3.0 + 4.0) / 2, kEps);  // keys 2, 3
  EXPECT_NEAR(out.output[1], (4.0 + 5.0) / 2, kEps);  // keys 3, 4
}

TEST(OracleTest, PrefixLmRangesSeeTheirWholeRange) {
  OracleProblem pb = problem(1, 1, 1);
  OracleRequest rq = counting_request(4, 6);  // positions 2..5
  rq.mm_prefix_ranges = {{1, 4}};
  pb.requests.push_back(rq);
  const OracleOutput out = dense_attention(pb);
  EXPECT_NEAR(out.output[0], 2.5, kEps);  // position 2: keys 0..3, one past its diagonal
  EXPECT_NEAR(out.output[1], 2.5, kEps);  // position 3: keys 0..3
  EXPECT_NEAR(out.output[2], 3.0, kEps);  // position 4, outside: keys 0..4
  // The window bounds the causal part only: position 2 sees key 2 and the range.
  pb.sliding_window = 1;
  EXPECT_NEAR(dense_attention(pb).output[0], (2.0 + 3.0 + 4.0) / 3, kEps);
  pb.causal = false;
  EXPECT_THROW(dense_attention(pb), Error);
}

TEST(OracleTest, EncoderWindowIsSymmetric) {
  OracleProblem pb = problem(1, 1, 1);
  pb.attn_type = AttentionType::EncoderOnly;
  pb.sliding_window = 2;
  pb.requests.push_back(counting_request(4, 4));
  const OracleOutput out = dense_attention(pb);
  EXPECT_NEAR(out.output[0], (1.0 + 2.0) / 2, kEps);        // keys 0, 1
  EXPECT_NEAR(out.output[1], (1.0 + 2.0 + 3.0) / 3, kEps);  // keys 0..2
  EXPECT_NEAR(out.output[3], (3.0 + 4.0) / 2, kEps);        // keys 2, 3
}

TEST(OracleTest, CrossAttentionIgnoresCausalityAndWindow) {
  OracleProblem pb = problem(1, 1, 1);
  pb.attn_type = AttentionType::EncoderDecoder;
  pb.sliding_window = 1;
  pb.requests.push_back(counting_request(5, 3));  // more queries than keys
  const OracleOutput out = dense_attention(pb);
  for (int t = 0; t < 5; ++t) EXPECT_NEAR(out.output[static_cast<std::size_t>(t)], 2.0, kEps);
}

TEST(OracleTest, SoftCapAppliesToScaledScores) {
  OracleProblem pb = problem(1, 1, 1);
  pb.scale = 2.0;
  pb.soft_cap = 5.0;
  pb.requests.push_back({1, 2, {1.0f}, {5.0f, 0.0f}, {1.0f, 0.0f}});
  const OracleOutput out = dense_attention(pb);
  const double s0 = 5.0 * std::tanh(10.0 / 5.0);  // the scaled score 10, capped
  const double w0 = std::exp(s0) / (std::exp(s0) + 1.0);
  EXPECT_NEAR(out.output[0], w0, kEps);
  EXPECT_NEAR(out.lse[0], std::log(std::exp(s0) + 1.0), kEps);
}

TEST(OracleTest, AlibiBiasesByDistance) {
  OracleProblem pb = problem(1, 1, 1);
  pb.alibi_slopes = {0.5f};
  pb.requests.push_back(counting_request(1, 3));  // position 2
  const OracleOutput out = dense_attention(pb);
  const double w[] = {std::exp(-1.0), std::exp(-0.5), 1.0};
  const double total = w[0] + w[1] + w[2];
  EXPECT_NEAR(out.output[0], (w[0] * 1 + w[1] * 2 + w[2] * 3) / total, kEps);
  EXPECT_NEAR(out.lse[0], std::log(total), kEps);
}

TEST(OracleTest, RowWithoutKeysIsZeroWithMinusInfLse) {
  OracleProblem pb = problem(2, 1, 1);
  pb.attn_type = AttentionType::EncoderDecoder;
  pb.sinks = {1.0f, 3.0f};
  pb.requests.push_back(counting_request(2, 0, 2));
  const OracleOutput out = dense_attention(pb);
  for (const double x : out.output) EXPECT_EQ(x, 0.0);
  for (const double x : out.lse) EXPECT_EQ(x, kNegInf);
}

TEST(OracleTest, GroupedQueryHeadsShareTheirKvHead) {
  OracleProblem pb = problem(4, 2, 1);
  OracleRequest rq;
  rq.query_len = 1;
  rq.kv_len = 1;
  rq.query = {0.0f, 0.0f, 0.0f, 0.0f};
  rq.key = {0.0f, 0.0f};
  rq.value = {10.0f, 20.0f};  // KV head 0, KV head 1
  pb.requests.push_back(rq);
  const OracleOutput out = dense_attention(pb);
  EXPECT_EQ(out.output, (std::vector<double>{10.0, 10.0, 20.0, 20.0}));
}

TEST(OracleTest, LseIsHeadMajor) {
  OracleProblem pb = problem(2, 2, 1);
  pb.causal = false;
  for (const int kv_len : {1, 3}) {
    OracleRequest rq;
    rq.query_len = 1;
    rq.kv_len = kv_len;
    rq.query = {0.0f, 0.0f};
    rq.key.assign(static_cast<std::size_t>(2 * kv_len), 0.0f);
    rq.value.assign(static_cast<std::size_t>(2 * kv_len), 1.0f);
    pb.requests.push_back(rq);
  }
  const OracleOutput out = dense_attention(pb);
  ASSERT_EQ(out.lse.size(), 4u);  // [H = 2, T = 2]
  EXPECT_NEAR(out.lse[0], 0.0, kEps);
  EXPECT_NEAR(out.lse[1], std::log(3.0), kEps);
  EXPECT_NEAR(out.lse[2], 0.0, kEps);
  EXPECT_NEAR(out.lse[3], std::log(3.0), kEps);
}

TEST(OracleTest, RejectsInconsistentSizes) {
  OracleProblem pb = problem(2, 1, 4);
  pb.requests.push_back({1, 1, {0.0f}, {0.0f}, {0.0f}});
  EXPECT_THROW(dense_attention(pb), Error);
  pb = problem(3, 2, 1);
  EXPECT_THROW(dense_attention(pb), Error);
}

TEST(OracleTest, StandardAlibiSlopes) {
  const auto eight = alibi_slopes(8);
  ASSERT_EQ(eight.size(), 8u);
  for (int k = 0; k < 8; ++k) EXPECT_FLOAT_EQ(eight[static_cast<std::size_t>(k)], std::exp2f(-(k + 1.0f)));
  // 5 heads: the 4 powers of 2^-2, then the odd powers of 2^-1.
  EXPECT_EQ(alibi_slopes(5), (std::vector<float>{0.25f, 0.0625f, 0.015625f, 0.00390625f, 0.5f}));
}

TEST(OracleTest, ToleranceTable) {
  EXPECT_DOUBLE_EQ(tolerance(CheckedQuantity::Output, DType::BF16).atol, 1.5e-2);
  EXPECT_DOUBLE_EQ(tolerance(CheckedQuantity::Output, DType::BF16).rtol, 1e-2);
  EXPECT_DOUBLE_EQ(tolerance(CheckedQuantity::Output, DType::F16).atol, 5e-3);
  EXPECT_DOUBLE_EQ(tolerance(CheckedQuantity::Output, DType::F32).rtol, 1e-4);
  EXPECT_DOUBLE_EQ(tolerance(CheckedQuantity::Lse, DType::F32).atol, 2e-3);
  EXPECT_DOUBLE_EQ(tolerance(CheckedQuantity::Lse, DType::BF16).rtol, 1e-3);
  EXPECT_THROW(tolerance(CheckedQuantity::Output, DType::I32), Error);
}

TEST(OracleTest, ComparisonCatchesWrongAndUnwrittenElements) {
  OracleProblem pb = problem(1, 1, 2);
  pb.requests.push_back({1, 1, {1.0f, 0.0f}, {1.0f, 0.0f}, {0.5f, -0.25f}});
  const OracleOutput ex = dense_attention(pb);
  std::vector<float> out{0.5f, -0.25f};
  std::vector<float> lse{1.0f};
  EXPECT_FALSE(compare_with_oracle(ex, out, lse, DType::F32));
  out[1] = -0.2f;
  const auto wrong = compare_with_oracle(ex, out, lse, DType::F32);
  ASSERT_TRUE(wrong);
  EXPECT_NE(wrong->find("output[token 0, head 0, dim 1]"), std::string::npos) << *wrong;
  out[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(compare_with_oracle(ex, out, lse, DType::BF16));
  out[1] = -0.25f;
  lse[0] = 1.01f;
  const auto bad_lse = compare_with_oracle(ex, out, lse, DType::F32);
  ASSERT_TRUE(bad_lse);
  EXPECT_NE(bad_lse->find("lse[head 0, token 0]"), std::string::npos) << *bad_lse;
  EXPECT_FALSE(compare_with_oracle(ex, out, {}, DType::F32));  // LSE not checked when absent
}

}  // namespace
}  // namespace pagedattn
