// The decode walk's chunk tiles, for every target (DecodeTiles::kChunks):
// K/V read in chunks of two float vectors straight from the cache rows, the
// score and P V passes over blocks of 4, 2 and 1 rows, one tile of them
// (tile_decode), and the software prefetch of the units ahead. Highway
// per-target header.
#if defined(PAGEDATTN_CPU_ATTN_DECODE_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEDATTN_CPU_ATTN_DECODE_TILES_INL_H_
#undef PAGEDATTN_CPU_ATTN_DECODE_TILES_INL_H_
#else
#define PAGEDATTN_CPU_ATTN_DECODE_TILES_INL_H_
#endif

#include <hwy/highway.h>

#include "backends/cpu_attn/kernels/cpu_attn_common-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_target-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Paged blocks are scattered, so the hardware prefetchers lose the stream at
// every block: the decode walk prefetches in software. TilePrefetch is the
// unit after the one computed, which the tiles prefetch a few rows at a time
// from inside their score loops: a burst of a whole tile's prefetches fills
// the miss buffers and stalls the loads behind it, while spread out they keep
// DRAM busy under the arithmetic (docs/cpu_attn.md). The score loops of later
// row blocks of the same tile get `ahead` null.
struct TilePrefetch {
  const unsigned char* const* k_rows = nullptr;  // [n] K rows of the next tile
  const unsigned char* const* v_rows = nullptr;  // [n] V rows of the next tile
  int n = 0;
  int lines = 0;         // cache lines per K/V row
  bool into_l2 = false;  // the L2 hint instead of L1 (walk_decode_units: units that crowd L1)
};

// Prefetches the K and V rows of the tile ahead's keys [i0, i0 + count) in
// prefetch order (in the score loop only: prefetches in the P V loop measured
// slower). That order alternates between the two halves of the tile (its two
// blocks at the default block size), so four K/V streams advance together
// instead of two: interleaved reads measured near the streaming roofline
// (docs/cpu_attn.md).
HWY_INLINE void prefetch_ahead(const TilePrefetch* ahead, int i0, int count) {
  if (ahead == nullptr) return;
  const int half = (ahead->n + 1) / 2;
  for (int i = i0; i < std::min(ahead->n, i0 + count); ++i) {
    const int key = i % 2 == 0 ? i / 2 : half + i / 2;  // 0, half, 1, half + 1, ...
    if (ahead->into_l2) {
      prefetch_lines<kKeepInL2>(ahead->k_rows[key], ahead->lines);
      prefetch_lines<kKeepInL2>(ahead->v_rows[key], ahead->lines);
    } else {
      prefetch_lines<kKeepInL1>(ahead->k_rows[key], ahead->lines);
      prefetch_lines<kKeepInL1>(ahead->v_rows[key], ahead->lines);
    }
  }
}

// Moves each row of x [rows, d_size] between head order and a kernel's
// working order, `block` elements at a time: slot s of a block holds head
// dimension slot_dim(s). tmp holds one row.
template <class T, class SlotDim>
void permute_rows(T* x, T* tmp, int rows, int d_size, int block, SlotDim slot_dim, bool to_slots) {
  for (int r = 0; r < rows; ++r) {
    T* row = x + static_cast<std::size_t>(r) * d_size;
    std::copy(row, row + d_size, tmp);
    for (int c = 0; c < d_size; c += block) {
      for (int s = 0; s < block; ++s) {
        if (to_slots) {
          row[c + s] = tmp[c + slot_dim(s)];
        } else {
          row[c + slot_dim(s)] = tmp[c + s];
        }
      }
    }
  }
}

