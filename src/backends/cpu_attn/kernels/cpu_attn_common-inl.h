// Per-target helpers every CPU_ATTN kernel unit shares (decode, tile loop,
// merge): element access, an item's rows and queries, tile row pointers, the
// score masks and modifiers, the fp32 online softmax, and writing results.
// Highway per-target header: included once per target by each unit's
// foreach_target pass (the toggle guard below).

#if defined(PAGEDATTN_CPU_ATTN_COMMON_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEDATTN_CPU_ATTN_COMMON_INL_H_
#undef PAGEDATTN_CPU_ATTN_COMMON_INL_H_
#else
#define PAGEDATTN_CPU_ATTN_COMMON_INL_H_
#endif

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "backends/cpu_attn/kernels/cpu_attn_dispatch.h"
#include "backends/cpu_attn/kernels/cpu_attn_kernel.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// e4m3 bits placed into an IEEE half's exponent/mantissa fields read 2^-8
// too small (half bias 15 vs e4m3 bias 7), subnormals included; the item
// multiplies the K and V scales by this once instead.
constexpr float kE4M3HalfRescale = 256.0f;
// What the half reading of the e4m3 NaN code S.1111.111 gives (1.875 * 2^0).
constexpr float kE4M3NanAsHalf = 1.875f;

constexpr float kv_load_rescale(DType kv) { return kv == DType::FP8_E4M3 ? kE4M3HalfRescale : 1.0f; }

inline float neg_inf() { return -std::numeric_limits<float>::infinity(); }

// ---- element access ----------------------------------------------------------

// Lanes(d) elements of a K/V row at `p`, converted (dequantized) to float.
template <DType KV, class D>
HWY_INLINE hn::Vec<D> load_kv(D d, const unsigned char* p) {
  if constexpr (KV == DType::F32) {
    return hn::LoadU(d, reinterpret_cast<const float*>(p));
  } else if constexpr (KV == DType::BF16) {
    const hn::Rebind<hwy::bfloat16_t, D> dbf;
    return hn::PromoteTo(d, hn::LoadU(dbf, reinterpret_cast<const hwy::bfloat16_t*>(p)));
  } else if constexpr (KV == DType::F16) {
    const hn::Rebind<hwy::float16_t, D> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
  } else if constexpr (KV == DType::I8) {
    const hn::Rebind<std::int8_t, D> di8;
    const hn::Rebind<std::int32_t, D> di32;
    return hn::ConvertTo(d, hn::PromoteTo(di32, hn::LoadU(di8, reinterpret_cast<const std::int8_t*>(p))));
  } else if constexpr (KV == DType::FP8_E5M2) {
    // e5m2 is the top byte of an IEEE half.
    const hn::Rebind<std::uint8_t, D> du8;
    const hn::Rebind<std::uint16_t, D> du16;
    const hn::Rebind<hwy::float16_t, D> dh;
    const auto half_bits = hn::ShiftLeft<8>(hn::PromoteTo(du16, hn::LoadU(du8, p)));
    return hn::PromoteTo(d, hn::BitCast(dh, half_bits));
  } else {
    static_assert(KV == DType::FP8_E4M3, "unsupported KV dtype");
    // Rebuilt as a half (exact, no float denormals: those cost microcode
    // assists on some CPUs), converted by the hardware half-to-float.
    const hn::Rebind<std::uint8_t, D> du8;
    const hn::Rebind<std::uint16_t, D> du16;
    const hn::Rebind<hwy::float16_t, D> dh;
    const auto b = hn::PromoteTo(du16, hn::LoadU(du8, p));
    const auto half_bits = hn::Or(hn::ShiftLeft<8>(hn::And(b, hn::Set(du16, std::uint16_t{0x80}))),
                                  hn::ShiftLeft<7>(hn::And(b, hn::Set(du16, std::uint16_t{0x7F}))));
    const auto value = hn::PromoteTo(d, hn::BitCast(dh, half_bits));
    const auto is_nan = hn::Eq(hn::Abs(value), hn::Set(d, kE4M3NanAsHalf));
    return hn::IfThenElse(is_nan, hn::Set(d, std::numeric_limits<float>::quiet_NaN()), value);
  }
}

