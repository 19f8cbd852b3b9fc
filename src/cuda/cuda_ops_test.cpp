// The CUDA ops against the CPU ops through the same front-ends: bit for bit
// where the result is exact (reshape_and_cache including fp8 and the
// per-token-head scales, copy_blocks,
// abs_max), within float rounding for merge_attn_states. Skipped without a
// CUDA device.
#include <gtest/gtest.h>
#include <pagedattn/ops.h>
#include <pagedattn/backend/registry.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace pagedattn {
namespace {

constexpr std::uint64_t kPoison = 0x5A5A5A5A5A5A5A5Aull;
constexpr float kInf = std::numeric_limits<float>::infinity();

bool have_cuda() {
  BackendRegistry::instance();  // registers the CUDA runtime when a device exists
  const DeviceAllocator* a = find_device_allocator(DeviceType::CUDA);
  return a != nullptr && a->device_count() > 0;
}

std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

Tensor random_tensor(Dims shape, DType dtype, std::mt19937& rng, float stddev = 1.0f) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return Tensor::from_floats(random_floats(static_cast<std::size_t>(n), rng, stddev), shape, dtype);
}

// A CUDA tensor with the same strides (physical order) and contents.
Tensor to_cuda_like(const Tensor& host, std::span<const int> order) {
  Tensor d = Tensor::empty_strided_order(host.shape(), order, host.dtype(), Device::cuda());
  copy_tensor(d, host);
  return d;
}

struct CacheCase {
  DType dtype;
  CacheDType cache;
  bool per_head;
  bool hnd;
};

class CudaReshapeAndCacheTest : public ::testing::TestWithParam<CacheCase> {};

TEST_P(CudaReshapeAndCacheTest, MatchesCpuBitForBit) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  const CacheCase c = GetParam();
  constexpr int kTokens = 13, kHkv = 3, kD = 64, kBlocks = 6, kBS = 16;
  std::mt19937 rng(7);
  const Tensor key = random_tensor({kTokens, kHkv, kD}, c.dtype, rng, 3.0f);
  const Tensor value = random_tensor({kTokens, kHkv, kD}, c.dtype, rng, 3.0f);
  const DType storage = kv_cache_storage_dtype(c.cache, c.dtype);
  const std::vector<int> order = c.hnd ? std::vector<int>{0, 2, 1, 3} : std::vector<int>{0, 1, 2, 3};
  Tensor kc = Tensor::empty_strided_order({kBlocks, kBS, kHkv, kD}, order, storage, Device::cpu());
  Tensor vc = Tensor::empty_strided_order({kBlocks, kBS, kHkv, kD}, order, storage, Device::cpu());
  fill_tensor_bits(kc, kPoison);
  fill_tensor_bits(vc, kPoison);
  // Shorter than key, with padded (-1) slots.
  const std::vector<std::int64_t> slots = {5, -1, 17, 95, 0, 33, -1, 64, 80, 2, 47};
  const Tensor slot_mapping = Tensor::from_i64(slots, {static_cast<std::int64_t>(slots.size())});
  const int scales = c.per_head ? kHkv : 1;
  const std::vector<float> k_scales = {0.5f, 0.03f, 2.0f};
  const Tensor ks = Tensor::from_floats(std::span<const float>(k_scales.data(), static_cast<std::size_t>(scales)),
                                        {scales}, DType::F32);
  const Tensor vs = Tensor::from_floats(std::vector<float>(static_cast<std::size_t>(scales), 0.25f), {scales}, DType::F32);
  const bool quantized = is_quantized_kv_cache(c.cache);
  // Per-token-head caches write their scales, [NB, Hkv, BS] f32, instead.
  const bool token_head = kv_cache_uses_per_token_head_scales(c.cache);
  Tensor k_token = Tensor::empty({kBlocks, kHkv, kBS}, DType::F32);
  Tensor v_token = Tensor::empty({kBlocks, kHkv, kBS}, DType::F32);
  fill_tensor_bits(k_token, kPoison);
  fill_tensor_bits(v_token, kPoison);
  const Tensor dk_token = k_token.to(Device::cuda());
  const Tensor dv_token = v_token.to(Device::cuda());
  const auto k_arg = [&](bool cuda) {
    if (token_head) return cuda ? dk_token : k_token;
    return quantized ? (cuda ? ks.to(Device::cuda()) : ks) : Tensor();
  };
  const auto v_arg = [&](bool cuda) {
    if (token_head) return cuda ? dv_token : v_token;
    return quantized ? (cuda ? vs.to(Device::cuda()) : vs) : Tensor();
  };

  Tensor dkc = to_cuda_like(kc, order);
  Tensor dvc = to_cuda_like(vc, order);
  reshape_and_cache(key, value, kc, vc, slot_mapping, c.cache, k_arg(false), v_arg(false));
  reshape_and_cache(key.to(Device::cuda()), value.to(Device::cuda()), dkc, dvc,
                    slot_mapping.to(Device::cuda()), c.cache, k_arg(true), v_arg(true));
  EXPECT_EQ(to_byte_vector(dkc), to_byte_vector(kc));
  EXPECT_EQ(to_byte_vector(dvc), to_byte_vector(vc));
  EXPECT_EQ(to_byte_vector(dk_token), to_byte_vector(k_token));
  EXPECT_EQ(to_byte_vector(dv_token), to_byte_vector(v_token));
}

