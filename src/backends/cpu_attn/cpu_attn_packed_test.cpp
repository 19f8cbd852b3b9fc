// CPU_ATTN over a Keys16-packed K (kv_packing.h): which caches the backend
// packs, and the results on every ISA against REFERENCE and against the same
// tokens in a row-major cache (decodes split and not, partial groups, tiles
// not starting a group under a sliding window, prefill items).
#include <gtest/gtest.h>
#include <pagedattn/conformance.h>
#include <pagedattn/metadata.h>
#include <pagedattn/registry.h>

#include <random>
#include <utility>
#include <vector>

#include "backends/cpu_attn/cpu_attn_backend.h"
#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cpu_attn/kernels/cpu_attn_isa.h"

namespace pagedattn {
namespace {

const CpuAttnBackend kBackend;

constexpr int kHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadSize = 64;
constexpr int kBlockSize = 32;
constexpr int kLongDecodeKeys = cpu_attn::kSplitKeys * 3 / 2;  // split in two
constexpr int kBlocksPerRequest = (kLongDecodeKeys + kBlockSize - 1) / kBlockSize;

// The active ISA for the scope, then the saved one back.
class ActiveIsa {
 public:
  explicit ActiveIsa(cpu_attn::Isa isa) : saved_(cpu_attn::active_isa()) { ok_ = cpu_attn::set_isa(isa); }
  ~ActiveIsa() { cpu_attn::set_isa(saved_); }
  ActiveIsa(const ActiveIsa&) = delete;
  ActiveIsa& operator=(const ActiveIsa&) = delete;
  bool ok() const { return ok_; }

 private:
  cpu_attn::Isa saved_;
  bool ok_ = false;
};

Tensor e4m3_cache(int num_blocks, int block_size, KVCacheLayout layout) {
  Tensor t = Tensor::empty_strided_order(
      kBackend.kv_cache_shape(num_blocks, block_size, kKvHeads, kHeadSize, CacheDType::Fp8E4M3),
      kBackend.kv_cache_stride_order(layout), DType::FP8_E4M3, Device::cpu());
  fill_tensor_bits(t, 0);
  return t;
}

TEST(CpuAttnPackedKeys, PackedWhereTheActiveIsaReadsItFaster) {
  const std::vector<cpu_attn::Isa> isas = cpu_attn::available_isas();
  for (const cpu_attn::Isa isa : isas) {
    const ActiveIsa active(isa);
    ASSERT_TRUE(active.ok());
    const KeyPacking want = isa == cpu_attn::Isa::Avx512Bf16 ? KeyPacking::Keys16 : KeyPacking::None;
    EXPECT_EQ(kBackend.unbind_kv_cache(e4m3_cache(2, kBlockSize, KVCacheLayout::HND)).key_packing, want)
        << cpu_attn::isa_name(isa);
    // NHD rows of two heads, a block size the groups do not divide, bf16 K: never.
    EXPECT_EQ(kBackend.unbind_kv_cache(e4m3_cache(2, kBlockSize, KVCacheLayout::NHD)).key_packing,
              KeyPacking::None);
    EXPECT_EQ(kBackend.unbind_kv_cache(e4m3_cache(2, 8, KVCacheLayout::HND)).key_packing, KeyPacking::None);
    const Tensor bf16 =
        Tensor::zeros(kBackend.kv_cache_shape(2, kBlockSize, kKvHeads, kHeadSize, CacheDType::Auto), DType::BF16);
    EXPECT_EQ(kBackend.unbind_kv_cache(bf16).key_packing, KeyPacking::None);
  }
}

// A batch written into a row-major and a packed e4m3 HND cache.
struct PackedBatch {
  std::vector<std::pair<int, int>> requests{{1, kLongDecodeKeys}, {1, 90}, {20, 300}, {1, 16}};
  CommonAttentionMetadata common;
  Tensor query;
  LayerQuantState layer;
  Tensor row_major_storage = e4m3_cache(kBlocksPerRequest * 4, kBlockSize, KVCacheLayout::HND);
  Tensor packed_storage = e4m3_cache(kBlocksPerRequest * 4, kBlockSize, KVCacheLayout::HND);
  KVCacheView row_major;
  KVCacheView packed;