inline const unsigned char* element(const void* base, std::int64_t offset, DType t) {
  return static_cast<const unsigned char*>(base) + offset * static_cast<std::int64_t>(dtype_size(t));
}

// What a KV head's K or V values (`scales`: p.k_scale or p.v_scale) are
// multiplied by: the fp8 dequantization scale times load_kv's rescale. 1 for
// per-token-head caches, whose rows the item dequantizes (dequantize_tile).
inline float dequant_scale(const AttentionParams& p, const float* scales, int kv_head) {
  if (token_scaled(p)) return 1.0f;
  const float scale = scales == nullptr ? 1.0f : scales[p.per_head_kv_scales ? kv_head : 0];
  return scale * kv_load_rescale(p.kv_dtype);
}

// ---- one work item -------------------------------------------------------------

struct ItemShape {
  int group = 0;
  int rows = 0;
  int num_keys = 0;  // keys of the request
  int q_len = 0;     // query tokens of the request
  int first_token = 0;
};

inline ItemShape item_shape(const AttentionParams& p, int request, int q_begin, int q_end) {
  ItemShape s;
  s.group = p.num_heads / p.num_kv_heads;
  s.rows = (q_end - q_begin) * s.group;
  s.first_token = p.query_start_loc[request];
  s.q_len = p.query_start_loc[request + 1] - s.first_token;
  s.num_keys = p.variant.key_source == KeySource::DenseRows ? s.q_len : p.seq_lens[request];
  return s;
}

// Visible keys of every row (docs/semantics.md masks); returns their union.
inline void fill_rows(const AttentionParams& p, const WorkItem& item, const ItemShape& shape, RowInfo* rows,
                      int& union_lo, int& union_hi) {
  const int context_len = shape.num_keys - shape.q_len;
  union_lo = shape.num_keys;
  union_hi = 0;
  for (int r = 0; r < shape.rows; ++r) {
    const int qi = item.q_begin + r / shape.group;
    const int head = item.kv_head * shape.group + r % shape.group;
    const int pos = context_len + qi;
    const auto [lo, hi] = visible_keys(p.variant, item.request, pos, shape.num_keys);
    rows[r] = RowInfo{lo, hi, static_cast<float>(pos), p.variant.alibi_slopes ? p.variant.alibi_slopes[head] : 0.0f};
    if (lo < hi) {
      union_lo = std::min(union_lo, lo);
      union_hi = std::max(union_hi, hi);
    }
  }
}

inline void load_queries(const AttentionParams& p, const WorkItem& item, const ItemShape& shape,
                         float q_scale, float* q) {
  const int d_size = p.head_size;
  for (int r = 0; r < shape.rows; ++r) {
    const int token = shape.first_token + item.q_begin + r / shape.group;
    const int head = item.kv_head * shape.group + r % shape.group;
    const unsigned char* src =
        element(p.query.data, token * p.query.row_stride + head * p.query.head_stride, p.query.dtype);
    const auto step = static_cast<std::int64_t>(dtype_size(p.query.dtype));
    for (int d = 0; d < d_size; ++d)
      q[r * d_size + d] = load_as_float(src + d * step, p.query.dtype) * q_scale;
  }
}

// Copies the bf16 query rows (unscaled) into the scratch as raw bits.
inline void load_queries_bf16(const AttentionParams& p, const WorkItem& item, const ItemShape& shape,
                              std::uint16_t* q) {
  const int d_size = p.head_size;
  for (int r = 0; r < shape.rows; ++r) {
    const int token = shape.first_token + item.q_begin + r / shape.group;
    const int head = item.kv_head * shape.group + r % shape.group;
    const unsigned char* src =
        element(p.query.data, token * p.query.row_stride + head * p.query.head_stride, DType::BF16);
    std::memcpy(q + static_cast<std::size_t>(r) * d_size, src,
                static_cast<std::size_t>(d_size) * sizeof(std::uint16_t));
  }
}