INSTANTIATE_TEST_SUITE_P(Caches, CudaReshapeAndCacheTest,
                         ::testing::Values(CacheCase{DType::BF16, CacheDType::Auto, false, false},
                                           CacheCase{DType::F16, CacheDType::Auto, false, true},
                                           CacheCase{DType::BF16, CacheDType::Fp8, false, false},
                                           CacheCase{DType::F16, CacheDType::Fp8E4M3, true, true},
                                           CacheCase{DType::BF16, CacheDType::Fp8E5M2, true, false},
                                           CacheCase{DType::F16, CacheDType::Fp8E5M2, false, true},
                                           CacheCase{DType::BF16, CacheDType::Int8PerTokenHead, false, false},
                                           CacheCase{DType::F16, CacheDType::Int8PerTokenHead, false, true},
                                           CacheCase{DType::BF16, CacheDType::Fp8PerTokenHead, false, true},
                                           CacheCase{DType::F16, CacheDType::Fp8PerTokenHead, false, false}));

TEST(CudaOpsTest, MergeAttnStatesMatchesCpu) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  constexpr int kT = 9, kH = 4, kD = 32;
  std::mt19937 rng(11);
  for (const DType dtype : {DType::F32, DType::F16, DType::BF16}) {
    const Tensor pre = random_tensor({kT, kH, kD}, dtype, rng);
    const Tensor suf = random_tensor({kT, kH, kD}, dtype, rng);
    std::vector<float> pl = random_floats(kH * kT, rng, 4.0f);
    std::vector<float> sl = random_floats(kH * kT, rng, 4.0f);
    pl[0] = kInf;  // +inf counts as -inf
    pl[1] = -kInf;
    sl[1] = -kInf;  // both empty: the prefix is copied
    sl[2] = -kInf;
    const Tensor plse = Tensor::from_floats(pl, {kH, kT}, DType::F32);
    const Tensor slse = Tensor::from_floats(sl, {kH, kT}, DType::F32);
    Tensor out = Tensor::zeros({kT, kH, kD}, dtype);
    Tensor out_lse = Tensor::zeros({kH, kT}, DType::F32);
    merge_attn_states(out, pre, plse, suf, slse, out_lse);
    Tensor dout = Tensor::zeros({kT, kH, kD}, dtype, Device::cuda());
    Tensor dlse = Tensor::zeros({kH, kT}, DType::F32, Device::cuda());
    merge_attn_states(dout, pre.to(Device::cuda()), plse.to(Device::cuda()), suf.to(Device::cuda()),
                      slse.to(Device::cuda()), dlse);
    const std::vector<float> want = to_float_vector(out);
    const std::vector<float> got = to_float_vector(dout);
    const float tol = dtype == DType::F32 ? 1e-5f : (dtype == DType::F16 ? 2e-3f : 2e-2f);
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], tol * (1.0f + std::fabs(want[i]))) << i;
    const std::vector<float> want_lse = to_float_vector(out_lse);
    const std::vector<float> got_lse = to_float_vector(dlse);
    for (std::size_t i = 0; i < want_lse.size(); ++i) {
      if (std::isinf(want_lse[i])) {
        EXPECT_EQ(got_lse[i], want_lse[i]) << i;
      } else {
        EXPECT_NEAR(got_lse[i], want_lse[i], 1e-5f * (1.0f + std::fabs(want_lse[i]))) << i;
      }
    }
    // Row (t=1, h=0) had both sides empty: the prefix bits are copied exactly.
    const std::vector<std::uint8_t> pre_bytes = to_byte_vector(pre.select(0, 1).select(0, 0));
    EXPECT_EQ(to_byte_vector(dout.select(0, 1).select(0, 0)), pre_bytes);
  }
}