  explicit PackedBatch(const AttentionImplParams& params) {
    std::mt19937 rng(5);
    std::normal_distribution<float> dist;
    const auto random = [&](Dims shape) {
      std::vector<float> v(static_cast<std::size_t>(shape[0] * shape[1] * shape[2]));
      for (float& x : v) x = dist(rng);
      return Tensor::from_floats(v, shape, DType::BF16);
    };
    std::vector<RequestSpec> specs;
    std::vector<std::int64_t> slots;
    int tokens = 0;
    for (std::size_t r = 0; r < requests.size(); ++r) {
      RequestSpec spec{requests[r].first, requests[r].second, {}};
      for (int b = 0; b < kBlocksPerRequest; ++b) spec.blocks.push_back(static_cast<int>(r) * kBlocksPerRequest + b);
      for (int j = 0; j < spec.seq_len; ++j) {
        slots.push_back(std::int64_t{spec.blocks[static_cast<std::size_t>(j / kBlockSize)]} * kBlockSize + j % kBlockSize);
      }
      tokens += spec.query_len;
      specs.push_back(spec);
    }
    MetadataOptions options;
    options.block_size = kBlockSize;
    common = make_common_metadata(specs, options);
    query = random({tokens, kHeads, kHeadSize});
    const auto positions = static_cast<std::int64_t>(slots.size());
    const Tensor key = random({positions, kKvHeads, kHeadSize});
    const Tensor value = random({positions, kKvHeads, kHeadSize});
    layer.k_scale = Tensor::from_floats(std::vector<float>{0.5f}, {1}, DType::F32);
    layer.v_scale = Tensor::from_floats(std::vector<float>{0.25f}, {1}, DType::F32);
    row_major = kBackend.unbind_kv_cache(row_major_storage);
    row_major.key_packing = KeyPacking::None;
    packed = kBackend.unbind_kv_cache(packed_storage);
    packed.key_packing = KeyPacking::Keys16;
    const auto impl = kBackend.make_impl(params);
    for (const KVCacheView* view : {&row_major, &packed}) {
      impl->do_kv_cache_update(layer, key, value, *view, Tensor::from_i64(slots, {positions}));
    }
  }

  Tensor forward(const AttentionBackend& backend, const AttentionImplParams& params, const KVCacheView& kv) const {
    BuilderParams bp;
    bp.block_size = kBlockSize;
    bp.num_kv_heads = kKvHeads;
    bp.head_size = kHeadSize;
    const auto md = backend.make_builder(bp)->build(common);
    Tensor out = Tensor::zeros({query.size(0), kHeads, kHeadSize}, DType::BF16);
    backend.make_impl(params)->forward(layer, query, {}, {}, kv, *md, out, {});
    return out;
  }
};

AttentionImplParams packed_params(std::optional<int> sliding_window) {
  AttentionImplParams params;
  params.num_heads = kHeads;
  params.num_kv_heads = kKvHeads;
  params.head_size = kHeadSize;
  params.scale = 0.125f;
  params.dtype = DType::BF16;
  params.kv_cache_dtype = CacheDType::Fp8E4M3;
  params.sliding_window = sliding_window;
  return params;
}

// Every ISA matches REFERENCE on the packed cache; off the AVX512-BF16
// decode, which reads packed groups directly, the unpacked rows give the
// row-major cache's bits. A 50-key window starts most decode tiles inside a
// group, so the AVX512-BF16 decode unpacks those.
TEST(CpuAttnPackedKeys, MatchTheOracleAndTheRowMajorCacheOnEveryIsa) {
  const AttentionBackend* oracle = BackendRegistry::instance().find("REFERENCE");
  ASSERT_NE(oracle, nullptr);
  for (const std::optional<int> window : {std::optional<int>{}, std::optional<int>{50}}) {
    const AttentionImplParams params = packed_params(window);
    const PackedBatch batch(params);
    ASSERT_NE(to_byte_vector(batch.packed.key), to_byte_vector(batch.row_major.key));
    const std::vector<float> want = to_float_vector(batch.forward(*oracle, params, batch.row_major));
    OracleOutput expected;
    expected.num_tokens = static_cast<int>(batch.query.size(0));
    expected.num_heads = kHeads;
    expected.head_size = kHeadSize;
    expected.output.assign(want.begin(), want.end());
    EXPECT_EQ(to_float_vector(batch.forward(*oracle, params, batch.packed)), want);
    for (const cpu_attn::Isa isa : cpu_attn::available_isas()) {
      const ActiveIsa active(isa);
      ASSERT_TRUE(active.ok());
      const Tensor got = batch.forward(kBackend, params, batch.packed);
      const auto failure = compare_with_oracle(expected, to_float_vector(got), {}, DType::BF16);
      EXPECT_FALSE(failure.has_value()) << cpu_attn::isa_name(isa) << ": " << failure.value_or("");
      if (isa != cpu_attn::Isa::Avx512Bf16) {
        EXPECT_EQ(to_byte_vector(got), to_byte_vector(batch.forward(kBackend, params, batch.row_major)))
            << cpu_attn::isa_name(isa);
      }
    }
  }
}

}  // namespace
}  // namespace pagedattn