// Row pointers of keys/values [t0, t0 + n) of one KV head.
inline void tile_pointers(const AttentionParams& p, const WorkItem& item, const ItemShape& shape, int t0,
                          int n, const unsigned char** k_rows, const unsigned char** v_rows) {
  if (p.variant.key_source == KeySource::DenseRows) {
    for (int i = 0; i < n; ++i) {
      const std::int64_t row = shape.first_token + t0 + i;
      k_rows[i] = element(p.key.data, row * p.key.row_stride + item.kv_head * p.key.head_stride, p.kv_dtype);
      v_rows[i] =
          element(p.value.data, row * p.value.row_stride + item.kv_head * p.value.head_stride, p.kv_dtype);
    }
    return;
  }
  const std::int32_t* table = p.block_table + item.request * p.block_table_row_stride;
  const CacheOperand& kc = p.key_cache;
  const CacheOperand& vc = p.value_cache;
  // Walk the tile block by block: one table lookup per block, not per key.
  int i = 0;
  while (i < n) {
    const int j = t0 + i;
    const std::int64_t block = table[j / p.block_size];
    const int first_slot = j % p.block_size;
    const int run = std::min(n - i, p.block_size - first_slot);
    const unsigned char* k_row = element(
        kc.data, block * kc.block_stride + first_slot * kc.slot_stride + item.kv_head * kc.head_stride,
        p.kv_dtype);
    const unsigned char* v_row = element(
        vc.data, block * vc.block_stride + first_slot * vc.slot_stride + item.kv_head * vc.head_stride,
        p.kv_dtype);
    const std::int64_t k_step = kc.slot_stride * static_cast<std::int64_t>(dtype_size(p.kv_dtype));
    const std::int64_t v_step = vc.slot_stride * static_cast<std::int64_t>(dtype_size(p.kv_dtype));
    for (int s = 0; s < run; ++s, ++i) {
      k_rows[i] = k_row + s * k_step;
      v_rows[i] = v_row + s * v_step;
    }
  }
}

// dequantize_tile for the cache's element type KV.
template <DType KV, class D>
void dequantize_tile_as(D d, const AttentionParams& p, int request, int kv_head, int t0, int n,
                        const unsigned char* const* k_rows, const unsigned char* const* v_rows,
                        const Scratch& sc, const unsigned char** k_out, const unsigned char** v_out) {
  const int d_size = p.head_size;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const std::int32_t* table = p.block_table + request * p.block_table_row_stride;
  const ScaleOperand& ks = p.k_token_scale;
  const ScaleOperand& vs = p.v_token_scale;
  auto* k_dst = reinterpret_cast<float*>(sc.ks);
  for (int i = 0; i < n; ++i) {
    const int j = t0 + i;
    const std::int64_t block = table[j / p.block_size];
    const std::int64_t slot = j % p.block_size;
    // load_kv's reading of e4m3 is 2^-8 times the value: the rescale folds
    // into the scale exactly, so each element is value * scale rounded once.
    const auto k_scale =
        hn::Set(d, ks.data[block * ks.block_stride + slot * ks.slot_stride + kv_head * ks.head_stride] *
                       kv_load_rescale(KV));
    const auto v_scale =
        hn::Set(d, vs.data[block * vs.block_stride + slot * vs.slot_stride + kv_head * vs.head_stride] *
                       kv_load_rescale(KV));
    float* k_row = k_dst + static_cast<std::size_t>(i) * d_size;
    float* v_row = sc.vf + static_cast<std::size_t>(i) * d_size;
    for (int c = 0; c < d_size; c += lanes) {
      hn::Store(hn::Mul(load_kv<KV>(d, k_rows[i] + c), k_scale), d, k_row + c);
      hn::Store(hn::Mul(load_kv<KV>(d, v_rows[i] + c), v_scale), d, v_row + c);
    }
    k_out[i] = reinterpret_cast<const unsigned char*>(k_row);
    v_out[i] = reinterpret_cast<const unsigned char*>(v_row);
  }
}

