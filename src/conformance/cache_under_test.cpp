#include "conformance/cache_under_test.h"

#include <fmt/format.h>
#include <pagedattn/backend/kv_packing.h>
#include <pagedattn/backend/token_head_quant.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>

#include "conformance/guarded_output.h"

namespace pagedattn::conformance {

CacheUnderTest::CacheUnderTest(const AttentionBackend& backend, const ConformanceCase& c,
                               std::int64_t num_blocks, Device device)
    : storage_dtype_(kv_cache_storage_dtype(c.kv_cache_dtype, c.dtype)),
      mode_(kv_quant_mode(c.kv_cache_dtype)),
      block_size_(c.block_size),
      kv_heads_(c.num_kv_heads),
      head_size_(c.head_size) {
  // As the layers get theirs: with per-token-head scales in the same allocation.
  LayerKVCache cache = allocate_layer_kv_cache(backend, num_blocks, c.block_size, c.num_kv_heads, c.head_size,
                                               c.kv_cache_dtype, c.dtype, c.layout, device);
  storage_ = std::move(cache.cache);
  scales_ = std::move(cache.scales);
  fill_tensor_bits(storage_, poison_bits(storage_dtype_));
  if (scales_.defined()) {
    fill_tensor_bits(scales_, poison_bits(DType::F32));
    expected_scales_.assign(static_cast<std::size_t>(scales_.numel()),
                            std::bit_cast<float>(static_cast<std::uint32_t>(poison_bits(DType::F32))));
  }
  view_ = backend.unbind_kv_cache(storage_, scales_);
  const auto poison = poison_bytes(storage_dtype_);
  const auto elements = static_cast<std::size_t>(num_blocks) * c.block_size * c.num_kv_heads * c.head_size;
  for (auto* image : {&expected_key_, &expected_value_}) {
    image->resize(elements * poison.size());
    for (std::size_t e = 0; e < elements; ++e)
      std::copy(poison.begin(), poison.end(), image->begin() + e * poison.size());
  }
}

void CacheUnderTest::record(std::int64_t slot, const float* key, const float* value,
                            const std::vector<float>& k_scale, const std::vector<float>& v_scale) {
  encode(expected_key_, slot, key, k_scale, 0);
  encode(expected_value_, slot, value, v_scale, 1);
}

float CacheUnderTest::row_scale(const float* x, const std::vector<float>& scale, int h) const {
  if (mode_ == KVQuantMode::Fp8PerTensor)
    return scale.size() == 1 ? scale[0] : scale[static_cast<std::size_t>(h)];
  if (mode_ == KVQuantMode::None) return 1.0f;
  float amax = 0.0f;
  for (int d = 0; d < head_size_; ++d) amax = token_head_amax(amax, x[h * head_size_ + d]);
  return token_head_scale(amax, storage_dtype_);
}

void CacheUnderTest::store(void* dst, float x, float scale) const {
  if (mode_ == KVQuantMode::Int8PerTokenHead || mode_ == KVQuantMode::Fp8PerTokenHead) {
    store_token_head(dst, storage_dtype_, x, token_head_inv_scale(scale));
  } else {
    store_from_float(dst, storage_dtype_, mode_ == KVQuantMode::Fp8PerTensor ? x / scale : x);
  }
}

void CacheUnderTest::read_back(const float* x, const std::vector<float>& scale, float* out) const {
  std::vector<std::uint8_t> row(static_cast<std::size_t>(kv_heads_) * head_size_ *
                                dtype_size(storage_dtype_));
  for (int h = 0; h < kv_heads_; ++h) {
    const float s = row_scale(x, scale, h);
    for (int d = 0; d < head_size_; ++d) {
      const auto i = static_cast<std::size_t>(h * head_size_ + d);
      void* stored = &row[i * dtype_size(storage_dtype_)];
      store(stored, x[i], s);
      const double value = load_as_float(stored, storage_dtype_);
      out[i] = static_cast<float>(mode_ == KVQuantMode::None ? value : value * static_cast<double>(s));
    }
  }
}

std::optional<std::string> CacheUnderTest::check() const {
  if (auto bad = compare_half(in_key_order(to_byte_vector(view_.key)), expected_key_, "key")) return bad;
  if (auto bad = compare_half(to_byte_vector(view_.value), expected_value_, "value")) return bad;
  if (!scales_.defined()) return std::nullopt;
  const std::vector<float> got = to_float_vector(scales_);
  for (std::size_t e = 0; e < got.size(); ++e) {
    if (std::bit_cast<std::uint32_t>(got[e]) == std::bit_cast<std::uint32_t>(expected_scales_[e])) continue;
    const std::size_t slot = e % block_size_;
    const std::size_t h = e / block_size_ % kv_heads_;
    const std::size_t half = e / block_size_ / kv_heads_ % 2;
    const std::size_t block = e / block_size_ / kv_heads_ / 2;
    const bool unwritten = std::isnan(expected_scales_[e]);
    return fmt::format("kv_cache scales[block {}, {}, offset {}, head {}]: {} (got {}, want {})", block,
                       half == 0 ? "key" : "value", slot, h,
                       unwritten ? "scale outside the written slots was modified" : "stored scale differs",
                       got[e], expected_scales_[e]);
  }
  return std::nullopt;
}

void CacheUnderTest::encode(std::vector<std::uint8_t>& image, std::int64_t slot, const float* x,
                            const std::vector<float>& scale, int half) {
  const std::size_t es = dtype_size(storage_dtype_);
  for (int h = 0; h < kv_heads_; ++h) {
    const float s = row_scale(x, scale, h);
    if (scales_.defined()) {
      const std::int64_t block = slot / block_size_;
      const std::int64_t offset = slot % block_size_;
      expected_scales_[static_cast<std::size_t>(((block * 2 + half) * kv_heads_ + h) * block_size_ +
                                                offset)] = s;
    }
    for (int d = 0; d < head_size_; ++d) {
      const std::size_t i = static_cast<std::size_t>(h) * head_size_ + d;
      const auto e = (static_cast<std::size_t>(slot) * kv_heads_ + h) * head_size_ + d;
      store(&image[e * es], x[i], s);
    }
  }
}

std::vector<std::uint8_t> CacheUnderTest::in_key_order(const std::vector<std::uint8_t>& at_positions) const {
  if (view_.key_packing == KeyPacking::None) return at_positions;
  std::vector<std::uint8_t> out(at_positions.size());
  const std::size_t es = dtype_size(storage_dtype_);
  const auto element = [&](std::size_t block, std::int64_t slot, int h, std::int64_t d) {
    return ((block * block_size_ + static_cast<std::size_t>(slot)) * kv_heads_ + h) * head_size_ +
           static_cast<std::size_t>(d);
  };
  for (std::size_t b = 0; b * block_size_ * kv_heads_ * head_size_ * es < at_positions.size(); ++b) {
    for (int s = 0; s < block_size_; ++s) {
      for (int h = 0; h < kv_heads_; ++h) {
        for (int d = 0; d < head_size_; ++d) {
          const std::int64_t at = key_offset_in_block(view_.key_packing, s, d, head_size_);
          std::copy_n(at_positions.begin() +
                          static_cast<std::ptrdiff_t>(element(b, at / head_size_, h, at % head_size_) * es),
                      es, out.begin() + static_cast<std::ptrdiff_t>(element(b, s, h, d) * es));
        }
      }
    }
  }
  return out;
}

std::optional<std::string> CacheUnderTest::compare_half(const std::vector<std::uint8_t>& actual,
                                                        const std::vector<std::uint8_t>& expected,
                                                        std::string_view name) const {
  if (actual == expected) return std::nullopt;
  const std::size_t es = dtype_size(storage_dtype_);
  const auto poison = poison_bytes(storage_dtype_);
  for (std::size_t e = 0; e * es < actual.size(); ++e) {
    if (std::equal(actual.begin() + e * es, actual.begin() + (e + 1) * es, expected.begin() + e * es))
      continue;
    const std::size_t d = e % head_size_;
    const std::size_t h = e / head_size_ % kv_heads_;
    const std::size_t slot = e / head_size_ / kv_heads_;
    const bool unwritten = equals_at(expected, e, poison);
    return fmt::format("kv_cache.{}[block {}, offset {}, head {}, dim {}]: {} (got {}, want {})", name,
                       slot / block_size_, slot % block_size_, h, d,
                       unwritten ? "slot outside the written ones was modified" : "stored value differs",
                       load_as_float(&actual[e * es], storage_dtype_),
                       load_as_float(&expected[e * es], storage_dtype_));
  }
  return std::nullopt;
}

}  // namespace pagedattn::conformance
