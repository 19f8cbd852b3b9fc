#include "conformance/cache_under_test.h"

#include <fmt/format.h>
#include <pagedattn/backend/kv_packing.h>

#include <algorithm>
#include <array>

#include "conformance/guarded_output.h"

namespace pagedattn::conformance {

CacheUnderTest::CacheUnderTest(const AttentionBackend& backend, const ConformanceCase& c,
                               std::int64_t num_blocks, Device device)
    : storage_dtype_(kv_cache_storage_dtype(c.kv_cache_dtype, c.dtype)),
      fp8_(is_quantized_kv_cache(c.kv_cache_dtype)),
      block_size_(c.block_size),
      kv_heads_(c.num_kv_heads),
      head_size_(c.head_size) {
  const Dims shape =
      backend.kv_cache_shape(num_blocks, c.block_size, c.num_kv_heads, c.head_size, c.kv_cache_dtype);
  const std::vector<int> order = backend.kv_cache_stride_order(c.layout);
  storage_ = Tensor::empty_strided_order(shape, order, storage_dtype_, device);
  fill_tensor_bits(storage_, poison_bits(storage_dtype_));
  view_ = backend.unbind_kv_cache(storage_);
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
  encode(expected_key_, slot, key, k_scale);
  encode(expected_value_, slot, value, v_scale);
}

float CacheUnderTest::read_value(float x, float scale) const {
  std::array<std::byte, sizeof(double)> buf{};
  store_from_float(buf.data(), storage_dtype_, fp8_ ? x / scale : x);
  const double stored = load_as_float(buf.data(), storage_dtype_);
  return static_cast<float>(fp8_ ? stored * static_cast<double>(scale) : stored);
}

std::optional<std::string> CacheUnderTest::check() const {
  if (auto bad = compare_half(in_key_order(to_byte_vector(view_.key)), expected_key_, "key")) return bad;
  return compare_half(to_byte_vector(view_.value), expected_value_, "value");
}

void CacheUnderTest::encode(std::vector<std::uint8_t>& image, std::int64_t slot, const float* x,
                            const std::vector<float>& scale) const {
  const std::size_t es = dtype_size(storage_dtype_);
  for (int h = 0; h < kv_heads_; ++h) {
    const float s = scale.size() == 1 ? scale[0] : scale[static_cast<std::size_t>(h)];
    for (int d = 0; d < head_size_; ++d) {
      const std::size_t i = static_cast<std::size_t>(h) * head_size_ + d;
      const auto e = (static_cast<std::size_t>(slot) * kv_heads_ + h) * head_size_ + d;
      store_from_float(&image[e * es], storage_dtype_, fp8_ ? x[i] / s : x[i]);
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