// ---- the chunk tiles (few rows) ----------------------------------------------------
//
// A chunk is 2 x Lanes(d) K/V elements, read as two float vectors. bf16 is
// read as 32-bit lanes whose low and high halves are already the even and odd
// elements' float bits (one shift or mask each instead of a widening
// conversion); e4m3 on AVX2 and AVX-512 as 32-bit lanes of four values, one
// float vector per byte position (e4m3_byte). A block of kChunkWays<KV> x
// Lanes(d) elements is then read in an interleaved order; the query rows and
// the accumulator are kept in the same order and the accumulator is put back
// at the end. Other dtypes keep their order. Scores take several keys per pass
// and P V several chunks per pass, so every K/V load feeds all rows of a block
// and kDecodeAccumulators independent FMA chains are in flight.
constexpr int kDecodeAccumulators = 8;

// The targets whose chunked tiles read e4m3 as float bits (e4m3_byte); the
// scalar one converts through halves (load_e4m3_nan_free, load_kv).
constexpr bool kE4M3AsFloatBits = kTarget.e4m3_as_float_bits;

// Float vectors one load of a block yields (1: head-dimension order).
template <DType KV>
constexpr int kChunkWays = KV == DType::BF16                             ? 2
                           : (KV == DType::FP8_E4M3 && kE4M3AsFloatBits) ? 4
                                                                         : 1;

// Elements of the blocks the chunk tiles walk (head sizes must divide).
template <DType KV>
int chunk_block(int lanes) {
  return std::max(2, kChunkWays<KV>) * lanes;
}

// e4m3_byte's floats read 2^-120 times the e4m3 value, the item's K and V
// scales assume 2^-8 (kE4M3HalfRescale): the scores and the probabilities
// take the difference.
constexpr float kE4M3WideToHalf = 0x1p112f;

// What the chunk tiles multiply scores and probabilities by.
template <DType KV>
constexpr float kChunkRescale = kChunkWays<KV> == 4 ? kE4M3WideToHalf : 1.0f;

// e4m3 without the NaN code: a sign-extended byte shifted into an IEEE half
// reads 2^-8 too small (the item's kE4M3HalfRescale), like load_kv's, once the
// sign copy that lands in the top exponent bit is cleared. Three operations
// and the half-to-float conversion instead of load_kv's eight and three more
// for NaN.
template <class D>
HWY_INLINE hn::Vec<D> load_e4m3_nan_free(D d, const unsigned char* p) {
  const hn::Rebind<std::int8_t, D> di8;
  const hn::Rebind<std::int16_t, D> di16;
  const hn::Rebind<hwy::float16_t, D> dh;
  constexpr std::int16_t kClearTopExponentBit = static_cast<std::int16_t>(0xBFFF);
  const auto s = hn::PromoteTo(di16, hn::LoadU(di8, reinterpret_cast<const std::int8_t*>(p)));
  const auto half_bits = hn::And(hn::ShiftLeft<7>(s), hn::Set(di16, kClearTopExponentBit));
  return hn::PromoteTo(d, hn::BitCast(dh, half_bits));
}

// e4m3 values as float bits, byte kByte of each 32-bit lane: moved to the top
// byte and shifted right arithmetically by 4, the sign stays in bit 31 and
// exponent and mantissa land in the float's low exponent and top mantissa
// bits; the mask clears the sign copies. The float reads 2^-120 times the
// value, e4m3 subnormals as float subnormals (Zen FMAs take those at full
// speed, docs/cpu_attn.md). Two or three integer operations per 8
// values and no conversion instruction (load_e4m3_nan_free's sign extension and
// half-to-float both take FMA-pipe cycles). kNanFree: the tile holds no NaN
// code, else its lanes become NaN.
template <int kByte, bool kNanFree, class D>
HWY_INLINE hn::Vec<D> e4m3_byte(D d, hn::Vec<hn::RebindToSigned<D>> lanes) {
  const hn::RebindToSigned<D> di;
  constexpr std::int32_t kFloatFields = static_cast<std::int32_t>(0x87F00000u);  // sign, 4 + 3 low bits
  constexpr std::int32_t kNanBits = 0x07F00000;                                  // S.1111.111 there
  constexpr std::int32_t kMagnitude = 0x7FFFFFFF;
  constexpr int kToTopByte = 24 - 8 * kByte;
  const auto bits = hn::And(hn::ShiftRight<4>(hn::ShiftLeft<kToTopByte>(lanes)), hn::Set(di, kFloatFields));
  const auto v = hn::BitCast(d, bits);
  if constexpr (kNanFree) return v;
  const auto is_nan = hn::Eq(hn::And(bits, hn::Set(di, kMagnitude)), hn::Set(di, kNanBits));
  return hn::IfThenElse(hn::RebindMask(d, is_nan), hn::Set(d, std::numeric_limits<float>::quiet_NaN()), v);
}

