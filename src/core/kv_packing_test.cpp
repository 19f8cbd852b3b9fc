// Packed K (kv_packing.h): the offset function's layout, reshape_and_cache's
// packed writes against its row-major ones, and the packing's validation.
#include <gtest/gtest.h>
#include <pagedattn/backend/kv_packing.h>
#include <pagedattn/ops.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "testing/expect_error.h"

namespace pagedattn {
namespace {

using test::expect_invalid;

constexpr std::uint64_t kPoison = 0x5A5A5A5A5A5A5A5Aull;
constexpr int kLaneElements = 16;  // a 128-bit lane of e4m3 bytes

TEST(KeyPackingOffset, EachGroupIsAPermutationOfItsRows) {
  for (const int d_size : {4, 8, 64, 128, 260}) {
    std::vector<int> hits(static_cast<std::size_t>(kPackedKeyGroup * d_size), 0);
    for (int t = 0; t < kPackedKeyGroup; ++t) {
      for (int d = 0; d < d_size; ++d) {
        const std::int64_t o = packed_key_group_offset(t, d);
        ASSERT_GE(o, 0);
        ASSERT_LT(o, kPackedKeyGroup * d_size) << "t " << t << " d " << d << " D " << d_size;
        ++hits[static_cast<std::size_t>(o)];
      }
    }
    for (const int h : hits) EXPECT_EQ(h, 1) << "D " << d_size;
  }
}

TEST(KeyPackingOffset, QuadsAreOneVectorWithFourKeysPerLaneAndAdjacentPairs) {
  for (int t = 0; t < kPackedKeyGroup; ++t) {
    for (int d = 0; d < 2 * kPackedDimGroup; ++d) {
      const std::int64_t o = packed_key_group_offset(t, d);
      EXPECT_EQ(o / kPackedGroupElements, d / kPackedDimGroup);  // dimension quad = 64-element run
      EXPECT_EQ(o % kPackedGroupElements / kLaneElements, t / kPackedKeysPerLane);
      if (d % 2 == 0) {
        EXPECT_EQ(packed_key_group_offset(t, d + 1), o + 1);
      }
    }
  }
  // The formula of docs/kv_layouts.md by hand: key 5, dimension 6 of a group
  // is 1 * 64 + 1 * 16 + 1 * 8 + 1 * 2 + 0.
  EXPECT_EQ(packed_key_group_offset(5, 6), 90);
  EXPECT_EQ(key_offset_in_block(KeyPacking::Keys16, 16 + 5, 6, 128), 16 * 128 + 90);
  EXPECT_EQ(key_offset_in_block(KeyPacking::None, 21, 6, 128), 21 * 128 + 6);
}

struct HndCache {
  Tensor kv;  // [2, NB, BS, Hkv, D] in HND order
  Tensor key;
  Tensor value;
};

HndCache make_hnd_cache(std::int64_t nb, std::int64_t bs, std::int64_t hkv, std::int64_t d, DType dtype) {
  const std::vector<int> hnd{0, 1, 3, 2, 4};
  HndCache c;
  c.kv = Tensor::empty_strided_order({2, nb, bs, hkv, d}, hnd, dtype, Device::cpu());
  fill_tensor_bits(c.kv, kPoison);
  c.key = c.kv.select(0, 0);
  c.value = c.kv.select(0, 1);
  return c;
}

// The bytes of element (block, slot, head) of a K half whose rows are
// head_size apart, read at their packed positions.
std::vector<std::uint8_t> packed_element(const Tensor& key, std::int64_t block, int slot, std::int64_t head, int d) {
  const std::size_t es = dtype_size(key.dtype());
  const auto d_size = static_cast<int>(key.size(3));
  const std::int64_t e = block * key.stride(0) + head * key.stride(2) +
                         key_offset_in_block(KeyPacking::Keys16, slot, d, d_size);
  const auto* p = static_cast<const std::uint8_t*>(key.data()) + e * static_cast<std::int64_t>(es);
  return {p, p + es};
}

std::vector<std::uint8_t> logical_element(const Tensor& key, std::int64_t block, int slot, std::int64_t head, int d) {
  const std::size_t es = dtype_size(key.dtype());
  const std::int64_t e = block * key.stride(0) + slot * key.stride(1) + head * key.stride(2) + d;
  const auto* p = static_cast<const std::uint8_t*>(key.data()) + e * static_cast<std::int64_t>(es);
  return {p, p + es};
}

TEST(ReshapeAndCachePacked, KeysLandAtPackedPositionsValuesStayRowMajor) {
  constexpr std::int64_t kNB = 3, kBS = 32, kHkv = 2, kD = 8, kT = 20;
  std::mt19937 rng(7);
  for (const CacheDType cache_dtype : {CacheDType::Fp8E4M3, CacheDType::Auto}) {
    const DType storage = kv_cache_storage_dtype(cache_dtype, DType::BF16);
    std::vector<float> kf(kT * kHkv * kD);
    std::vector<float> vf(kf.size());
    std::normal_distribution<float> dist;
    for (float& x : kf) x = dist(rng);
    for (float& x : vf) x = dist(rng);
    const Tensor key = Tensor::from_floats(kf, {kT, kHkv, kD}, DType::BF16);
    const Tensor value = Tensor::from_floats(vf, {kT, kHkv, kD}, DType::BF16);
    std::vector<std::int64_t> slots(kT);
    std::vector<std::int64_t> all(kNB * kBS);
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::int64_t>(i);
    std::shuffle(all.begin(), all.end(), rng);
    std::copy(all.begin(), all.begin() + kT, slots.begin());
    slots[3] = -1;  // a padded token writes nothing
    const Tensor slot_mapping = Tensor::from_i64(slots, {kT});
    const Tensor scale = Tensor::from_floats(std::vector<float>{0.5f}, {1}, DType::F32);

    HndCache row_major = make_hnd_cache(kNB, kBS, kHkv, kD, storage);
    HndCache packed = make_hnd_cache(kNB, kBS, kHkv, kD, storage);
    reshape_and_cache(key, value, row_major.key, row_major.value, slot_mapping, cache_dtype, scale, scale);
    reshape_and_cache(key, value, packed.key, packed.value, slot_mapping, cache_dtype, scale, scale,
                      KeyPacking::Keys16);

    EXPECT_EQ(to_byte_vector(packed.value), to_byte_vector(row_major.value));
    EXPECT_NE(to_byte_vector(packed.key), to_byte_vector(row_major.key));
    for (std::int64_t b = 0; b < kNB; ++b) {
      for (int s = 0; s < kBS; ++s) {
        for (std::int64_t h = 0; h < kHkv; ++h) {
          for (int d = 0; d < kD; ++d) {
            ASSERT_EQ(packed_element(packed.key, b, s, h, d), logical_element(row_major.key, b, s, h, d))
                << "block " << b << " slot " << s << " head " << h << " dim " << d;
          }
        }
      }
    }
  }
}

// A CPU ops set that writes only row-major K (the default) and counts writes.
struct RowMajorOnlyOps final : OpsImpl {
  void reshape_and_cache(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                         const TensorView&, const TensorView&, const TensorView&, KVQuantMode,
                         KeyPacking) override {
    ++reshape_calls;
  }
  void merge_attn_states(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                         const TensorView&, const TensorView&) override {}
  void copy_blocks(const std::vector<TensorView>&, const TensorView&) override {}
  void index_select(const TensorView&, const TensorView&, int, const TensorView&, std::uint64_t) override {}
  float abs_max(const TensorView&) override { return 1.0f; }
  int reshape_calls = 0;
};

TEST(ReshapeAndCachePacked, CachesThatCannotHoldThePackingAreRejectedUnchanged) {
  const Tensor slot = Tensor::from_i64(std::vector<std::int64_t>{0}, {1});
  const auto rejects = [&](const Tensor& kv, const std::string& needle) {
    const Tensor key = Tensor::zeros({1, kv.size(3), kv.size(4)}, DType::BF16);
    const std::vector<std::uint8_t> before = to_byte_vector(kv);
    expect_invalid(
        [&] {
          reshape_and_cache(key, key, kv.select(0, 0), kv.select(0, 1), slot, CacheDType::Auto, {}, {},
                            KeyPacking::Keys16);
        },
        needle);
    EXPECT_EQ(to_byte_vector(kv), before);
  };
  // NHD with two heads: K rows are Hkv * D = 16 elements apart.
  const std::vector<int> nhd{0, 1, 2, 3, 4};
  Tensor nhd_cache = Tensor::empty_strided_order({2, 1, 16, 2, 8}, nhd, DType::BF16, Device::cpu());
  fill_tensor_bits(nhd_cache, kPoison);
  rejects(nhd_cache, "kv_cache.key slot stride must be 8 (rows 8 elements apart for a keys16-packed K), got 16");
  rejects(make_hnd_cache(2, 8, 1, 8, DType::BF16).kv,
          "kv_cache block size must be a multiple of 16 for a keys16-packed K, got 8");
  rejects(make_hnd_cache(1, 16, 1, 6, DType::BF16).kv,
          "kv_cache head size must be a multiple of 4 for a keys16-packed K, got 6");

  const Tensor key = Tensor::zeros({1, 1, 8}, DType::BF16);
  RowMajorOnlyOps row_major_only;
  register_ops_impl(DeviceType::CPU, &row_major_only);
  HndCache cache = make_hnd_cache(1, 16, 1, 8, DType::BF16);
  expect_invalid(
      [&] {
        reshape_and_cache(key, key, cache.key, cache.value, slot, CacheDType::Auto, {}, {}, KeyPacking::Keys16);
      },
      "key_packing must be none (the cpu cache op writes row-major K), got keys16");
  EXPECT_EQ(row_major_only.reshape_calls, 0);
  reshape_and_cache(key, key, cache.key, cache.value, slot, CacheDType::Auto, {}, {});
  EXPECT_EQ(row_major_only.reshape_calls, 1);
  register_ops_impl(DeviceType::CPU, nullptr);
}

}  // namespace
}  // namespace pagedattn
