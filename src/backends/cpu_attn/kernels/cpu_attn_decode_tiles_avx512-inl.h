// The AVX512-BF16 decode tiles (DecodeTiles::kBf16Dot): decodes with bf16
// queries and bf16 or e4m3 K/V, scores and P V with vdpbf16ps (DotTiles).
// Highway per-target header; only the AVX3 pass compiles anything.
#if defined(PAGEDATTN_CPU_ATTN_DECODE_TILES_AVX512_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEDATTN_CPU_ATTN_DECODE_TILES_AVX512_INL_H_
#undef PAGEDATTN_CPU_ATTN_DECODE_TILES_AVX512_INL_H_
#else
#define PAGEDATTN_CPU_ATTN_DECODE_TILES_AVX512_INL_H_
#endif

#include <hwy/highway.h>

#include "backends/cpu_attn/kernels/cpu_attn_avx512-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_decode_convert_avx512-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_decode_tiles-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_exp_avx512.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
#if HWY_TARGET == HWY_AVX3

// Decodes (few rows) with bf16 queries and bf16 or e4m3 K/V: scores and P V
// with vdpbf16ps, so one instruction does 32 multiply-adds where the fp32
// rowwise loop did 16 plus a widening of K/V (docs/cpu_attn.md). e4m3
// becomes bf16 through two byte-table lookups (vpermi2b, AVX512-VBMI: every
// AVX512-BF16 CPU the dispatch admits has it), so fp8 costs the bf16 loop plus
// a few instructions per 64 values while reading half the bytes. The e4m3
// bytes are interleaved with in-lane unpacks, which Zen 4 issues beside
// vdpbf16ps where the cross-lane vpermt2b competes with it; the
// head dimensions then come in a permuted order, which the queries and the
// P V accumulators follow (e4m3_key_slot_dim, pv_slot_dim).

// Keys per step of the decode score loop: four keys x four rows = 16
// accumulators, reduced together (one 128-bit lane per row) so a step ends in
// four vector stores instead of four reductions and 16 scalar stores.
constexpr int kDecodeKeyBlock = 4;

// Lane sums of a[0..3], partly folded: 128-bit lane l of the result holds
// partial sums of each a[r] in element r; the four lanes still add up.
HWY_INLINE __m512 fold4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// The decode tiles' score layout: each block of kRowBlock rows holds one
// vector per score step, whose 128-bit lane r has row r's scores of the
// step's four keys, as the step's joint reduction leaves them (rows of a
// partial block repeat its first row). The softmax works on these vectors
// whole: each lane knows its row and key, so masks, row maxima and row sums
// need no pass per row.
static_assert(kRowBlock * kDecodeKeyBlock == kFloatsPerVector, "a score step's sums fill one vector");
constexpr int kDecodeSteps = kTileKeys / kDecodeKeyBlock;
// The step of keys [i0, i0 + kDecodeKeyBlock) of the block of row r0 in
// sc.s: [rows / kRowBlock, kDecodeSteps, kRowBlock, kDecodeKeyBlock].
HWY_INLINE float* decode_score_step(const Scratch& sc, int r0, int i0) {
  return sc.s + r0 * kTileKeys + i0 * kRowBlock;
}