// Rows of a strided bf16 source (a view into a wider buffer) gathered along
// dimension 0, and an f32 [H, T] LSE along dimension 1 with a -inf fill:
// bit for bit as on the CPU.
TEST(CudaOpsTest, IndexSelectMatchesCpu) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  const Tensor wide = random_tensor({7, 3, 80}, DType::BF16, rng);
  const Tensor rows = wide.slice(2, 0, 64);  // [7, 3, 64], rows 240 apart
  const Tensor index = Tensor::from_i32(std::vector<std::int32_t>{6, -1, 0, 3, 7, 3}, {6});
  const Tensor want_rows = Tensor::empty({6, 3, 64}, DType::BF16);
  index_select(want_rows, rows, 0, index);
  const Tensor got_rows = Tensor::empty({6, 3, 64}, DType::BF16, Device::cuda());
  fill_tensor_bits(got_rows, kPoison);
  index_select(got_rows, wide.to(Device::cuda()).slice(2, 0, 64), 0, index.to(Device::cuda()));
  EXPECT_EQ(to_byte_vector(got_rows), to_byte_vector(want_rows));

  const Tensor lse = random_tensor({4, 9}, DType::F32, rng);
  const Tensor want_lse = Tensor::empty({4, 6}, DType::F32);
  index_select(want_lse, lse, 1, index, -kInf);
  const Tensor got_lse = Tensor::empty({4, 6}, DType::F32, Device::cuda());
  index_select(got_lse, lse.to(Device::cuda()), 1, index.to(Device::cuda()), -kInf);
  EXPECT_EQ(to_byte_vector(got_lse), to_byte_vector(want_lse));
}

TEST(CudaOpsTest, CopyBlocksAndAbsMaxMatchCpu) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  const std::vector<int> hnd = {0, 2, 1, 3};
  Tensor cache = Tensor::empty_strided_order({8, 16, 2, 64}, hnd, DType::BF16, Device::cpu());
  copy_tensor(cache, random_tensor({8, 16, 2, 64}, DType::BF16, rng));
  Tensor dcache = to_cuda_like(cache, hnd);
  const Tensor mapping = Tensor::from_i64(std::vector<std::int64_t>{0, 3, 5, 1, 2, 2, 7, 6}, {4, 2});
  copy_blocks({cache}, mapping);
  copy_blocks({dcache}, mapping.to(Device::cuda()));
  EXPECT_EQ(to_byte_vector(dcache), to_byte_vector(cache));

  const Tensor q = random_tensor({5, 4, 64}, DType::BF16, rng, 7.0f);
  const Tensor k = random_tensor({5, 2, 64}, DType::BF16, rng, 3.0f);
  const Tensor v = random_tensor({5, 2, 64}, DType::BF16, rng, 0.5f);
  const KVScales want = calc_kv_scales(q, k, v);
  const KVScales got = calc_kv_scales(q.to(Device::cuda()), k.to(Device::cuda()), v.to(Device::cuda()));
  EXPECT_EQ(got.q_scale, want.q_scale);
  EXPECT_EQ(got.k_scale, want.k_scale);
  EXPECT_EQ(got.v_scale, want.v_scale);
}

}  // namespace
}  // namespace pagedattn