// The 4-way block (kChunkWays 4) holding element c of a row, as 32-bit lanes.
template <class D>
HWY_INLINE hn::Vec<hn::RebindToSigned<D>> load_e4m3_block(D d, const unsigned char* row, int c) {
  const hn::RebindToSigned<D> di;
  const int block = 4 * static_cast<int>(hn::Lanes(d));
  return hn::LoadU(di, reinterpret_cast<const std::int32_t*>(row + c / block * block));
}

// bf16 pairs read as 32-bit lanes hold the even element in the low half and
// the odd one in the high half. Shifts share the FMA pipes, masks run on any
// FP pipe (docs/cpu_attn.md), so a chunk past the first of its row
// reads its even elements 2 bytes early, as high halves to mask, and one
// before the last of its row its odd elements 2 bytes late, as low halves to
// shift up (one shift instead of two where no register is free for the
// mask). Neither read leaves the row.
template <class D>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> load_bf16_pairs(D, const unsigned char* p) {
  return hn::LoadU(hn::RebindToUnsigned<D>(), reinterpret_cast<const std::uint32_t*>(p));
}

template <class D>
HWY_INLINE hn::Vec<D> high_halves(D d, hn::Vec<hn::RebindToUnsigned<D>> u) {
  return hn::BitCast(d, hn::And(u, hn::Set(hn::RebindToUnsigned<D>(), 0xFFFF0000u)));
}

template <class D>
HWY_INLINE hn::Vec<D> low_halves(D d, hn::Vec<hn::RebindToUnsigned<D>> u) {
  return hn::BitCast(d, hn::ShiftLeft<16>(u));
}

// The even elements of the bf16 chunk at p; row_start: p is its row's start.
template <class D>
HWY_INLINE hn::Vec<D> bf16_evens(D d, const unsigned char* p, bool row_start) {
  constexpr int kElementBytes = 2;
  return row_start ? low_halves(d, load_bf16_pairs(d, p))
                   : high_halves(d, load_bf16_pairs(d, p - kElementBytes));
}

// The odd elements of the bf16 chunk at p without a mask; row_end: the chunk
// ends its row.
template <class D>
HWY_INLINE hn::Vec<D> bf16_odds_shifted(D d, const unsigned char* p, bool row_end) {
  constexpr int kElementBytes = 2;
  if (!row_end) return low_halves(d, load_bf16_pairs(d, p + kElementBytes));
  return low_halves(d, hn::ShiftRight<16>(load_bf16_pairs(d, p)));
}

// The two float vectors of the chunk at element c of a row (chunk order).
// kNanFree: the tile holds no e4m3 NaN code (tile_decode checked).
template <DType KV, bool kNanFree, class D>
HWY_INLINE void load_chunk(D d, const unsigned char* row, int c, hn::Vec<D>& a, hn::Vec<D>& b) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  const unsigned char* p = row + static_cast<std::size_t>(c) * dtype_size(KV);
  if constexpr (kChunkWays<KV> == 4) {
    const auto block = load_e4m3_block(d, row, c);
    if (c % (4 * lanes) == 0) {
      a = e4m3_byte<0, kNanFree>(d, block);
      b = e4m3_byte<1, kNanFree>(d, block);
    } else {
      a = e4m3_byte<2, kNanFree>(d, block);
      b = e4m3_byte<3, kNanFree>(d, block);
    }
  } else if constexpr (KV == DType::FP8_E4M3 && kNanFree) {
    a = load_e4m3_nan_free(d, p);
    b = load_e4m3_nan_free(d, p + lanes);
  } else if constexpr (kChunkWays<KV> == 2) {
    a = bf16_evens(d, p, c == 0);
    b = high_halves(d, load_bf16_pairs(d, p));
  } else {
    a = load_kv<KV>(d, p);
    b = load_kv<KV>(d, p + lanes * dtype_size(KV));
  }
}

