#include "reference_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace pagedattn::reference {

namespace {

// Scratch layout per row: the query, one key/value row, the output
// accumulator (head_size doubles each), then one score per visible key.
constexpr std::size_t kRowBuffers = 3;

const std::byte* at(const void* base, std::int64_t elements, DType t) {
  return static_cast<const std::byte*>(base) + elements * static_cast<std::int64_t>(dtype_size(t));
}

// Converts n contiguous elements to doubles, times `scale`.
void load_row(const std::byte* p, DType t, int n, double scale, double* dst) {
  const auto step = static_cast<std::int64_t>(dtype_size(t));
  for (int d = 0; d < n; ++d) dst[d] = static_cast<double>(load_as_float(p + d * step, t)) * scale;
}

int request_keys(const ReferenceAttentionParams& p, int r) {
  if (p.variant.key_source == KeySource::DenseRows) return p.query_start_loc[r + 1] - p.query_start_loc[r];
  return p.seq_lens[r];
}

struct RowContext {
  int request = 0;
  int kv_head = 0;
  int first_row = 0;  // row of key 0 for DenseRows
};

const std::byte* key_or_value_row(const ReferenceAttentionParams& p, const RowContext& row, int j,
                                  bool value) {
  if (p.variant.key_source == KeySource::DenseRows) {
    const RowsOperand& op = value ? p.value : p.key;
    return at(op.data, (row.first_row + j) * op.row_stride + row.kv_head * op.head_stride, op.dtype);
  }
  const CacheOperand& c = value ? p.value_cache : p.key_cache;
  const std::int64_t block = p.block_table[row.request * p.block_table_row_stride + j / p.block_size];
  const std::int64_t slot = j % p.block_size;
  return at(c.data, block * c.block_stride + slot * c.slot_stride + row.kv_head * c.head_stride,
            p.cache_dtype);
}

// Key j as doubles times `scale`, read in the cache's K packing.
void load_key_row(const ReferenceAttentionParams& p, const RowContext& row, int j, double scale, double* dst) {
  const std::byte* start = key_or_value_row(p, row, j, false);
  if (p.variant.key_source == KeySource::DenseRows || p.key_cache.packing == KeyPacking::None) {
    load_row(start, p.variant.key_source == KeySource::DenseRows ? p.key.dtype : p.cache_dtype, p.head_size,
             scale, dst);
    return;
  }
  const int slot = j % p.block_size;
  const std::int64_t row_major_start = key_offset_in_block(KeyPacking::None, slot, 0, p.head_size);
  for (int d = 0; d < p.head_size; ++d) {
    const std::int64_t offset = key_offset_in_block(p.key_cache.packing, slot, d, p.head_size) - row_major_start;
    dst[d] = static_cast<double>(load_as_float(at(start, offset, p.cache_dtype), p.cache_dtype)) * scale;
  }
}

double kv_scale(const ReferenceAttentionParams& p, const float* scales, int kv_head) {
  if (scales == nullptr) return 1.0;
  return static_cast<double>(scales[p.num_kv_scales == 1 ? 0 : kv_head]);
}

// The dequantization scale of key j: the per-tensor or per-head one, times
// the key's own scale in a per-token-head cache.
double key_scale(const ReferenceAttentionParams& p, const ScaleOperand& token, double tensor_scale,
                 const RowContext& row, int j) {
  if (token.data == nullptr) return tensor_scale;
  const std::int64_t block = p.block_table[row.request * p.block_table_row_stride + j / p.block_size];
  const std::int64_t slot = j % p.block_size;
  return tensor_scale * static_cast<double>(token.data[block * token.block_stride + slot * token.slot_stride +
                                                       row.kv_head * token.head_stride]);
}

// One (token, head) row: scores, softmax (with the sink in the denominator) and
// the weighted sum of values, all in double.
void attend_row(const ReferenceAttentionParams& p, const RowContext& row, int head, int token, int position,
                int num_keys, double* scratch) {
  const int d_size = p.head_size;
  double* q = scratch;
  double* kv = q + d_size;
  double* acc = kv + d_size;
  double* scores = acc + d_size;

  // Visible keys form one interval [lo, hi) (docs/semantics.md).
  const AttentionVariant& v = p.variant;
  const KeyInterval keys = visible_keys(v, row.request, position, num_keys);
  const int lo = keys.lo;
  const int hi = keys.hi;

  void* out =
      static_cast<std::byte*>(p.output) + (token * p.output_row_stride + head * p.output_head_stride) *
                                              static_cast<std::int64_t>(dtype_size(p.output_dtype));
  const auto out_step = static_cast<std::int64_t>(dtype_size(p.output_dtype));
  float* lse = p.lse == nullptr ? nullptr : p.lse + head * p.lse_head_stride + token * p.lse_token_stride;
  if (lo >= hi) {
    for (int d = 0; d < d_size; ++d)
      store_from_float(static_cast<std::byte*>(out) + d * out_step, p.output_dtype, 0.0f);
    if (lse != nullptr) *lse = -std::numeric_limits<float>::infinity();
    return;
  }

  load_row(at(p.query.data, token * p.query.row_stride + head * p.query.head_stride, p.query.dtype),
           p.query.dtype, d_size, 1.0, q);
  const double k_scale = kv_scale(p, p.k_scale, row.kv_head);
  const double slope = v.alibi_slopes == nullptr ? 0.0 : static_cast<double>(v.alibi_slopes[head]);
  const auto scale = static_cast<double>(v.scale);
  const auto soft_cap = static_cast<double>(v.soft_cap);
  double max_score = -std::numeric_limits<double>::infinity();
  for (int j = lo; j < hi; ++j) {
    load_key_row(p, row, j, key_scale(p, p.k_token_scale, k_scale, row, j), kv);
    double dot = 0.0;
    for (int d = 0; d < d_size; ++d) dot += q[d] * kv[d];
    double s = scale * dot;
    if (soft_cap > 0.0) s = soft_cap * std::tanh(s / soft_cap);
    s += slope * static_cast<double>(j - position);
    scores[j - lo] = s;
    max_score = std::max(max_score, s);
  }
  const bool has_sink = v.sinks != nullptr;
  const double sink = has_sink ? static_cast<double>(v.sinks[head]) : 0.0;
  if (has_sink) max_score = std::max(max_score, sink);

  double denom = has_sink ? std::exp(sink - max_score) : 0.0;
  std::fill(acc, acc + d_size, 0.0);
  const double v_scale = kv_scale(p, p.v_scale, row.kv_head);
  for (int j = lo; j < hi; ++j) {
    const double w = std::exp(scores[j - lo] - max_score);
    denom += w;
    load_row(key_or_value_row(p, row, j, true),
             p.variant.key_source == KeySource::DenseRows ? p.value.dtype : p.cache_dtype, d_size,
             key_scale(p, p.v_token_scale, v_scale, row, j), kv);
    for (int d = 0; d < d_size; ++d) acc[d] += w * kv[d];
  }
  for (int d = 0; d < d_size; ++d) {
    store_from_float(static_cast<std::byte*>(out) + d * out_step, p.output_dtype,
                     static_cast<float>(acc[d] / denom));
  }
  // With a sink the LSE is that of the full denominator, sink term included.
  if (lse != nullptr) *lse = static_cast<float>(max_score + std::log(denom));
}

}  // namespace