// S = (Q K^T) * scale for a decode tile, four rows x four keys per step, in
// the layout above. Q holds the bf16 query rows (load_queries_bf16) in key slot
// order (queries_to_key_slot_order). Score columns past n get duplicates of a real
// key's scores; softmax_decode masks them. The first row block's steps prefetch
// the tile ahead, a few keys per step.
template <DType KV>
PAGEDATTN_DECODE_TARGET void scores_decode_bf16(const Scratch& sc, int rows, int d_size, int n,
                                                const unsigned char* const* k_rows, float scale,
                                                const TilePrefetch& ahead) {
  static_assert(kTileKeys % kDecodeKeyBlock == 0, "key steps tile the score row");
  const E4M3Regs t = load_e4m3_regs();
  const auto* q16 = reinterpret_cast<const std::uint16_t*>(sc.q);
  const auto esize = static_cast<int>(dtype_size(KV));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int rb = std::min(kRowBlock, rows - r0);
    // Missing rows of a partial block reuse row r0 and are not stored.
    const std::uint16_t* q[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) q[r] = q16 + (r0 + (r < rb ? r : 0)) * d_size;
    for (int i0 = 0; i0 < n; i0 += kDecodeKeyBlock) {
      const unsigned char* k[kDecodeKeyBlock];
      for (int j = 0; j < kDecodeKeyBlock; ++j) k[j] = k_rows[i0 + j < n ? i0 + j : i0];
      prefetch_ahead(r0 == 0 ? &ahead : nullptr, i0, kDecodeKeyBlock);
      __m512 acc[kRowBlock][kDecodeKeyBlock];
      for (int r = 0; r < kRowBlock; ++r) {
        for (int j = 0; j < kDecodeKeyBlock; ++j) acc[r][j] = _mm512_setzero_ps();
      }
      for (int c = 0; c < d_size; c += kDecodeChunk) {
        __m512bh qv[kRowBlock][2];
        for (int r = 0; r < kRowBlock; ++r) {
          qv[r][0] = (__m512bh)_mm512_loadu_si512(q[r] + c);
          qv[r][1] = (__m512bh)_mm512_loadu_si512(q[r] + c + kBf16PerVector);
        }
        for (int j = 0; j < kDecodeKeyBlock; ++j) {
          __m512i k0, k1;
          load_key_chunk_bf16<KV>(k[j] + c * esize, t, k0, k1);
          for (int r = 0; r < kRowBlock; ++r) {
            acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qv[r][0], (__m512bh)k0);
            acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qv[r][1], (__m512bh)k1);
          }
        }
      }
      // Row r's four key sums, folded to 128-bit lanes, then lane r of `sums`.
      __m512 f[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) f[r] = fold4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      const __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(3, 2, 3, 2)));
      const __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(f[2], f[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_f32x4(f[2], f[3], _MM_SHUFFLE(3, 2, 3, 2)));
      const __m512 sums =
          _mm512_mul_ps(_mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(3, 1, 3, 1))),
                        vscale);
      _mm512_store_ps(decode_score_step(sc, r0, i0), sums);
    }
  }
}

// Keys16-packed e4m3 K groups per pass of scores_decode_packed_e4m3: each query
// pair is broadcast once for both (docs/cpu_attn.md).
constexpr int kPackedPassGroups = 2;
// Dimension quads between two prefetch calls of that pass.
constexpr int kPackedPrefetchQuads = 4;
static_assert(kPackedGroupElements == kLanesPerVector * kBytesPerLane,
              "a dimension quad of a group is one 64-byte load");
static_assert(kPackedKeyGroup == kFloatsPerVector && kPackedKeysPerLane == kDecodeKeyBlock,
              "a group's scores are one vector per row, a lane of it one score step");

// Scores of groups[0 .. kGroups) (keys key0 .. key0 + 16 kGroups of the tile)
// for the row block at r0, stored as decode_score_step lays them out. Each
// quad's two unpacks leave 16 keys x one dimension pair per vector, so every
// row accumulates one vector per group and no lanes are reduced; a 4 x 4
// transposition of 128-bit lanes then gives the score steps. The pass
// prefetches the tile ahead's keys in proportion to its quads (rounded up:
// a few keys of the next pass may go twice).
template <int kGroups>
PAGEDATTN_DECODE_TARGET HWY_INLINE void scores_packed_groups(const Scratch& sc, int r0,
                                                             const std::uint32_t* const* q, int quads,
                                                             int key0, const unsigned char* const* groups,
                                                             __m512 vscale, const E4M3Regs& t,
                                                             const TilePrefetch* ahead) {
  constexpr int kPassKeys = kGroups * kPackedKeyGroup;
  const int keys_per_prefetch = (kPassKeys * kPackedPrefetchQuads + quads - 1) / quads;
  __m512 acc[kRowBlock][kGroups];
  for (int r = 0; r < kRowBlock; ++r) {
    for (int u = 0; u < kGroups; ++u) acc[r][u] = _mm512_setzero_ps();
  }
  for (int g = 0; g < quads; ++g) {
    if (g % kPackedPrefetchQuads == 0) {
      prefetch_ahead(ahead, key0 + g / kPackedPrefetchQuads * keys_per_prefetch, keys_per_prefetch);
    }
    __m512i pair0[kGroups], pair1[kGroups];  // dimensions (4g, 4g + 1) and (4g + 2, 4g + 3)
    for (int u = 0; u < kGroups; ++u) {
      __m512i lo, hi;
      e4m3_bf16_bytes(_mm512_loadu_si512(groups[u] + g * kPackedGroupElements), t, lo, hi);
      pair0[u] = _mm512_unpacklo_epi8(lo, hi);
      pair1[u] = _mm512_unpackhi_epi8(lo, hi);
    }
    for (int r = 0; r < kRowBlock; ++r) {
      const auto b0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][2 * g]));
      const auto b1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][2 * g + 1]));
      for (int u = 0; u < kGroups; ++u) {
        acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)pair0[u], b0);
        acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)pair1[u], b1);
      }
    }
  }
  constexpr int kLo = _MM_SHUFFLE(1, 0, 1, 0);
  constexpr int kHi = _MM_SHUFFLE(3, 2, 3, 2);
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0);
  constexpr int kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  for (int u = 0; u < kGroups; ++u) {
    __m512 s[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) s[r] = _mm512_mul_ps(acc[r][u], vscale);
    // Lane l of row r's vector holds keys 4l .. 4l + 3; step l takes lane l of every row.
    const __m512 t0 = _mm512_shuffle_f32x4(s[0], s[1], kLo);
    const __m512 t1 = _mm512_shuffle_f32x4(s[2], s[3], kLo);
    const __m512 t2 = _mm512_shuffle_f32x4(s[0], s[1], kHi);
    const __m512 t3 = _mm512_shuffle_f32x4(s[2], s[3], kHi);
    const int first = key0 + u * kPackedKeyGroup;
    _mm512_store_ps(decode_score_step(sc, r0, first), _mm512_shuffle_f32x4(t0, t1, kEven));
    _mm512_store_ps(decode_score_step(sc, r0, first + kDecodeKeyBlock), _mm512_shuffle_f32x4(t0, t1, kOdd));
    _mm512_store_ps(decode_score_step(sc, r0, first + 2 * kDecodeKeyBlock),
                    _mm512_shuffle_f32x4(t2, t3, kEven));
    _mm512_store_ps(decode_score_step(sc, r0, first + 3 * kDecodeKeyBlock),
                    _mm512_shuffle_f32x4(t2, t3, kOdd));
  }
}