// Per-token-head caches: the K and V rows of keys [t0, t0 + n) of one KV head
// of a request (k_rows, v_rows: tile_pointers), converted to f32 times each
// key's scale into sc.ks and sc.vf (the converted V tile a P V step reads);
// k_out / v_out point at them. The item's kernels then read f32 rows
// (choose_kernel_variant picks f32 ones).
template <class D>
void dequantize_tile(D d, const AttentionParams& p, int request, int kv_head, int t0, int n,
                     const unsigned char* const* k_rows, const unsigned char* const* v_rows,
                     const Scratch& sc, const unsigned char** k_out, const unsigned char** v_out) {
  if (p.kv_dtype == DType::I8) {
    return dequantize_tile_as<DType::I8>(d, p, request, kv_head, t0, n, k_rows, v_rows, sc, k_out, v_out);
  }
  dequantize_tile_as<DType::FP8_E4M3>(d, p, request, kv_head, t0, n, k_rows, v_rows, sc, k_out, v_out);
}

// __builtin_prefetch locality hints.
constexpr int kKeepInL1 = 3;
constexpr int kKeepInL2 = 2;
constexpr int kCacheLine = 64;

// Prefetches the first `lines` cache lines of a row.
template <int kLocality>
HWY_INLINE void prefetch_lines(const unsigned char* row, int lines) {
  constexpr int kReadOnly = 0;
  for (int line = 0; line < lines; ++line) __builtin_prefetch(row + line * kCacheLine, kReadOnly, kLocality);
}

inline int cache_lines(std::size_t bytes) { return static_cast<int>((bytes + kCacheLine - 1) / kCacheLine); }

template <int kLocality>
void prefetch_rows(const unsigned char* const* rows, int n, std::size_t row_bytes) {
  for (int i = 0; i < n; ++i) prefetch_lines<kLocality>(rows[i], cache_lines(row_bytes));
}

// The score modifiers of the params (soft cap, then ALiBi), vector by vector.
template <class D>
struct ScoreModifiers {
  bool soft_cap;
  bool alibi;
  hn::Vec<D> cap;
  hn::Vec<D> inv_cap;

  ScoreModifiers(D d, const AttentionParams& p)
      : soft_cap(p.variant.soft_cap > 0.0f),
        alibi(p.variant.alibi_slopes != nullptr),
        cap(hn::Set(d, p.variant.soft_cap)),
        inv_cap(hn::Set(d, soft_cap ? 1.0f / p.variant.soft_cap : 0.0f)) {}

  bool any() const { return soft_cap || alibi; }
};

// The rows' visible keys [lo, hi) and ALiBi terms, per lane (the four-row
// softmaxes put several rows in one vector; softmax_tile repeats one row).
template <class D>
struct LaneRows {
  hn::Vec<hn::RebindToSigned<D>> lo_minus_one;
  hn::Vec<hn::RebindToSigned<D>> hi;
  hn::Vec<D> slope;
  hn::Vec<D> position;
};

// The end of a row's visible keys in the tile [t0, t0 + n), and whether the
// row sees all kTileKeys keys of it (then no key needs a mask).
inline int visible_end(const RowInfo& info, int t0, int n) { return std::min(info.hi, t0 + n); }
inline bool sees_whole_tile(const RowInfo& info, int t0, int n) {
  return info.lo <= t0 && visible_end(info, t0, n) >= t0 + kTileKeys;
}

// Soft cap, then ALiBi, then the visible interval on scores sv of keys j
// (per lane): keys a row does not see become -inf, and `nan` gains the lanes
// whose visible score was NaN before the modifiers. Every softmax of the
// kernel masks through this.
template <class D>
HWY_INLINE hn::Vec<D> mask_scores(D d, const ScoreModifiers<D>& modifiers, const LaneRows<D>& rows,
                                  hn::Vec<D> sv, hn::Vec<hn::RebindToSigned<D>> j, hn::Mask<D>& nan) {
  const auto raw_nan = hn::IsNaN(sv);
  if (modifiers.soft_cap) {
    // Highway's Tanh converts to int inside (Expm1), which is undefined for a
    // NaN lane: that lane takes the Tanh of 0 and keeps its NaN.
    const auto capped =
        hn::Mul(modifiers.cap, hn::Tanh(d, hn::Mul(hn::IfThenZeroElse(raw_nan, sv), modifiers.inv_cap)));
    sv = hn::IfThenElse(raw_nan, sv, capped);
  }
  if (modifiers.alibi) sv = hn::MulAdd(rows.slope, hn::Sub(hn::ConvertTo(d, j), rows.position), sv);
  const auto visible = hn::RebindMask(d, hn::And(hn::Gt(j, rows.lo_minus_one), hn::Lt(j, rows.hi)));
  nan = hn::Or(nan, hn::And(raw_nan, visible));
  return hn::IfThenElse(visible, sv, hn::Set(d, neg_inf()));
}

