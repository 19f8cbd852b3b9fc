// AVX2's four-row decode tile (DecodeTiles::kChunkQuads): scores for four
// query rows of one KV head, the online softmax on key-major vectors, and P V
// from the same tile. Highway per-target header; only the AVX2 pass compiles
// anything.
#if defined(PAGEDATTN_CPU_ATTN_DECODE_TILES_AVX2_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEDATTN_CPU_ATTN_DECODE_TILES_AVX2_INL_H_
#undef PAGEDATTN_CPU_ATTN_DECODE_TILES_AVX2_INL_H_
#else
#define PAGEDATTN_CPU_ATTN_DECODE_TILES_AVX2_INL_H_
#endif

#include <hwy/highway.h>

#include "backends/cpu_attn/kernels/cpu_attn_decode_tiles-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
#if HWY_TARGET == HWY_AVX2

// For items whose rows come in blocks of four (GQA groups of 4, 8, ...): the
// scores of a pass (four rows x three keys) are reduced by transposing adds
// and stored key-major, st[key][row], so the online softmax of the four rows
// runs on full vectors (two keys of all four rows each) with no per-row
// horizontal work, and P V broadcasts from the same tile (docs/cpu_attn.md).

// Lane k of the result is the sum of a[k]'s lanes.
HWY_INLINE __m256 sum_lanes8(const __m256 (&a)[8]) {
  // Per 128-bit half, hadd(hadd(a0, a1), hadd(a2, a3)) holds the partial sums
  // of a0..a3 over that half's lanes.
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  constexpr int kLowHalves = 0x20;
  constexpr int kHighHalves = 0x31;
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, kLowHalves),
                       _mm256_permute2f128_ps(s0123, s4567, kHighHalves));
}

// v with its two 128-bit halves swapped: lane l of a key-major score vector
// meets the same row's other key.
HWY_INLINE __m256 swap_halves(__m256 v) { return _mm256_permute2f128_ps(v, v, 1); }

// Float vectors a step of scores_quad reads per key: one 4-way e4m3 block,
// else one chunk (two vectors).
template <DType KV>
constexpr int kStepVectors = std::max(2, kChunkWays<KV>);

// Vector kV (0 .. kStepVectors - 1) of the step at element c of a row of
// d_size, one at a time (for the register budget of scores_quad, which keeps
// its odd bf16 halves off the mask register: bf16_odds_shifted): the e4m3
// block's byte kV, or half kV of the chunk.
template <DType KV, bool kNanFree, int kV, class D>
HWY_INLINE hn::Vec<D> load_step_vector(D d, const unsigned char* row, int c, [[maybe_unused]] int d_size) {
  const unsigned char* p = row + static_cast<std::size_t>(c) * dtype_size(KV);
  const int lanes = static_cast<int>(hn::Lanes(d));
  if constexpr (kChunkWays<KV> == 4) {
    return e4m3_byte<kV, kNanFree>(d, load_e4m3_block(d, row, c));
  } else if constexpr (kChunkWays<KV> == 2) {
    if constexpr (kV == 0) return bf16_evens(d, p, c == 0);
    return bf16_odds_shifted(d, p, c + 2 * lanes == d_size);
  } else if constexpr (KV == DType::FP8_E4M3 && kNanFree) {
    return load_e4m3_nan_free(d, p + kV * lanes);
  } else {
    return load_kv<KV>(d, p + kV * lanes * dtype_size(KV));
  }
}

// Calls f(std::integral_constant<int, k>) for k = 0 .. sizeof...(kIndex) - 1
// (compile-time indices for an unrolled loop).
template <class F, int... kIndex>
HWY_INLINE void for_each_index(std::integer_sequence<int, kIndex...>, F&& f) {
  (f(std::integral_constant<int, kIndex>{}), ...);
}