// S = (Q K^T) * scale for a decode tile of n keys whose first key starts a
// Keys16 group of an e4m3 cache (k_rows[16 j] is group j's first element), in
// the layout of scores_decode_bf16. Q holds the bf16 query rows in head order.
// A partial last group's missing keys get the scores of whatever their slots
// hold (inside the block), which softmax_decode masks.
inline PAGEDATTN_DECODE_TARGET void scores_decode_packed_e4m3(const Scratch& sc, int rows, int d_size, int n,
                                                              const unsigned char* const* k_rows, float scale,
                                                              const TilePrefetch& ahead) {
  const E4M3Regs t = load_e4m3_regs();
  const auto* q32 = reinterpret_cast<const std::uint32_t*>(sc.q);
  const int pairs = d_size / 2;
  const int quads = d_size / kPackedDimGroup;
  const int groups = (n + kPackedKeyGroup - 1) / kPackedKeyGroup;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int rb = std::min(kRowBlock, rows - r0);
    // Missing rows of a partial block reuse row r0 and are not read back.
    const std::uint32_t* q[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) q[r] = q32 + (r0 + (r < rb ? r : 0)) * pairs;
    const TilePrefetch* pass_ahead = r0 == 0 ? &ahead : nullptr;
    int j = 0;
    for (; j + kPackedPassGroups <= groups; j += kPackedPassGroups) {
      const unsigned char* pass[kPackedPassGroups];
      for (int u = 0; u < kPackedPassGroups; ++u) pass[u] = k_rows[(j + u) * kPackedKeyGroup];
      scores_packed_groups<kPackedPassGroups>(sc, r0, q, quads, j * kPackedKeyGroup, pass, vscale, t,
                                              pass_ahead);
    }
    if (j < groups) {
      const unsigned char* last = k_rows[j * kPackedKeyGroup];
      scores_packed_groups<1>(sc, r0, q, quads, j * kPackedKeyGroup, &last, vscale, t, pass_ahead);
    }
  }
}

// Vector lane i holds x[i / kDecodeKeyBlock] (x: one value per row of a block).
HWY_INLINE __m512 row_lanes(__m128 x) {
  const __m512i row_of_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(row_of_lane, _mm512_castps128_ps512(x));
}
HWY_INLINE __m512i row_lanes(__m128i x) { return _mm512_castps_si512(row_lanes(_mm_castsi128_ps(x))); }

// Lane r of the result: the value of row r (its first lane) in x.
HWY_INLINE __m128 row_values(__m512 x) {
  const __m512i first_lane_of_row = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(first_lane_of_row, x));
}