// Puts each row of x [rows, d_size] into chunk order (forward) or back into
// head-dimension order; tmp holds one row. In a block, lane j of vector k
// holds element kWays j + k.
template <DType KV>
void reorder_rows(float* x, float* tmp, int rows, int d_size, int lanes, bool forward) {
  constexpr int kWays = kChunkWays<KV>;
  if constexpr (kWays > 1) {
    const auto slot_dim = [lanes](int s) { return kWays * (s % lanes) + s / lanes; };
    permute_rows(x, tmp, rows, d_size, kWays * lanes, slot_dim, forward);
  } else {
    static_cast<void>(x), static_cast<void>(tmp), static_cast<void>(rows), static_cast<void>(d_size);
    static_cast<void>(lanes), static_cast<void>(forward);
  }
}

// S[r0 .. r0 + kR, i] = q . k_i, kKeys keys per pass (missing keys of the last
// pass repeat key n - 1 and are not stored).
template <DType KV, bool kNanFree, int kR, class D>
void scores_decode(D d, const Scratch& sc, int r0, int d_size, int n, const unsigned char* const* k_rows,
                   const TilePrefetch* ahead) {
  constexpr int kKeys = kDecodeAccumulators / kR;
  // Holding all rows' query vectors would not fit: with four rows the chunks
  // of the pass's keys stay in registers instead, and the rows stream.
  constexpr bool kKeysInRegisters = kR == kRowBlock;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const float* q[kR];
  for (int r = 0; r < kR; ++r) q[r] = sc.q + (r0 + r) * d_size;
  for (int i0 = 0; i0 < n; i0 += kKeys) {
    const unsigned char* k[kKeys];
    for (int j = 0; j < kKeys; ++j) k[j] = k_rows[std::min(i0 + j, n - 1)];
    prefetch_ahead(ahead, i0, kKeys);
    hn::Vec<D> acc[kR][kKeys];
    for (int r = 0; r < kR; ++r) {
      for (int j = 0; j < kKeys; ++j) acc[r][j] = hn::Zero(d);
    }
    for (int c = 0; c < d_size; c += 2 * lanes) {
      if constexpr (kKeysInRegisters) {
        hn::Vec<D> ka[kKeys];
        hn::Vec<D> kb[kKeys];
        for (int j = 0; j < kKeys; ++j) load_chunk<KV, kNanFree>(d, k[j], c, ka[j], kb[j]);
        for (int r = 0; r < kR; ++r) {
          const auto qa = hn::LoadU(d, q[r] + c);
          const auto qb = hn::LoadU(d, q[r] + c + lanes);
          for (int j = 0; j < kKeys; ++j) acc[r][j] = hn::MulAdd(qb, kb[j], hn::MulAdd(qa, ka[j], acc[r][j]));
        }
      } else {
        hn::Vec<D> qa[kR];
        hn::Vec<D> qb[kR];
        for (int r = 0; r < kR; ++r) {
          qa[r] = hn::LoadU(d, q[r] + c);
          qb[r] = hn::LoadU(d, q[r] + c + lanes);
        }
        for (int j = 0; j < kKeys; ++j) {
          hn::Vec<D> ka;
          hn::Vec<D> kb;
          load_chunk<KV, kNanFree>(d, k[j], c, ka, kb);
          for (int r = 0; r < kR; ++r) acc[r][j] = hn::MulAdd(qb[r], kb, hn::MulAdd(qa[r], ka, acc[r][j]));
        }
      }
    }
    if constexpr (kChunkRescale<KV> != 1.0f) {
      for (auto& row : acc) {
        for (auto& a : row) a = hn::Mul(a, hn::Set(d, kChunkRescale<KV>));
      }
    }
    const int keys = std::min(kKeys, n - i0);
    if constexpr (kKeys >= 4) {  // four keys of one row per reduction
      for (int r = 0; r < kR; ++r) {
        for (int j0 = 0; j0 < keys; j0 += 4) {
          const hn::Vec<D> v[4] = {acc[r][j0], acc[r][j0 + 1], acc[r][j0 + 2], acc[r][j0 + 3]};
          store_sums4(d, v, sc.s + (r0 + r) * kTileKeys + i0 + j0, 1, std::min(4, keys - j0));
        }
      }
    } else {  // four rows of one key per reduction
      static_assert(kR == 4, "fewer than four keys per pass only with four rows");
      for (int j = 0; j < keys; ++j) {
        const hn::Vec<D> v[4] = {acc[0][j], acc[1][j], acc[2][j], acc[3][j]};
        store_sums4(d, v, sc.s + r0 * kTileKeys + i0 + j, kTileKeys, 4);
      }
    }
  }
}