// st[i][r] = q_{r0 + r} . k_i for i < n, three keys x four rows per pass (12
// accumulators, one query vector and three key vectors live: AVX2's 16
// registers, each query load feeding three FMAs). The last pass repeats key
// n - 1 in up to two columns from n on (the next block's scores, or
// kScorePadFloats, take those past the tile), which the softmax masks.
template <DType KV, bool kNanFree, class D>
void scores_quad(D d, const Scratch& sc, int r0, int d_size, int n, const unsigned char* const* k_rows,
                 float* st, const TilePrefetch* ahead) {
  constexpr int kKeys = 3;
  static_assert(((kTileKeys + kKeys - 1) / kKeys * kKeys - kTileKeys) * kRowBlock <= kScorePadFloats,
                "the last block's last pass writes into the score tile's padding");
  const int lanes = static_cast<int>(hn::Lanes(d));
  const float* q[kRowBlock];
  for (int r = 0; r < kRowBlock; ++r) q[r] = sc.q + (r0 + r) * d_size;
  for (int i0 = 0; i0 < n; i0 += kKeys) {
    const unsigned char* k[kKeys];
    for (int j = 0; j < kKeys; ++j) k[j] = k_rows[std::min(i0 + j, n - 1)];
    prefetch_ahead(ahead, i0, kKeys);
    hn::Vec<D> acc[kKeys][kRowBlock];
    for (auto& key : acc) {
      for (auto& a : key) a = hn::Zero(d);
    }
    for (int c = 0; c < d_size; c += kStepVectors<KV> * lanes) {
      for_each_index(std::make_integer_sequence<int, kStepVectors<KV>>{}, [&](auto v) {
        hn::Vec<D> kv[kKeys];
        for (int j = 0; j < kKeys; ++j) kv[j] = load_step_vector<KV, kNanFree, v()>(d, k[j], c, d_size);
        for (int r = 0; r < kRowBlock; ++r) {
          const auto qv = hn::LoadU(d, q[r] + c + v() * lanes);
          for (int j = 0; j < kKeys; ++j) acc[j][r] = hn::MulAdd(qv, kv[j], acc[j][r]);
        }
      });
    }
    const __m256 first_two[2 * kRowBlock] = {acc[0][0].raw, acc[0][1].raw, acc[0][2].raw, acc[0][3].raw,
                                             acc[1][0].raw, acc[1][1].raw, acc[1][2].raw, acc[1][3].raw};
    const __m256 sums01 = sum_lanes8(first_two);
    const __m128 sums2 = sum_lanes4(acc[2][0].raw, acc[2][1].raw, acc[2][2].raw, acc[2][3].raw);
    _mm256_storeu_ps(st + i0 * kRowBlock, _mm256_mul_ps(sums01, _mm256_set1_ps(kChunkRescale<KV>)));
    _mm_storeu_ps(st + (i0 + 2) * kRowBlock, _mm_mul_ps(sums2, _mm_set1_ps(kChunkRescale<KV>)));
  }
}

