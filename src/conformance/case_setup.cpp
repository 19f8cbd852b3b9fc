#include "conformance/case_setup.h"

#include <fmt/format.h>
#include <pagedattn/error.h>
#include <pagedattn/backend/registry.h>

#include <algorithm>
#include <array>
#include <string_view>

namespace pagedattn::conformance {
namespace {

float round_to(DType t, float x) {
  std::array<std::byte, sizeof(double)> buf{};
  store_from_float(buf.data(), t, x);
  return load_as_float(buf.data(), t);
}

}  // namespace

std::vector<float> random_rows(Rng& rng, std::size_t elements, DType dtype) {
  std::vector<float> v(elements);
  for (float& x : v) x = round_to(dtype, rng.normal());
  return v;
}

std::string join(const std::vector<std::string>& parts) {
  std::string s;
  for (const std::string& p : parts) s += (s.empty() ? "" : "; ") + p;
  return s;
}

void validate_case(const ConformanceCase& c) {
  constexpr std::string_view where = "conformance case";
  check_arg(c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0, where,
            "num_heads / num_kv_heads", "positive, num_heads a multiple of num_kv_heads",
            fmt::format("{} / {}", c.num_heads, c.num_kv_heads));
  check_arg(c.head_size > 0, where, "head_size", "> 0", c.head_size);
  check_arg(c.block_size > 0, where, "block_size", "> 0", c.block_size);
  check_arg(!c.per_head_kv_scales || kv_quant_mode(c.kv_cache_dtype) == KVQuantMode::Fp8PerTensor, where,
            "per_head_kv_scales", "only with a per-tensor-scaled fp8 KV cache",
            cache_dtype_name(c.kv_cache_dtype));
  check_arg(!c.padded_slots || c.attn_type != AttentionType::EncoderDecoder, where, "padded_slots",
            "not with cross-attention", "set");
  if (c.sliding_window) check_arg(*c.sliding_window > 0, where, "sliding_window", "> 0", *c.sliding_window);
  if (c.shared_prefix != 0) {
    check_arg(c.shared_prefix > 0 && c.shared_prefix % c.block_size == 0, where, "shared_prefix",
              fmt::format("a positive multiple of block_size ({})", c.block_size), c.shared_prefix);
    check_arg(c.attn_type == AttentionType::Decoder, where, "shared_prefix", "only with decoder attention",
              attention_type_name(c.attn_type));
    for (const auto& [q, s] : c.batch.requests) {
      check_arg(s - q >= c.shared_prefix, where, "shared_prefix", fmt::format("<= every context ({} - {})", s, q),
                c.shared_prefix);
    }
  }
  if (c.attention_chunk_size) {
    check_arg(*c.attention_chunk_size > 0 && *c.attention_chunk_size % c.block_size == 0, where,
              "attention_chunk_size", fmt::format("a positive multiple of block_size ({})", c.block_size),
              *c.attention_chunk_size);
    check_arg(c.attn_type == AttentionType::Decoder, where, "attention_chunk_size", "only with decoder attention",
              attention_type_name(c.attn_type));
  }
  const std::size_t ranged = c.batch.mm_prefix_ranges.size();
  check_arg(ranged == 0 || ranged == c.batch.requests.size(), where, "batch mm_prefix_ranges size",
            fmt::format("0 or the number of requests ({})", c.batch.requests.size()), ranged);
  if (c.mm_prefix) {
    check_arg(c.attn_type == AttentionType::Decoder && c.causal, where, "mm_prefix",
              "only with causal decoder attention", attention_type_name(c.attn_type));
    check_arg(ranged > 0, where, "mm_prefix", "a batch with mm_prefix_ranges", c.batch.name);
    check_arg(!c.attention_chunk_size && c.shared_prefix == 0, where, "mm_prefix",
              "not with attention_chunk_size or shared_prefix", "both set");
  }
  for (const auto& [q, s] : c.batch.requests) {
    check_arg(q >= 0 && s >= 0, where, "batch lengths", "non-negative", fmt::format("({}, {})", q, s));
    if (c.attn_type == AttentionType::Decoder)
      check_arg(s >= q, where, "seq_len", fmt::format(">= query_len {}", q), s);
    if (c.attn_type == AttentionType::Encoder || c.attn_type == AttentionType::EncoderOnly) {
      check_arg(s == q, where, "seq_len", fmt::format("== query_len {} for encoder attention", q), s);
    }
  }
}

std::optional<std::string> skip_reason(const AttentionBackend& backend, const ConformanceCase& c,
                                       Device device) {
  SelectorConfig cfg;
  cfg.head_size = c.head_size;
  cfg.dtype = c.dtype;
  cfg.kv_cache_dtype = c.kv_cache_dtype;
  cfg.block_size = c.block_size;
  cfg.has_sink = c.sinks;
  cfg.use_per_head_quant_scales = c.per_head_kv_scales;
  cfg.attn_type = c.attn_type;
  cfg.use_non_causal = c.attn_type == AttentionType::Decoder && !c.causal;
  cfg.use_mm_prefix = c.mm_prefix;
  cfg.device = device;
  cfg.capability = device_capability(device);
  std::vector<std::string> reasons = backend.validate_configuration(cfg);
  if (backend.device_type() != device.type) {
    reasons.push_back(
        fmt::format("runs on {}, not {}", device_type_name(backend.device_type()), device_name(device)));
  }
  if (c.sliding_window && !backend.supports_sliding_window())
    reasons.emplace_back("sliding window not supported");
  if (c.soft_cap && !backend.supports_soft_cap()) reasons.emplace_back("logits soft cap not supported");
  if (c.alibi && !backend.supports_alibi()) reasons.emplace_back("ALiBi not supported");
  if (c.attention_chunk_size && !backend.supports_chunked_local_attention()) {
    reasons.emplace_back("chunked local attention not supported");
  }
  if (const auto required = backend.required_kv_cache_layout(); required && *required != c.layout) {
    reasons.push_back(fmt::format("requires the {} KV cache layout", kv_cache_layout_name(*required)));
  }
  if (reasons.empty()) return std::nullopt;
  return join(reasons);
}

RowTensors make_row_tensors(const std::vector<const std::vector<float>*>& parts,
                            const std::vector<int>& heads, int rows, int head_size, DType dtype,
                            Device device, bool fused) {
  RowTensors out;
  if (!fused) {
    for (std::size_t i = 0; i < parts.size(); ++i) {
      out.owners.push_back(Tensor::from_floats(*parts[i], {rows, heads[i], head_size}, dtype, device));
      out.views.push_back(out.owners.back());
    }
    return out;
  }
  std::int64_t width = 0;
  for (const int h : heads) width += static_cast<std::int64_t>(h) * head_size;
  std::vector<float> host(static_cast<std::size_t>(rows * width));
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const std::int64_t w = static_cast<std::int64_t>(heads[i]) * head_size;
    for (std::int64_t r = 0; r < rows; ++r) {
      std::copy_n(parts[i]->begin() + r * w, w, host.begin() + r * width + offset);
    }
    offset += w;
  }
  out.owners.push_back(Tensor::from_floats(host, {rows, width}, dtype, device));
  auto* base = static_cast<std::byte*>(out.owners.back().data());
  offset = 0;
  for (const int h : heads) {
    out.views.emplace_back(base + offset * static_cast<std::int64_t>(dtype_size(dtype)), dtype, device,
                           Dims{rows, h, head_size}, Dims{width, head_size, 1});
    offset += static_cast<std::int64_t>(h) * head_size;
  }
  return out;
}

}  // namespace pagedattn::conformance