// Where P V finds a block's probabilities: row r, key i at
// first[r * row_step + i * key_step] (row-major sc.s, or the key-major tile of
// the AVX2 four-row path).
struct ProbLayout {
  const float* first = nullptr;
  int row_step = kTileKeys;
  int key_step = 1;
};

// acc[r0 .. r0 + kR] = alpha * acc + P V, kChunks chunks per pass. `far`
// (the first row block's passes; else null): the unit kFarPrefetchUnits ahead,
// whose K and V rows go to L2 beside it, each pass an equal share of each
// row's lines.
template <DType KV, bool kNanFree, int kR, int kChunks, class D>
void pv_decode(D d, const Scratch& sc, int r0, int d_size, int n, const unsigned char* const* v_rows,
               const ProbLayout& probs, const TilePrefetch* far) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  float* a[kR];
  const float* prob[kR];
  for (int r = 0; r < kR; ++r) {
    a[r] = sc.acc + (r0 + r) * d_size;
    prob[r] = probs.first + r * probs.row_step;
  }
  constexpr int kVectors = 2 * kChunks;
  const int far_n = far != nullptr ? far->n : 0;
  const int far_lines = far != nullptr ? far->lines : 0;
  const int passes = d_size / (kVectors * lanes);
  for (int c0 = 0, pass = 0; c0 < d_size; c0 += kVectors * lanes, ++pass) {
    hn::Vec<D> acc[kR][kVectors];
    load_rescaled(d, sc, r0, a, c0, acc);
    const auto key = [&](int i) {
      hn::Vec<D> pr[kR];
      for (int r = 0; r < kR; ++r) pr[r] = hn::Set(d, prob[r][i * probs.key_step]);
      for (int ch = 0; ch < kChunks; ++ch) {
        hn::Vec<D> va;
        hn::Vec<D> vb;
        load_chunk<KV, kNanFree>(d, v_rows[i], c0 + 2 * ch * lanes, va, vb);
        for (int r = 0; r < kR; ++r) {
          acc[r][2 * ch] = hn::MulAdd(pr[r], va, acc[r][2 * ch]);
          acc[r][2 * ch + 1] = hn::MulAdd(pr[r], vb, acc[r][2 * ch + 1]);
        }
      }
    };
    // The keys whose far rows have lines in this pass's share, then the rest
    // (the share is often empty: passes outnumber a row's lines).
    const int line_begin = pass * far_lines / passes;
    const int line_end = (pass + 1) * far_lines / passes;
    const int far_keys = line_begin < line_end ? std::min(far_n, n) : 0;
    int i = 0;
    for (; i < far_keys; ++i) {
      for (int line = line_begin; line < line_end; ++line) {
        prefetch_lines<kKeepInL2>(far->k_rows[i] + line * kCacheLine, 1);
        prefetch_lines<kKeepInL2>(far->v_rows[i] + line * kCacheLine, 1);
      }
      key(i);
    }
    for (; i < n; ++i) key(i);
    store_accumulators(d, a, c0, acc);
  }
}