// softmax_tile for four rows whose scores are key-major in st: lane l of a
// vector is row r0 + l % 4 at key 2 v + l / 4. Rows with no visible key in
// the tile keep m and l (alpha 1) and get P = 0.
template <class D>
void softmax_quad(D d, const AttentionParams& p, const Scratch& sc, int r0, int t0, int n, float* st,
                  float prob_scale) {
  const hn::RebindToSigned<D> di;
  constexpr int kLanes = 2 * kRowBlock;
  alignas(32) std::int32_t lo_minus_one[kLanes];
  alignas(32) std::int32_t hi[kLanes];
  alignas(32) float slope[kLanes];
  alignas(32) float pos[kLanes];
  alignas(32) float m_old[kLanes];
  alignas(32) float l_old[kLanes];
  alignas(32) std::int32_t key_of_lane[kLanes];
  bool whole = true;
  for (int lane = 0; lane < kLanes; ++lane) {
    const int r = r0 + lane % kRowBlock;
    const RowInfo& info = sc.rows[r];
    lo_minus_one[lane] = info.lo - 1;
    hi[lane] = visible_end(info, t0, n);
    slope[lane] = info.slope;
    pos[lane] = info.position;
    m_old[lane] = sc.m[r];
    l_old[lane] = sc.l[r];
    key_of_lane[lane] = t0 + lane / kRowBlock;
    whole = whole && sees_whole_tile(info, t0, n);
  }
  const ScoreModifiers<D> modifiers(d, p);
  const auto minus_inf = hn::Set(d, neg_inf());
  const LaneRows<D> lane_rows{hn::Load(di, lo_minus_one), hn::Load(di, hi), hn::Load(d, slope),
                              hn::Load(d, pos)};
  const auto key_step = hn::Set(di, 2);
  auto j = hn::Load(di, key_of_lane);
  const int vectors = (n + 1) / 2;
  auto vmax = minus_inf;
  auto nan = hn::FirstN(d, 0);  // a visible score is NaN
  for (int v = 0; v < vectors; ++v, j = hn::Add(j, key_step)) {
    auto sv = hn::LoadU(d, st + v * kLanes);
    if (!whole || modifiers.any()) {
      sv = mask_scores(d, modifiers, lane_rows, sv, j, nan);
      hn::StoreU(sv, d, st + v * kLanes);
    } else {
      nan = hn::Or(nan, hn::IsNaN(sv));
    }
    vmax = hn::Max(vmax, sv);
  }
  const auto vm_old = hn::Load(d, m_old);
  const auto vm_new = hn::Max(vm_old, hn::Max(vmax, hn::Vec<D>{swap_halves(vmax.raw)}));
  // A row that has seen no key yet keeps m = -inf: subtract 0 so exp(-inf) = 0.
  const auto no_max = hn::Eq(vm_new, minus_inf);
  const auto vm_sub = hn::IfThenZeroElse(no_max, vm_new);
  auto vsum = hn::Zero(d);
  const auto vscale = hn::Set(d, prob_scale);
  for (int v = 0; v < vectors; ++v) {
    const auto pv = hn::Exp(d, hn::Sub(hn::LoadU(d, st + v * kLanes), vm_sub));
    hn::StoreU(hn::Mul(pv, vscale), d, st + v * kLanes);
    vsum = hn::Add(vsum, pv);
  }
  // As in softmax_tile, a row with a visible NaN score gets a NaN alpha.
  const auto nan_lanes = hn::VecFromMask(d, nan);
  const auto nan_rows = hn::MaskFromVec(hn::Or(nan_lanes, hn::Vec<D>{swap_halves(nan_lanes.raw)}));
  const auto alpha =
      hn::IfThenElse(nan_rows, hn::Set(d, std::numeric_limits<float>::quiet_NaN()),
                     hn::IfThenZeroElse(hn::Eq(vm_old, minus_inf), hn::Exp(d, hn::Sub(vm_old, vm_sub))));
  const auto l_new = hn::MulAdd(hn::Load(d, l_old), alpha, hn::Add(vsum, hn::Vec<D>{swap_halves(vsum.raw)}));
  const hn::CappedTag<float, kRowBlock> d4;
  hn::StoreU(hn::LowerHalf(d4, alpha), d4, sc.alpha + r0);
  hn::StoreU(hn::LowerHalf(d4, vm_new), d4, sc.m + r0);
  hn::StoreU(hn::LowerHalf(d4, l_new), d4, sc.l + r0);
}

// One four-row tile (rows % 4 == 0): scores, softmax and
// P V per block of four rows, with probabilities key-major in the block's
// part of sc.s.
template <DType KV, bool kNanFree, class D>
void tile_decode_quads(D d, const AttentionParams& p, const Scratch& sc, int rows, int t0, int n,
                       const unsigned char* const* k_rows, const unsigned char* const* v_rows,
                       const TilePrefetch& ahead, const TilePrefetch& far) {
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    float* st = sc.s + r0 * kTileKeys;  // [kTileKeys, 4]: the block's kTileKeys x 4 floats
    const TilePrefetch* block_ahead = r0 == 0 ? &ahead : nullptr;
    const TilePrefetch* block_far = r0 == 0 ? &far : nullptr;
    scores_quad<KV, kNanFree>(d, sc, r0, p.head_size, n, k_rows, st, block_ahead);
    softmax_quad(d, p, sc, r0, t0, n, st, kChunkRescale<KV>);
    pv_decode_block<KV, kNanFree, kRowBlock>(d, sc, r0, p.head_size, n, v_rows, ProbLayout{st, 1, kRowBlock},
                                             block_far);
  }
}
#endif  // HWY_TARGET == HWY_AVX2

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // PAGEDATTN_CPU_ATTN_DECODE_TILES_AVX2_INL_H_