// Soft cap, ALiBi and masks on the score tile, then the online-softmax update:
// S becomes P = exp(S - m_new) (times prob_scale, kChunkRescale; l sums the
// unscaled P), alpha = exp(m_old - m_new).
template <class D>
void softmax_tile(D d, const AttentionParams& p, const Scratch& sc, int rows, int t0, int n,
                  float prob_scale = 1.0f) {
  const hn::RebindToSigned<D> di;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const ScoreModifiers<D> modifiers(d, p);
  const auto minus_inf = hn::Set(d, neg_inf());
  for (int r = 0; r < rows; ++r) {
    const RowInfo& info = sc.rows[r];
    float* srow = sc.s + r * kTileKeys;
    const int lo = info.lo;
    const int hi = visible_end(info, t0, n);
    if (lo >= hi || hi <= t0 || lo >= t0 + n) {
      sc.alpha[r] = 1.0f;
      for (int i = 0; i < kTileKeys; ++i) srow[i] = 0.0f;
      continue;
    }
    auto vmax = minus_inf;
    const LaneRows<D> lane_rows{hn::Set(di, lo - 1), hn::Set(di, hi), hn::Set(d, info.slope),
                                hn::Set(d, info.position)};
    // A tile the row sees whole (most tiles of a long row) needs no mask.
    const bool whole = sees_whole_tile(info, t0, n);
    auto nan = hn::FirstN(d, 0);  // a visible score is NaN
    for (int i = 0; i < kTileKeys; i += lanes) {
      auto sv = hn::Load(d, srow + i);
      if (whole && !modifiers.any()) {
        vmax = hn::Max(vmax, sv);
        nan = hn::Or(nan, hn::IsNaN(sv));
        continue;
      }
      sv = mask_scores(d, modifiers, lane_rows, sv, hn::Iota(di, t0 + i), nan);
      hn::Store(sv, d, srow + i);
      vmax = hn::Max(vmax, sv);
    }
    const float m_old = sc.m[r];
    const float m_new = std::max(m_old, hn::GetLane(hn::MaxOfLanes(d, vmax)));
    const auto vm = hn::Set(d, m_new);
    auto vsum = hn::Zero(d);
    const auto vscale = hn::Set(d, prob_scale);
    for (int i = 0; i < kTileKeys; i += lanes) {
      const auto pv = hn::Exp(d, hn::Sub(hn::Load(d, srow + i), vm));  // exp(-inf) = 0 for masked keys
      hn::Store(hn::Mul(pv, vscale), d, srow + i);
      vsum = hn::Add(vsum, pv);
    }
    // Exp clamps its argument, which turns a NaN score into P = 0: a NaN alpha
    // makes the row's accumulator and sum NaN instead, as the oracle's are.
    const float alpha = !hn::AllFalse(d, nan) ? std::numeric_limits<float>::quiet_NaN()
                        : m_old == neg_inf()  ? 0.0f
                                              : std::exp(m_old - m_new);
    sc.alpha[r] = alpha;
    sc.l[r] = sc.l[r] * alpha + hn::GetLane(hn::SumOfLanes(d, vsum));
    sc.m[r] = m_new;
  }
}

// The register accumulators of a P V pass: rows r0 .. r0 + kR of sc.acc (a[r]),
// kV vectors from element c0, rescaled by the rows' alpha on the way in.
template <int kR, int kV, class D>
HWY_INLINE void load_rescaled(D d, const Scratch& sc, int r0, float* const (&a)[kR], int c0,
                              hn::Vec<D> (&acc)[kR][kV]) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  for (int r = 0; r < kR; ++r) {
    const auto alpha = hn::Set(d, sc.alpha[r0 + r]);
    for (int v = 0; v < kV; ++v) acc[r][v] = hn::Mul(hn::Load(d, a[r] + c0 + v * lanes), alpha);
  }
}