const char* reference_status_name(ReferenceStatus status) {
  switch (status) {
    case ReferenceStatus::Ok:
      return "ok";
    case ReferenceStatus::ScratchTooSmall:
      return "scratch buffer too small";
  }
  return "unknown status";
}

std::size_t reference_attention_scratch_len(int head_size, int max_keys) {
  return kRowBuffers * static_cast<std::size_t>(head_size) + static_cast<std::size_t>(max_keys);
}

std::size_t reference_attention_scratch_len(const ReferenceAttentionParams& params) {
  int max_keys = 0;
  for (int r = 0; r < params.num_reqs; ++r) max_keys = std::max(max_keys, request_keys(params, r));
  return reference_attention_scratch_len(params.head_size, max_keys);
}

ReferenceStatus reference_attention(const ReferenceAttentionParams& params) {
  if (params.scratch_len < reference_attention_scratch_len(params)) return ReferenceStatus::ScratchTooSmall;
  const int group = params.num_heads / params.num_kv_heads;
  for (int r = 0; r < params.num_reqs; ++r) {
    const int first = params.query_start_loc[r];
    const int q_len = params.query_start_loc[r + 1] - first;
    const int num_keys = request_keys(params, r);
    const int context_len = num_keys - q_len;
    for (int i = 0; i < q_len; ++i) {
      const int token = first + i;
      if (token >= params.num_actual_tokens) break;
      for (int h = 0; h < params.num_heads; ++h) {
        const RowContext row{r, h / group, first};
        attend_row(params, row, h, token, context_len + i, num_keys, params.scratch);
      }
    }
  }
  return ReferenceStatus::Ok;
}

}  // namespace pagedattn::reference
