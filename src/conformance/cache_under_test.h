#pragma once

#include <pagedattn/backend/backend.h>
#include <pagedattn/conformance.h>
#include <pagedattn/kv_cache.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pagedattn::conformance {

// The paged cache under test and the byte image it must hold: poison
// everywhere except the slots written, which hold the encoded K/V.
class CacheUnderTest {
 public:
  CacheUnderTest(const AttentionBackend& backend, const ConformanceCase& c, std::int64_t num_blocks,
                 Device device);

  const KVCacheView& view() const { return view_; }

  // Records one token's K and V ([Hkv, D] each, model-dtype values) as stored at `slot`.
  void record(std::int64_t slot, const float* key, const float* value, const std::vector<float>& k_scale,
              const std::vector<float>& v_scale);

  // What attention reads back for model value x stored with `scale`.
  float read_value(float x, float scale) const;

  // The first element of either half that differs from the expected image, described.
  std::optional<std::string> check() const;

 private:
  void encode(std::vector<std::uint8_t>& image, std::int64_t slot, const float* x,
              const std::vector<float>& scale) const;

  // The logical bytes [NB, BS, Hkv, D] of the K half from the bytes at each
  // logical position, which a packed K holds in its own order (kv_packing.h).
  std::vector<std::uint8_t> in_key_order(const std::vector<std::uint8_t>& at_positions) const;

  std::optional<std::string> compare_half(const std::vector<std::uint8_t>& actual,
                                          const std::vector<std::uint8_t>& expected,
                                          std::string_view name) const;

  DType storage_dtype_;
  bool fp8_;
  int block_size_;
  int kv_heads_;
  int head_size_;
  Tensor storage_;
  KVCacheView view_;
  std::vector<std::uint8_t> expected_key_;
  std::vector<std::uint8_t> expected_value_;
};

}  // namespace pagedattn::conformance