// P V for a block of kR rows with as many chunks per pass as fit the
// accumulators and divide the head size.
template <DType KV, bool kNanFree, int kR, class D>
void pv_decode_block(D d, const Scratch& sc, int r0, int d_size, int n, const unsigned char* const* v_rows,
                     const ProbLayout& probs, const TilePrefetch* far) {
  constexpr int kMostChunks = kDecodeAccumulators / (2 * kR);
  const int chunk = 2 * static_cast<int>(hn::Lanes(d));
  if constexpr (kMostChunks >= 4) {
    if (d_size % (4 * chunk) == 0)
      return pv_decode<KV, kNanFree, kR, 4>(d, sc, r0, d_size, n, v_rows, probs, far);
  }
  if constexpr (kMostChunks >= 2) {
    if (d_size % (2 * chunk) == 0)
      return pv_decode<KV, kNanFree, kR, 2>(d, sc, r0, d_size, n, v_rows, probs, far);
  }
  pv_decode<KV, kNanFree, kR, 1>(d, sc, r0, d_size, n, v_rows, probs, far);
}

// The AVX512-BF16 decode tiles (DecodeTiles::kBf16Dot,
// cpu_attn_decode_tiles_avx512-inl.h), for the K/V types they read; only
// targets whose TargetShape has bf16_dot define them.
template <DType KV>
constexpr bool kDecodeDotKV = KV == DType::BF16 || KV == DType::FP8_E4M3;
template <DType KV>
struct DotTiles;

// The AVX2 four-row tile (DecodeTiles::kChunkQuads,
// cpu_attn_decode_tiles_avx2-inl.h); only targets whose TargetShape has
// chunk_quads define it, and the host chooses it nowhere else.
template <DType KV, bool kNanFree, class D>
void tile_decode_quads(D d, const AttentionParams& p, const Scratch& sc, int rows, int t0, int n,
                       const unsigned char* const* k_rows, const unsigned char* const* v_rows,
                       const TilePrefetch& ahead, const TilePrefetch& far);

// Whether any of the n rows holds the e4m3 NaN code (S.1111.111): one AND
// and one unsigned max per vector of bytes (a compare and an OR measured one
// more), a fraction of what the NaN-exact conversion costs per value.
// Two rows at a time, each into its own accumulator (docs/cpu_attn.md).
template <class D>
bool has_e4m3_nan(D, const unsigned char* const* rows, int n, int d_size) {
  const hn::Repartition<std::uint8_t, D> du8;
  constexpr std::uint8_t kMagnitude = 0x7F;
  const auto magnitude = hn::Set(du8, kMagnitude);
  const int lanes = static_cast<int>(hn::Lanes(du8));
  // The largest magnitude field seen: 0x7F only where a value is the NaN code.
  const auto scan = [&](const unsigned char* row, int c, hn::Vec<decltype(du8)>& most) {
    most = hn::Max(most, hn::And(hn::LoadU(du8, row + c), magnitude));
  };
  auto most = hn::Zero(du8);
  auto most2 = hn::Zero(du8);
  int i = 0;
  for (; i + 1 < n; i += 2) {
    for (int c = 0; c < d_size; c += lanes) {
      scan(rows[i], c, most);
      scan(rows[i + 1], c, most2);
    }
  }
  for (; i < n; ++i) {
    for (int c = 0; c < d_size; c += lanes) scan(rows[i], c, most);
  }
  return !hn::AllFalse(du8, hn::Eq(hn::Max(most, most2), magnitude));
}