// Max and sum of each 128-bit lane (one row's four keys), in all its elements.
HWY_INLINE __m512 row_max(__m512 x) {
  x = _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
}
HWY_INLINE __m512 row_sum(__m512 x) {
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
}

// Lane masks of whole rows: every lane of a row whose lanes have any bit set.
HWY_INLINE __mmask16 whole_rows(__mmask16 lanes) {
  constexpr unsigned kFirstLanes = 0x1111;  // lane 0 of each row
  constexpr unsigned kRowLanes = 0xF;
  unsigned m = lanes;
  m |= m >> 1;
  m |= m >> 2;
  return static_cast<__mmask16>((m & kFirstLanes) * kRowLanes);
}

// The probabilities of one row block as bf16 pairs of keys (2j, 2j + 1): dword
// decode_prob_index(j) + 2r holds row r's pair j (the order vcvtne2ps2bf16 gives
// two score-step vectors).
constexpr int kProbBlockDwords = kRowBlock * kTileKeys / 2;
// In the [D, kTileKeys] K tile buffer, which holds them: decode tiles have
// fewer than kTransposeMinRows rows and head sizes multiples of kDecodeChunk.
static_assert((kTransposeMinRows + kRowBlock - 1) / kRowBlock * kProbBlockDwords <= kDecodeChunk * kTileKeys,
              "a decode tile's probability blocks fit the K tile buffer");
HWY_INLINE std::uint32_t* decode_prob_block(const Scratch& sc, int r0) {
  return reinterpret_cast<std::uint32_t*>(sc.kt) + r0 / kRowBlock * kProbBlockDwords;
}
HWY_INLINE int decode_prob_index(int j) {
  constexpr int kStepsPerVector = 2;
  constexpr int kPairsPerVector = kStepsPerVector * kDecodeKeyBlock / 2;
  constexpr int kDwordsPerStep = kFloatsPerVector / 2;
  return j / kPairsPerVector * kFloatsPerVector + j / 2 % 2 * kDwordsPerStep + j % 2;
}