template <int kR, int kV, class D>
HWY_INLINE void store_accumulators(D d, float* const (&a)[kR], int c0, const hn::Vec<D> (&acc)[kR][kV]) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  for (int r = 0; r < kR; ++r) {
    for (int v = 0; v < kV; ++v) hn::Store(acc[r][v], d, a[r] + c0 + v * lanes);
  }
}

// out[e] = acc[e] * factor (zeros when acc is null) for e < n, stored as
// `out_dtype`: a DType, or a std::integral_constant of one. A constant dtype
// lets the compiler vectorize the conversion, which a per-element dtype switch
// kept scalar (~10% of a 256-key decode item, docs/cpu_attn.md).
template <class OutDType>
void store_row_as(OutDType out_dtype, unsigned char* out, const float* acc, float factor, int n) {
  const auto step = static_cast<std::int64_t>(dtype_size(out_dtype));
  for (int e = 0; e < n; ++e)
    store_from_float(out + e * step, out_dtype, acc == nullptr ? 0.0f : acc[e] * factor);
}

template <DType kOut>
using OutDTypeConstant = std::integral_constant<DType, kOut>;

inline void store_output_row(DType out_dtype, unsigned char* out, const float* acc, float factor, int n) {
  switch (out_dtype) {
    case DType::F32:
      return store_row_as(OutDTypeConstant<DType::F32>{}, out, acc, factor, n);
    case DType::F16:
      return store_row_as(OutDTypeConstant<DType::F16>{}, out, acc, factor, n);
    case DType::BF16:
      return store_row_as(OutDTypeConstant<DType::BF16>{}, out, acc, factor, n);
    default:
      return store_row_as(out_dtype, out, acc, factor, n);
  }
}

// Writes one finished row: output in the query dtype, LSE; sink and v_scale applied.
inline void finish_row(const AttentionParams& p, int token, int head, float m, float l, const float* acc,
                       float v_scale) {
  const int d_size = p.head_size;
  const DType out_dtype = p.query.dtype;
  auto* out =
      static_cast<unsigned char*>(p.output) + (token * p.output_row_stride + head * p.output_head_stride) *
                                                  static_cast<std::int64_t>(dtype_size(out_dtype));
  float* lse = p.lse == nullptr ? nullptr : p.lse + head * p.lse_head_stride + token * p.lse_token_stride;
  // No visible key: zeros, LSE -inf (also with a sink). A row whose every
  // visible score was NaN can end with m = -inf too (a max may drop NaN), but
  // its sum is NaN (the softmaxes give it a NaN alpha): it comes out NaN.
  if (m == neg_inf() && !std::isnan(l)) {
    store_output_row(out_dtype, out, nullptr, 0.0f, d_size);
    if (lse != nullptr) *lse = neg_inf();
    return;
  }
  if (p.variant.sinks != nullptr) {
    const float sink = p.variant.sinks[head];
    const float m_all = std::max(m, sink);
    l = l * std::exp(m - m_all) + std::exp(sink - m_all);
    v_scale *= std::exp(m - m_all);
    m = m_all;
  }
  store_output_row(out_dtype, out, acc, v_scale / l, d_size);
  if (lse != nullptr) *lse = m + std::log(l);
}

// Whether K comes from a packed cache (kv_packing.h).
inline bool keys_packed(const AttentionParams& p) {
  return p.variant.key_source == KeySource::PagedCache && p.key_cache.packing != KeyPacking::None;
}

