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
// everywhere except the slots written, which hold the encoded K/V (and, in a
// per-token-head cache, their scales; unwritten scales hold an f32 NaN, so
// a read of an unwritten int8 slot still turns into NaN).
class CacheUnderTest {
 public:
  CacheUnderTest(const AttentionBackend& backend, const ConformanceCase& c, std::int64_t num_blocks,
                 Device device);

  const KVCacheView& view() const { return view_; }

  // Records one token's K and V ([Hkv, D] each, model-dtype values) as stored at `slot`.
  void record(std::int64_t slot, const float* key, const float* value, const std::vector<float>& k_scale,
              const std::vector<float>& v_scale);

  // What attention reads back for one token's model-dtype K or V row `x`
  // ([Hkv, D]) stored with the per-tensor or per-head `scale` (a
  // per-token-head cache computes each head's own), into `out` ([Hkv, D]).
  void read_back(const float* x, const std::vector<float>& scale, float* out) const;

  // The first element of either half that differs from the expected image, described.
  std::optional<std::string> check() const;

 private:
  // Encodes a token's row into `image` (and its per-token-head scales into
  // `scale_image` at [slot, half]).
  void encode(std::vector<std::uint8_t>& image, std::int64_t slot, const float* x,
              const std::vector<float>& scale, int half);
  // Stores x of a row with scale `scale` as the cache does.
  void store(void* dst, float x, float scale) const;
  // The scale of head h of a row: per tensor, per head, or the row's own.
  float row_scale(const float* x, const std::vector<float>& scale, int h) const;

  // The logical bytes [NB, BS, Hkv, D] of the K half from the bytes at each
  // logical position, which a packed K holds in its own order (kv_packing.h).
  std::vector<std::uint8_t> in_key_order(const std::vector<std::uint8_t>& at_positions) const;

  std::optional<std::string> compare_half(const std::vector<std::uint8_t>& actual,
                                          const std::vector<std::uint8_t>& expected,
                                          std::string_view name) const;

  DType storage_dtype_;
  KVQuantMode mode_;
  int block_size_;
  int kv_heads_;
  int head_size_;
  Tensor storage_;
  Tensor scales_;  // [NB, 2, Hkv, BS] f32, per-token-head caches only
  KVCacheView view_;
  std::vector<std::uint8_t> expected_key_;
  std::vector<std::uint8_t> expected_value_;
  std::vector<float> expected_scales_;  // [NB, 2, Hkv, BS]
};

}  // namespace pagedattn::conformance