// Soft cap, ALiBi and masks on a decode tile's scores (decode_score_step's
// layout), then the online-softmax update of each row block: P = exp(S - m_new)
// as bf16 pairs (decode_prob_block), l sums the unrounded P, alpha = exp(m_old -
// m_new). The same semantics as softmax_tile: a NaN visible score makes the
// row's alpha NaN; a row that sees no key of the tile keeps its state
// (alpha 1, or 0 while it has seen no key, its accumulator then being zero).
inline PAGEDATTN_DECODE_TARGET void softmax_decode(const AttentionParams& p, const Scratch& sc, int rows,
                                                   int t0, int n) {
  using D = hn::ScalableTag<float>;
  const D d;
  const hn::RebindToSigned<D> di;
  const ScoreModifiers<D> modifiers(d, p);
  const __m512 minus_inf = _mm512_set1_ps(neg_inf());
  const __m512i key_of_lane = _mm512_set_epi32(3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0);
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int rb = std::min(kRowBlock, rows - r0);
    const auto real_rows = static_cast<__mmask8>((1u << rb) - 1);
    alignas(16) std::int32_t lo_minus_one[kRowBlock];
    alignas(16) std::int32_t hi[kRowBlock];
    alignas(16) float slope[kRowBlock];
    alignas(16) float position[kRowBlock];
    bool whole = true;  // every row sees every key of the tile
    for (int r = 0; r < kRowBlock; ++r) {
      const RowInfo& info = sc.rows[r0 + (r < rb ? r : 0)];
      lo_minus_one[r] = info.lo - 1;
      hi[r] = visible_end(info, t0, n);
      slope[r] = info.slope;
      position[r] = info.position;
      whole = whole && sees_whole_tile(info, t0, n);
    }
    float* scores = decode_score_step(sc, r0, 0);
    __m512 sv[kDecodeSteps];
    __m512 vmax = minus_inf;
    auto nan = hn::FirstN(d, 0);  // lanes with a visible NaN score
    if (whole && !modifiers.any()) {
      for (int i = 0; i < kDecodeSteps; ++i) {
        sv[i] = _mm512_load_ps(scores + i * kFloatsPerVector);
        nan = hn::Or(nan, hn::IsNaN(hn::Vec512<float>{sv[i]}));
        vmax = _mm512_max_ps(vmax, sv[i]);
      }
    } else {
      const auto load_i32 = [](const std::int32_t* x) {
        return _mm_load_si128(reinterpret_cast<const __m128i*>(x));
      };
      const LaneRows<D> lane_rows{{row_lanes(load_i32(lo_minus_one))},
                                  {row_lanes(load_i32(hi))},
                                  {row_lanes(_mm_load_ps(slope))},
                                  {row_lanes(_mm_load_ps(position))}};
      for (int i = 0; i < kDecodeSteps; ++i) {
        const auto key =
            hn::Add(hn::Vec512<std::int32_t>{key_of_lane}, hn::Set(di, t0 + i * kDecodeKeyBlock));
        sv[i] =
            mask_scores(d, modifiers, lane_rows, hn::Load(d, scores + i * kFloatsPerVector), key, nan).raw;
        vmax = _mm512_max_ps(vmax, sv[i]);
      }
    }
    const __m512 m_old = row_lanes(_mm_maskz_loadu_ps(real_rows, sc.m + r0));
    const __m512 m_new = _mm512_max_ps(row_max(vmax), m_old);
    __m512 vsum = _mm512_setzero_ps();
    for (int i = 0; i < kDecodeSteps; ++i) {
      sv[i] = exp_avx512(_mm512_sub_ps(sv[i], m_new));  // exp(-inf) = 0 for masked keys
      vsum = _mm512_add_ps(vsum, sv[i]);
    }
    // exp_avx512 gives 0 for a NaN argument, so a NaN score has P = 0 (and
    // exp(-inf - -inf) is 0): a NaN alpha makes the row's accumulator and
    // sum NaN instead, as the oracle's are.
    const __m512 alpha = _mm512_mask_mov_ps(exp_avx512(_mm512_sub_ps(m_old, m_new)), whole_rows(nan.raw),
                                            _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    const __m512 l_old = row_lanes(_mm_maskz_loadu_ps(real_rows, sc.l + r0));
    const __m512 l_new = _mm512_add_ps(_mm512_mul_ps(l_old, alpha), row_sum(vsum));
    _mm_mask_storeu_ps(sc.m + r0, real_rows, row_values(m_new));
    _mm_mask_storeu_ps(sc.l + r0, real_rows, row_values(l_new));
    _mm_mask_storeu_ps(sc.alpha + r0, real_rows, row_values(alpha));
    std::uint32_t* prob = decode_prob_block(sc, r0);
    for (int i = 0; i < kDecodeSteps; i += 2) {
      const __m512bh packed = _mm512_cvtne2ps_pbh(sv[i + 1], sv[i]);
      _mm512_store_si512(prob + i / 2 * kFloatsPerVector, (__m512i)packed);
    }
  }
}

// acc = alpha * acc + P V for a decode tile, acc in slot order (pv_slot_dim):
// V rows interleaved in key pairs as they are read, probabilities as bf16
// pairs (softmax_decode; as the prefill path, accumulate_pv_bf16). Four rows x four vectors
// (16 accumulators) per pass over kDecodeChunk columns. The first row block's
// passes prefetch the `far` unit's K and V into L2, the columns and keys each
// pass reads.
template <DType KV>
PAGEDATTN_DECODE_TARGET void accumulate_pv_decode_bf16(const Scratch& sc, int rows, int d_size, int n,
                                                       const unsigned char* const* v_rows,
                                                       const TilePrefetch& far) {
  constexpr int kVectors = kPairVectors;
  const E4M3Regs t = load_e4m3_regs();
  const auto esize = static_cast<int>(dtype_size(KV));
  constexpr int kChunkLines = kDecodeChunk * static_cast<int>(dtype_size(KV)) / kCacheLine;
  const int whole_pairs = n / 2;
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int rb = std::min(kRowBlock, rows - r0);
    const std::uint32_t* prob = decode_prob_block(sc, r0);
    float* a[kRowBlock];
    const float* alpha[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) {
      const int row = r0 + (r < rb ? r : 0);  // missing rows reuse r0, not stored
      a[r] = sc.acc + row * d_size;
      alpha[r] = sc.alpha + row;
    }
    const int far_n = r0 == 0 ? far.n : 0;
    for (int c0 = 0; c0 < d_size; c0 += kDecodeChunk) {
      __m512 acc[kRowBlock][kVectors];
      for (int r = 0; r < kRowBlock; ++r) {
        const __m512 scale = _mm512_set1_ps(*alpha[r]);
        for (int v = 0; v < kVectors; ++v)
          acc[r][v] = _mm512_mul_ps(_mm512_load_ps(a[r] + c0 + v * kFloatsPerVector), scale);
      }
      const auto step = [&](int j, auto second_key) {
        if (2 * j < far_n) {  // the far unit's chunk c0 of keys 2j, 2j + 1
          const int b = std::min(2 * j + 1, far_n - 1);
          prefetch_lines<kKeepInL2>(far.k_rows[2 * j] + c0 * esize, kChunkLines);
          prefetch_lines<kKeepInL2>(far.v_rows[2 * j] + c0 * esize, kChunkLines);
          prefetch_lines<kKeepInL2>(far.k_rows[b] + c0 * esize, kChunkLines);
          prefetch_lines<kKeepInL2>(far.v_rows[b] + c0 * esize, kChunkLines);
        }
        __m512i x[kVectors];
        pair_value_chunk<KV, decltype(second_key)::value>(
            v_rows[2 * j] + c0 * esize, second_key ? v_rows[2 * j + 1] + c0 * esize : nullptr, t, x);
        const std::uint32_t* prob_j = prob + decode_prob_index(j);
        for (int r = 0; r < kRowBlock; ++r) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_j[2 * r]));
          for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], p, (__m512bh)x[v]);
        }
      };
      for (int j = 0; j < whole_pairs; ++j) step(j, std::true_type{});
      // An odd tile's last key pairs with zeros: its probability is 0, but the
      // cache behind it may hold NaN.
      if (n % 2 != 0) step(whole_pairs, std::false_type{});
      for (int r = 0; r < rb; ++r) {
        for (int v = 0; v < kVectors; ++v) _mm512_store_ps(a[r] + c0 + v * kFloatsPerVector, acc[r][v]);
      }
    }
  }
}

