#include "varlen_attention.h"

#include <pagedattn/batch_attention.h>
#include <pagedattn/error.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "tensor_arg.h"

namespace pagedattn::python {
namespace {

// Planned wrappers kept per configuration; past this many the cache restarts
// (a serving loop uses a handful: one per layer shape and block size).
constexpr std::size_t kMaxCachedWrappers = 64;
constexpr int kRangeWidth = 2;  // (first, last)

std::string& last_backend() {
  static std::string name;
  return name;
}

// A host copy of the elements of an integer tensor whose dtype is T's.
template <typename T>
std::vector<T> host_values(const TensorView& t) {
  const std::vector<std::uint8_t> bytes = to_byte_vector(t);
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

std::vector<std::int32_t> host_i32(const TensorView& t, std::string_view where, std::string_view name, int rank) {
  check_rank(t, where, name, rank);
  check_dtype(t, where, name, DType::I32);
  return host_values<std::int32_t>(t);
}

// A per-KV-head descale as the kernels read it: [1] or [Hkv] f32 on the
// device. vLLM passes one layer scale expanded to [num_seqs, Hkv]; its rows
// must agree, since pagedattn keeps one scale per KV head.
TensorView kv_scale(const TensorView& t, std::string_view where, std::string_view name, int num_kv_heads) {
  if (!t.defined()) return t;
  check_dtype(t, where, name, DType::F32);
  if (t.dim() == 1) return t;
  check_rank(t, where, name, 2);
  check_size(t, 1, where, name, num_kv_heads);
  const std::vector<float> values = to_float_vector(t);
  for (std::size_t i = static_cast<std::size_t>(num_kv_heads); i < values.size(); ++i) {
    if (values[i] != values[i % static_cast<std::size_t>(num_kv_heads)]) {
      throw_unsupported(where, fmt::format("{} rows differ (row {} head {}: {} vs row 0: {}); pagedattn takes one "
                                           "scale per KV head",
                                           name, i / num_kv_heads, i % num_kv_heads, values[i],
                                           values[i % static_cast<std::size_t>(num_kv_heads)]));
    }
  }
  return t.select(0, 0);
}

std::vector<float> host_floats(const TensorView& t, std::string_view where, std::string_view name, int heads) {
  if (!t.defined()) return {};
  check_rank(t, where, name, 1);
  check_size(t, 0, where, name, heads);
  return to_float_vector(t);
}

// PrefixLM ranges as BatchAttention::plan takes them: CSR offsets [B + 1]
// and half-open (start, end) pairs.
struct MmPrefixCsr {
  std::vector<std::int32_t> start_loc;
  std::vector<std::int32_t> ranges;
};

// vLLM's padded inclusive [B, max_ranges, 2] tensor as CSR [first, last + 1)
// ranges. A pair with first >= last is padding or a one-token range, which
// adds nothing to the causal mask, so skipping it is exact. Order, overlap
// and bounds are checked by the plan (set_mm_prefix_ranges's rules).
MmPrefixCsr mm_prefix_csr(const TensorView& t, int num_reqs, std::string_view where) {
  constexpr std::string_view name = "mm_prefix_range";
  check_rank(t, where, name, 3);
  check_arg(t.size(0) == num_reqs, where, "mm_prefix_range size(0)",
            fmt::format("the number of requests ({})", num_reqs), t.size(0));
  check_size(t, 2, where, name, kRangeWidth);
  check_arg(t.dtype() == DType::I32 || t.dtype() == DType::I64, where, "mm_prefix_range dtype",
            "int32 or int64", t.dtype());
  std::vector<std::int64_t> values;
  if (t.dtype() == DType::I32) {
    const std::vector<std::int32_t> narrow = host_values<std::int32_t>(t);
    values.assign(narrow.begin(), narrow.end());
  } else {
    values = host_values<std::int64_t>(t);
  }
  const auto per_req = static_cast<std::size_t>(t.size(1));
  MmPrefixCsr csr;
  csr.start_loc.push_back(0);
  for (std::size_t r = 0; r < static_cast<std::size_t>(num_reqs); ++r) {
    for (std::size_t i = 0; i < per_req; ++i) {
      const std::int64_t first = values[(r * per_req + i) * kRangeWidth];
      const std::int64_t last = values[(r * per_req + i) * kRangeWidth + 1];
      if (first >= last) continue;
      check_arg(first >= 0 && last < std::numeric_limits<std::int32_t>::max(), where,
                fmt::format("mm_prefix_range[{}, {}]", r, i),
                "(first, last) with 0 <= first and last < 2^31 - 1", fmt::format("({}, {})", first, last));
      csr.ranges.push_back(static_cast<std::int32_t>(first));
      csr.ranges.push_back(static_cast<std::int32_t>(last + 1));
    }
    csr.start_loc.push_back(static_cast<std::int32_t>(csr.ranges.size() / kRangeWidth));
  }
  return csr;
}

std::string wrapper_key(const BatchAttentionOptions& o) {
  return fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|[{}]|[{}]|{}|{}", device_name(o.device), o.num_heads,
                     o.num_kv_heads, o.head_size, o.dtype, cache_dtype_name(o.kv_cache_dtype), o.block_size,
                     o.causal, o.scale.value_or(0.0f), o.sliding_window.value_or(0),
                     o.logits_soft_cap.value_or(0.0f), fmt::join(o.alibi_slopes, ","),
                     fmt::join(o.sinks, ","), o.backend, o.use_mm_prefix);
}

BatchAttention& cached_wrapper(const BatchAttentionOptions& options) {
  static std::map<std::string, std::unique_ptr<BatchAttention>> cache;
  const std::string key = wrapper_key(options);
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  auto wrapper = std::make_unique<BatchAttention>(options);
  if (cache.size() >= kMaxCachedWrappers) cache.clear();
  return *cache.emplace(key, std::move(wrapper)).first->second;
}

// Dense K/V rows [Tk, Hkv, D] as a paged cache of the largest block size that
// starts every request on a block boundary: gcd of the request starts and Tk.
struct DenseAsPaged {
  TensorView k;  // [Tk / bs, bs, Hkv, D]
  TensorView v;
  int block_size = 1;
  std::vector<std::int32_t> block_table;  // [B, stride]
  std::int64_t stride = 0;
  std::vector<std::int32_t> seq_lens;
};

TensorView rows_as_blocks(const TensorView& t, int bs) {
  return TensorView(t.data(), t.dtype(), t.device(), {t.size(0) / bs, bs, t.size(1), t.size(2)},
                    {t.stride(0) * bs, t.stride(0), t.stride(1), t.stride(2)});
}

DenseAsPaged dense_as_paged(const TensorView& k, const TensorView& v, const std::vector<std::int32_t>& cu_k,
                            std::string_view where) {
  check_rank(k, where, "k", 3);
  check_rank(v, where, "v", 3);
  const int num_reqs = static_cast<int>(cu_k.size()) - 1;
  check_arg(cu_k[0] == 0, where, "cu_seqlens_k[0]", 0, cu_k[0]);
  check_arg(cu_k.back() == k.size(0), where, "cu_seqlens_k[-1]", fmt::format("k.size(0) ({})", k.size(0)),
            cu_k.back());
  check_arg(k.size(0) > 0, where, "k.size(0)", "> 0", k.size(0));
  DenseAsPaged d;
  int bs = static_cast<int>(k.size(0));
  for (int r = 0; r < num_reqs; ++r) {
    check_arg(cu_k[r + 1] >= cu_k[r], where, fmt::format("cu_seqlens_k[{}]", r + 1),
              fmt::format(">= cu_seqlens_k[{}] ({})", r, cu_k[r]), cu_k[r + 1]);
    bs = std::gcd(bs, cu_k[r]);
  }
  d.block_size = bs;
  std::int32_t longest = 0;
  for (int r = 0; r < num_reqs; ++r) longest = std::max(longest, cu_k[r + 1] - cu_k[r]);
  d.stride = std::max<std::int64_t>((longest + bs - 1) / bs, 1);
  d.block_table.assign(static_cast<std::size_t>(num_reqs * d.stride), 0);
  for (int r = 0; r < num_reqs; ++r) {
    d.seq_lens.push_back(cu_k[r + 1] - cu_k[r]);
    const std::int32_t first = cu_k[r] / bs;
    const std::int32_t blocks = (d.seq_lens.back() + bs - 1) / bs;
    for (std::int32_t j = 0; j < blocks; ++j) d.block_table[static_cast<std::size_t>(r * d.stride + j)] = first + j;
  }
  d.k = rows_as_blocks(k, bs);
  d.v = rows_as_blocks(v, bs);
  return d;
}

}  // namespace

const std::string& last_varlen_backend() { return last_backend(); }

void varlen_attention(VarlenArgs a, std::string_view where) {
  check_rank(a.q, where, "q", 3);
  const int num_heads = static_cast<int>(a.q.size(1));
  const int head_size = static_cast<int>(a.q.size(2));
  const Device device = a.q.device();
  check_arg(a.out.defined(), where, "out", "a tensor", "undefined");
  const bool paged = a.block_table.defined();

  const std::vector<std::int32_t> cu_q = host_i32(a.cu_seqlens_q, where, "cu_seqlens_q", 1);
  check_arg(cu_q.size() >= 2, where, "cu_seqlens_q size", ">= 2", cu_q.size());
  const int num_reqs = static_cast<int>(cu_q.size()) - 1;

  BatchAttentionOptions o;
  o.num_heads = num_heads;
  o.head_size = head_size;
  o.scale = a.softmax_scale;
  o.dtype = a.q.dtype();
  o.kv_cache_dtype = a.kv_cache_dtype;
  o.device = device;
  o.causal = a.causal;
  o.backend = a.backend;

  std::vector<std::int32_t> seq_lens;
  std::vector<std::int32_t> table;
  std::int64_t stride = 0;
  TensorView key_cache;
  TensorView value_cache;
  if (paged) {
    check_arg(!a.cu_seqlens_k.defined(), where, "cu_seqlens_k", "None with block_table (pass seqused_k)",
              "a tensor");
    check_arg(a.seqused_k.defined(), where, "seqused_k", "a tensor with block_table", "None");
    seq_lens = host_i32(a.seqused_k, where, "seqused_k", 1);
    table = host_i32(a.block_table, where, "block_table", 2);
    stride = a.block_table.size(1);
    check_size(a.block_table, 0, where, "block_table", num_reqs);
    check_rank(a.k, where, "k", 4);
    check_rank(a.v, where, "v", 4);
    key_cache = a.k;
    value_cache = a.v;
    o.block_size = static_cast<int>(a.k.size(1));
  } else {
    check_arg(a.cu_seqlens_k.defined(), where, "cu_seqlens_k", "a tensor when block_table is None", "None");
    check_arg(!a.seqused_k.defined(), where, "seqused_k", "None without block_table", "a tensor");
    const std::vector<std::int32_t> cu_k = host_i32(a.cu_seqlens_k, where, "cu_seqlens_k", 1);
    check_arg(cu_k.size() == cu_q.size(), where, "cu_seqlens_k size", cu_q.size(), cu_k.size());
    DenseAsPaged d = dense_as_paged(a.k, a.v, cu_k, where);
    seq_lens = std::move(d.seq_lens);
    table = std::move(d.block_table);
    stride = d.stride;
    key_cache = d.k;
    value_cache = d.v;
    o.block_size = d.block_size;
  }
  check_arg(seq_lens.size() == static_cast<std::size_t>(num_reqs), where, "seqused_k size", num_reqs,
            seq_lens.size());
  o.num_kv_heads = static_cast<int>(key_cache.size(2));
  KVCacheView cache;
  if (kv_cache_uses_per_token_head_scales(a.kv_cache_dtype)) {
    check_arg(paged, where, "kv_quant_mode", "a per-token-head mode with paged k/v (block_table) only",
              kv_quant_mode_name(kv_quant_mode(a.kv_cache_dtype)));
    check_token_scale_half(where, "k_scale_cache", a.k_scale_cache, key_cache, a.kv_cache_dtype,
                           key_cache.device());
    check_token_scale_half(where, "v_scale_cache", a.v_scale_cache, key_cache, a.kv_cache_dtype,
                           key_cache.device());
    cache.key_scale = a.k_scale_cache;
    cache.value_scale = a.v_scale_cache;
  } else {
    check_arg(!a.k_scale_cache.defined() && !a.v_scale_cache.defined(), where,
              "k_scale_cache and v_scale_cache", "None without a per-token-head kv_quant_mode", "a tensor");
  }
  if (is_quantized_kv_cache(a.kv_cache_dtype)) {
    const DType storage = kv_cache_storage_dtype(a.kv_cache_dtype, o.dtype);
    key_cache = reinterpret(key_cache, storage, where, "k");
    value_cache = reinterpret(value_cache, storage, where, "v");
  } else {
    check_arg(!a.k_descale.defined() && !a.v_descale.defined(), where, "k_descale and v_descale",
              "None for a bf16/f16 KV cache", "a tensor");
  }

  int longest_q = 0;
  int longest_k = 0;
  for (int r = 0; r < num_reqs; ++r) {
    longest_q = std::max(longest_q, cu_q[r + 1] - cu_q[r]);
    longest_k = std::max(longest_k, seq_lens[static_cast<std::size_t>(r)]);
  }
  check_arg(a.max_seqlen_q >= longest_q, where, "max_seqlen_q", fmt::format(">= the longest query ({})", longest_q),
            a.max_seqlen_q);
  check_arg(a.max_seqlen_k >= longest_k, where, "max_seqlen_k", fmt::format(">= the longest key run ({})", longest_k),
            a.max_seqlen_k);

  check_arg(a.window_left >= -1 && a.window_right >= -1, where, "window_size", "(left, right), each >= -1",
            fmt::format("({}, {})", a.window_left, a.window_right));
  if (a.window_left >= 0) {
    if (!a.causal) {
      throw_unsupported(where, fmt::format("window_size ({}, {}) with causal=False: windows are supported on "
                                           "causal attention only",
                                           a.window_left, a.window_right));
    }
    check_arg(a.window_left < std::numeric_limits<int>::max(), where, "window_size[0]", "< 2^31 - 1", a.window_left);
    o.sliding_window = static_cast<int>(a.window_left) + 1;
  } else if (!a.causal && a.window_right >= 0) {
    throw_unsupported(where, fmt::format("window_size ({}, {}) with causal=False: windows are supported on causal "
                                         "attention only",
                                         a.window_left, a.window_right));
  }
  check_arg(a.softcap >= 0.0f, where, "softcap", ">= 0 (0 = off)", a.softcap);
  if (a.softcap > 0.0f) o.logits_soft_cap = a.softcap;
  if (a.alibi_slopes.defined()) {
    if (a.alibi_slopes.dim() != 1) {
      throw_unsupported(where, fmt::format("alibi_slopes of shape {}: pagedattn takes one slope per head, [{}]",
                                           a.alibi_slopes.shape().str(), num_heads));
    }
    if (!a.causal) {
      throw_unsupported(where, "alibi_slopes with causal=False: the ALiBi bias is defined for causal attention only");
    }
    o.alibi_slopes = host_floats(a.alibi_slopes, where, "alibi_slopes", num_heads);
  }
  o.sinks = host_floats(a.sinks, where, "sinks", num_heads);
  MmPrefixCsr mm_prefix;
  if (a.mm_prefix_range.defined()) {
    check_arg(a.causal, where, "mm_prefix_range",
              "None with causal=False (PrefixLM ranges widen a causal mask)", "a tensor");
    mm_prefix = mm_prefix_csr(a.mm_prefix_range, num_reqs, where);
    o.use_mm_prefix = true;
  }

  BatchAttention& attn = cached_wrapper(o);
  last_backend() = std::string(attn.backend().name());
  const TensorView k_scale = kv_scale(a.k_descale, where, "k_descale", o.num_kv_heads);
  const TensorView v_scale = kv_scale(a.v_descale, where, "v_descale", o.num_kv_heads);
  attn.plan(cu_q, seq_lens, table, stride, mm_prefix.start_loc, mm_prefix.ranges);
  cache.key = key_cache;
  cache.value = value_cache;
  attn.run(a.q, {}, {}, cache, a.out, a.lse, k_scale, v_scale);
}

}  // namespace pagedattn::python