// kQuads: the four-row tile (DecodeTiles::kChunkQuads, rows a multiple of four).
template <DType KV, bool kNanFree, bool kQuads, class D>
void tile_decode_rows(D d, const AttentionParams& p, const Scratch& sc, int rows, int t0, int n,
                      const unsigned char* const* k_rows, const unsigned char* const* v_rows,
                      const TilePrefetch& ahead, const TilePrefetch& far) {
  if constexpr (kQuads) {
    return tile_decode_quads<KV, kNanFree>(d, p, sc, rows, t0, n, k_rows, v_rows, ahead, far);
  }
  const int d_size = p.head_size;
  // The first row block's loops prefetch the next tile (scores) and the far one (P V).
  const auto block_ahead = [&](int first) { return first == 0 ? &ahead : nullptr; };
  const auto block_far = [&](int first) { return first == 0 ? &far : nullptr; };
  int r0 = 0;
  for (; r0 + kRowBlock <= rows; r0 += kRowBlock) {
    scores_decode<KV, kNanFree, kRowBlock>(d, sc, r0, d_size, n, k_rows, block_ahead(r0));
  }
  if (rows - r0 >= 2) scores_decode<KV, kNanFree, 2>(d, sc, r0, d_size, n, k_rows, block_ahead(r0));
  if ((rows - r0) % 2 == 1)
    scores_decode<KV, kNanFree, 1>(d, sc, rows - 1, d_size, n, k_rows, block_ahead(rows - 1));
  softmax_tile(d, p, sc, rows, t0, n, kChunkRescale<KV>);
  const auto row_major = [&](int first) { return ProbLayout{sc.s + first * kTileKeys}; };
  for (r0 = 0; r0 + kRowBlock <= rows; r0 += kRowBlock) {
    pv_decode_block<KV, kNanFree, kRowBlock>(d, sc, r0, d_size, n, v_rows, row_major(r0), block_far(r0));
  }
  if (rows - r0 >= 2)
    pv_decode_block<KV, kNanFree, 2>(d, sc, r0, d_size, n, v_rows, row_major(r0), block_far(r0));
  if ((rows - r0) % 2 == 1) {
    pv_decode_block<KV, kNanFree, 1>(d, sc, rows - 1, d_size, n, v_rows, row_major(rows - 1),
                                     block_far(rows - 1));
  }
}

// One chunk tile: rows in blocks of four, then two, then
// one (or the four-row tile: kQuads). e4m3 tiles without the NaN code (nearly
// all) take the cheap conversion. `ahead` is prefetched into L1 from the score
// loop, `far` into L2 from the P V loop.
template <DType KV, bool kQuads, class D>
void tile_decode(D d, const AttentionParams& p, const Scratch& sc, int rows, int t0, int n,
                 const unsigned char* const* k_rows, const unsigned char* const* v_rows,
                 const TilePrefetch& ahead, const TilePrefetch& far) {
  // HWY_SCALAR has no byte vector wider than its one float lane to scan with.
  if constexpr (KV == DType::FP8_E4M3 && kTarget.byte_vectors) {
    const hn::Repartition<std::uint8_t, D> du8;
    if (p.head_size % static_cast<int>(hn::Lanes(du8)) == 0 && !has_e4m3_nan(d, k_rows, n, p.head_size) &&
        !has_e4m3_nan(d, v_rows, n, p.head_size)) {
      return tile_decode_rows<KV, true, kQuads>(d, p, sc, rows, t0, n, k_rows, v_rows, ahead, far);
    }
  }
  tile_decode_rows<KV, false, kQuads>(d, p, sc, rows, t0, n, k_rows, v_rows, ahead, far);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // PAGEDATTN_CPU_ATTN_DECODE_TILES_INL_H_