// One tile of the AVX512-BF16 decode path: `ahead` is prefetched into L1 from
// the score loop, `far` into L2 from the P V loop. `score_scale`: the softmax
// scale times the KV head's K dequantization scale (the bf16 queries stay
// unscaled). `packed_scores`: K is a Keys16-packed e4m3 cache and the tile
// starts a group (k_rows point at the rows' row-major positions).
template <DType KV>
void tile_decode_dot(const AttentionParams& p, const Scratch& sc, int rows, int t0, int n,
                     const unsigned char* const* k_rows, const unsigned char* const* v_rows,
                     const TilePrefetch& ahead, const TilePrefetch& far, float score_scale,
                     bool packed_scores) {
  if (KV == DType::FP8_E4M3 && packed_scores) {
    scores_decode_packed_e4m3(sc, rows, p.head_size, n, k_rows, score_scale, ahead);
  } else {
    scores_decode_bf16<KV>(sc, rows, p.head_size, n, k_rows, score_scale, ahead);
  }
  softmax_decode(p, sc, rows, t0, n);
  accumulate_pv_decode_bf16<KV>(sc, rows, p.head_size, n, v_rows, far);
}

// The decode walk's interface to these tiles (DecodeTiles::kBf16Dot): bf16
// queries in key slot order (unless the tiles read packed K groups), the
// scores scaled per tile, the accumulator put back into head order at the end.
template <DType KV>
struct DotTiles {
  template <class D>
  static void load_queries(D, const AttentionParams& p, const WorkItem& one, const ItemShape& shape,
                           const Scratch& sc, bool packed_scores) {
    load_queries_bf16(p, one, shape, reinterpret_cast<std::uint16_t*>(sc.q));
    if (!packed_scores)
      queries_to_key_slot_order<KV>(reinterpret_cast<std::uint16_t*>(sc.q), shape.rows, p.head_size);
  }
  template <class D>
  static void tile(D, const AttentionParams& p, const Scratch& sc, int rows, int t0, int n,
                   const unsigned char* const* k_rows, const unsigned char* const* v_rows,
                   const TilePrefetch& ahead, const TilePrefetch& far, int kv_head, bool packed_scores) {
    const float score_scale = p.variant.scale * dequant_scale(p, p.k_scale, kv_head);
    tile_decode_dot<KV>(p, sc, rows, t0, n, k_rows, v_rows, ahead, far, score_scale, packed_scores);
  }
  template <class D>
  static void finish(D, const AttentionParams& p, const Scratch& sc, int rows) {
    acc_to_head_order<KV>(sc.acc, rows, p.head_size);
  }
};

#endif  // HWY_TARGET == HWY_AVX3

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // PAGEDATTN_CPU_ATTN_DECODE_TILES_AVX512_INL_H_