// Copies the K rows of keys [t0, t0 + n) of a Keys16-packed cache (k_rows:
// their row-major positions, tile_pointers) into out in row order, each
// dimension pair at once, and points staged[i] at row i: the paths that read
// rows (prefill, the chunked decode, e4m3 tiles not starting a group) read these.
template <DType KV>
void unpack_key_rows(const AttentionParams& p, int t0, int n, const unsigned char* const* k_rows,
                     unsigned char* out, const unsigned char** staged) {
  constexpr std::size_t kPairBytes = 2 * dtype_size(KV);
  const int d_size = p.head_size;
  const std::size_t row_bytes = static_cast<std::size_t>(d_size) * dtype_size(KV);
  for (int i = 0; i < n; ++i) {
    const int t = (t0 + i) % p.block_size % kPackedKeyGroup;
    const unsigned char* group = k_rows[i] - static_cast<std::size_t>(t) * row_bytes;
    unsigned char* dst = out + static_cast<std::size_t>(i) * row_bytes;
    for (int d = 0; d < d_size; d += 2) {
      std::memcpy(dst + d * dtype_size(KV), group + packed_key_group_offset(t, d) * dtype_size(KV),
                  kPairBytes);
    }
    staged[i] = dst;
  }
}

// The item restricted to its KV head number h.
inline WorkItem head_of(const WorkItem& item, int h) {
  WorkItem one = item;
  one.kv_head = item.kv_head + h;
  one.kv_heads = 1;
  if (item.partial_token >= 0) one.partial_token = item.partial_token + h * item.partial_head_stride;
  return one;
}

// A single-head item's rows, the keys [lo, hi) it reads and its zeroed
// online-softmax state.
inline void begin_head(const AttentionParams& p, const WorkItem& one, const ItemShape& shape,
                       const Scratch& sc, int& lo, int& hi) {
  fill_rows(p, one, shape, sc.rows, lo, hi);
  lo = std::max(lo, one.k_begin);
  hi = std::min(hi, one.k_end);
  std::fill(sc.acc, sc.acc + static_cast<std::size_t>(shape.rows) * p.head_size, 0.0f);
  std::fill(sc.m, sc.m + shape.rows, neg_inf());
  std::fill(sc.l, sc.l + shape.rows, 0.0f);
}

// Writes a single-head item's result: its split partial, or its output rows.
inline void end_head(const AttentionParams& p, const WorkItem& one, const ItemShape& shape, const Scratch& sc,
                     const PartialState& partials) {
  const int d_size = p.head_size;
  if (one.partial_token >= 0) {
    const std::size_t row_floats = partial_row_floats(d_size);
    float* base = partials.data + static_cast<std::size_t>(one.partial_token) * shape.group * row_floats;
    for (int r = 0; r < shape.rows; ++r) {
      float* dst = base + static_cast<std::size_t>(r) * row_floats;
      std::copy(sc.acc + r * d_size, sc.acc + (r + 1) * d_size, dst);
      dst[d_size] = sc.m[r];
      dst[d_size + 1] = sc.l[r];
    }
    return;
  }
  const float v_scale = dequant_scale(p, p.v_scale, one.kv_head);
  for (int r = 0; r < shape.rows; ++r) {
    const int token = shape.first_token + one.q_begin + r / shape.group;
    const int head = one.kv_head * shape.group + r % shape.group;
    finish_row(p, token, head, sc.m[r], sc.l[r], sc.acc + r * d_size, v_scale);
  }
}

// Calls f(d, kv) with the variant's vector width as the descriptor d and its
// KV dtype as kv, a std::integral_constant: one instantiation per pair.
template <class F>
void with_variant_types(const KernelVariant& variant, F&& f) {
  const auto with_kv = [&](auto d) {
    switch (variant.kv_dtype) {
      case DType::F32:
        return f(d, std::integral_constant<DType, DType::F32>{});
      case DType::F16:
        return f(d, std::integral_constant<DType, DType::F16>{});
      case DType::BF16:
        return f(d, std::integral_constant<DType, DType::BF16>{});
      case DType::FP8_E4M3:
        return f(d, std::integral_constant<DType, DType::FP8_E4M3>{});
      case DType::FP8_E5M2:
        return f(d, std::integral_constant<DType, DType::FP8_E5M2>{});
      default:
        return;  // the backend admits no other KV dtype
    }
  };
  if (variant.width == VectorWidth::kFull) return with_kv(hn::ScalableTag<float>());
  with_kv(hn::CappedTag<float, kMinHeadSizeMultiple>());
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // PAGEDATTN_CPU_ATTN_COMMON_INL_H_
