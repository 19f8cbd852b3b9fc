// AVX-512 specializations of the CPU_ATTN kernel: the fp32 rowwise decode
// scores with one joint reduction per four rows, and the AVX512-BF16 prefill
// and decode paths (vdpbf16ps). Part of cpu_attn_kernel.cpp's per-target body:
// that file includes this one inside its Highway target namespace once per
// compiled target (no include guard on purpose) after the element access and
// tile helpers it uses; only the AVX3 pass compiles anything.

#if HWY_TARGET == HWY_AVX3
// ---- AVX-512 specializations ---------------------------------------------------
// The AVX512-BF16 path (Isa::Avx512Bf16, prefill tiles with bf16 queries and
// keys): scores with vdpbf16ps, which multiplies bf16 pairs exactly and
// accumulates in fp32 (equal to the fp32 path up to summation order), and P V
// with probabilities rounded to bf16. Compiled with the extra target flag and
// only called when the CPU has it (cpu_attn_dispatch.cpp).
#define PAGEDATTN_BF16_TARGET __attribute__((target("avx512bf16")))

// Bf16 elements per 512-bit vector.
constexpr int kBf16PerVector = 32;

// Sums of four vectors: lane r of the result is the sum of a[r].
HWY_INLINE __m128 Reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Stores the four row sums into column i of the score tile (rows r0..r0+rb).
HWY_INLINE void StoreRowScores(const Scratch& sc, int r0, int rb, int i, __m128 sums) {
  alignas(16) float v[kRowBlock];
  _mm_store_ps(v, sums);
  for (int r = 0; r < rb; ++r) sc.s[(r0 + r) * kTileKeys + i] = v[r];
}

// Rowwise scores with one joint reduction per four rows (fp32 FMA, any KV type;
// head size a multiple of 16).
template <DType KV>
void ScoresRowwiseAvx3(const Scratch& sc, int rows, int d_size, int n, const unsigned char* const* k_rows) {
  const hn::ScalableTag<float> d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const auto esize = static_cast<int>(dtype_size(KV));
  for (int i = 0; i < n; ++i) {
    for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int rb = std::min(kRowBlock, rows - r0);
      // Missing rows of a partial block reuse row r0 and are not stored.
      const float* q[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) q[r] = sc.q + (r0 + (r < rb ? r : 0)) * d_size;
      hn::Vec<decltype(d)> a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
      for (int c = 0; c < d_size; c += lanes) {
        const auto k = LoadKV<KV>(d, k_rows[i] + c * esize);
        a0 = hn::MulAdd(hn::Load(d, q[0] + c), k, a0);
        a1 = hn::MulAdd(hn::Load(d, q[1] + c), k, a1);
        a2 = hn::MulAdd(hn::Load(d, q[2] + c), k, a2);
        a3 = hn::MulAdd(hn::Load(d, q[3] + c), k, a3);
      }
      StoreRowScores(sc, r0, rb, i, Reduce4(a0.raw, a1.raw, a2.raw, a3.raw));
    }
  }
}

// Copies the bf16 query rows (unscaled) into the scratch as raw bits.
void LoadQueriesBf16(const AttentionParams& p, const WorkItem& item, const ItemShape& shape, std::uint16_t* q) {
  const int d_size = p.head_size;
  for (int r = 0; r < shape.rows; ++r) {
    const int token = shape.first_token + item.q_begin + r / shape.group;
    const int head = item.kv_head * shape.group + r % shape.group;
    const unsigned char* src =
        element(p.query.data, token * p.query.row_stride + head * p.query.head_stride, DType::BF16);
    std::memcpy(q + static_cast<std::size_t>(r) * d_size, src, static_cast<std::size_t>(d_size) * sizeof(std::uint16_t));
  }
}

constexpr int kFloatsPerVector = 16;

// Transposed bf16 dot-product scores (prefills): the K tile is packed as bf16
// pairs [D / 2, kTileKeys] so one broadcast query pair meets 16 keys.
constexpr int kDotRowBlock = 8;     // 8 rows x 2 key vectors = 16 accumulators
constexpr int kDotKeyVectors = 2;   // key vectors per pass over the head dimension
constexpr int kDotPassKeys = kDotKeyVectors * kFloatsPerVector;
static_assert(kTileKeys % kDotPassKeys == 0, "score passes tile the key tile");
PAGEDATTN_BF16_TARGET void ScoresTransposedBf16(const Scratch& sc, int rows, int d_size, int n,
                                                const unsigned char* const* k_rows, float scale) {
  const int pairs = d_size / 2;
  auto* kt = reinterpret_cast<std::uint32_t*>(sc.kt);
  for (int i = 0; i < kTileKeys; ++i) {
    if (i < n) {
      const auto* row = reinterpret_cast<const std::uint32_t*>(k_rows[i]);
      for (int e = 0; e < pairs; ++e) kt[e * kTileKeys + i] = row[e];
    } else {
      for (int e = 0; e < pairs; ++e) kt[e * kTileKeys + i] = 0;
    }
  }
  const auto* q32 = reinterpret_cast<const std::uint32_t*>(sc.q);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r0 = 0; r0 < rows; r0 += kDotRowBlock) {
    const int rb = std::min(kDotRowBlock, rows - r0);
    const std::uint32_t* q[kDotRowBlock];
    for (int r = 0; r < kDotRowBlock; ++r) q[r] = q32 + (r0 + (r < rb ? r : 0)) * pairs;
    for (int i0 = 0; i0 < kTileKeys; i0 += kDotPassKeys) {
      __m512 acc[kDotRowBlock][kDotKeyVectors];
      for (int r = 0; r < kDotRowBlock; ++r) {
        for (int v = 0; v < kDotKeyVectors; ++v) acc[r][v] = _mm512_setzero_ps();
      }
      for (int e = 0; e < pairs; ++e) {
        __m512bh k[kDotKeyVectors];
        for (int v = 0; v < kDotKeyVectors; ++v)
          k[v] = (__m512bh)_mm512_load_si512(kt + e * kTileKeys + i0 + v * kFloatsPerVector);
        for (int r = 0; r < kDotRowBlock; ++r) {
          const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][e]));
          for (int v = 0; v < kDotKeyVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qv, k[v]);
        }
      }
      for (int r = 0; r < rb; ++r) {
        float* out = sc.s + (r0 + r) * kTileKeys + i0;
        for (int v = 0; v < kDotKeyVectors; ++v)
          _mm512_store_ps(out + v * kFloatsPerVector, _mm512_mul_ps(acc[r][v], vscale));
      }
    }
  }
}

// vpermt2w indices that interleave words 0-15 of two vectors a, b into
// (a[i], b[i]) pairs; plus 16, words 16-31.
HWY_INLINE __m512i KeyPairIndex() {
  return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                          36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
}

// P V with vdpbf16ps for a bf16 V tile (prefills): V is packed as bf16 pairs
// of consecutive keys [kTileKeys / 2, D] and each row's probabilities are
// rounded to bf16 pairs, as FlashAttention does; half the instructions of the
// fp32 loop. Rows in pairs x kPvVectors vectors (16 accumulators); d_size a
// multiple of kPvVectors * 16.
constexpr int kPvVectors = 8;
// A row's probabilities as bf16 pairs overwrite the first half of its own row
// of the score tile: their size follows the rows, as the score tile's does
// (the [D, kTileKeys] K tile buffer holds only 2 D rows of them).
HWY_INLINE std::uint32_t* ProbPairsRow(const Scratch& sc, int r) {
  return reinterpret_cast<std::uint32_t*>(sc.s + static_cast<std::size_t>(r) * kTileKeys);
}
PAGEDATTN_BF16_TARGET void AccumulatePvBf16(const Scratch& sc, int rows, int d_size, int n,
                                            const unsigned char* const* v_rows) {
  // Pack: pair j holds keys 2j and 2j + 1 (a missing key reads as zero).
  auto* vp = reinterpret_cast<std::uint16_t*>(sc.vf);  // [kTileKeys / 2, D, 2]
  const __m512i lo_idx = KeyPairIndex();
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(kFloatsPerVector));
  const int pairs = (n + 1) / 2;
  for (int j = 0; j < pairs; ++j) {
    const unsigned char* a = v_rows[2 * j];
    const bool has_b = 2 * j + 1 < n;
    for (int c = 0; c < d_size; c += kBf16PerVector) {
      const __m512i va = _mm512_loadu_si512(a + c * sizeof(std::uint16_t));
      const __m512i vb = has_b ? _mm512_loadu_si512(v_rows[2 * j + 1] + c * sizeof(std::uint16_t)) : _mm512_setzero_si512();
      std::uint16_t* dst = vp + (static_cast<std::size_t>(j) * d_size + c) * 2;
      _mm512_store_si512(dst, _mm512_permutex2var_epi16(va, lo_idx, vb));
      _mm512_store_si512(dst + kBf16PerVector, _mm512_permutex2var_epi16(va, hi_idx, vb));
    }
  }
  // Probabilities as bf16 pairs, in place: each store lands on floats its
  // loads (this step's or an earlier one's) already read.
  for (int r = 0; r < rows; ++r) {
    const float* prob = sc.s + r * kTileKeys;
    std::uint32_t* pairs_row = ProbPairsRow(sc, r);
    for (int i = 0; i < kTileKeys; i += 2 * kFloatsPerVector) {
      const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_load_ps(prob + i + kFloatsPerVector), _mm512_load_ps(prob + i));
      _mm512_store_si512(pairs_row + i / 2, (__m512i)packed);
    }
  }
  for (int r0 = 0; r0 < rows; r0 += 2) {
    const int r1 = std::min(r0 + 1, rows - 1);  // an odd last row is computed twice, stored once
    float* a0 = sc.acc + r0 * d_size;
    float* a1 = sc.acc + r1 * d_size;
    const std::uint32_t* p0 = ProbPairsRow(sc, r0);
    const std::uint32_t* p1 = ProbPairsRow(sc, r1);
    const __m512 alpha0 = _mm512_set1_ps(sc.alpha[r0]);
    const __m512 alpha1 = _mm512_set1_ps(sc.alpha[r1]);
    for (int c0 = 0; c0 < d_size; c0 += kPvVectors * kFloatsPerVector) {
      __m512 acc0[kPvVectors];
      __m512 acc1[kPvVectors];
      for (int v = 0; v < kPvVectors; ++v) {
        acc0[v] = _mm512_mul_ps(_mm512_load_ps(a0 + c0 + v * kFloatsPerVector), alpha0);
        acc1[v] = _mm512_mul_ps(_mm512_load_ps(a1 + c0 + v * kFloatsPerVector), alpha1);
      }
      for (int j = 0; j < pairs; ++j) {
        const __m512bh b0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(p0[j]));
        const __m512bh b1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(p1[j]));
        const std::uint16_t* vrow = vp + (static_cast<std::size_t>(j) * d_size + c0) * 2;
        for (int v = 0; v < kPvVectors; ++v) {
          const __m512bh x = (__m512bh)_mm512_load_si512(vrow + v * kBf16PerVector);
          acc0[v] = _mm512_dpbf16_ps(acc0[v], b0, x);
          acc1[v] = _mm512_dpbf16_ps(acc1[v], b1, x);
        }
      }
      for (int v = 0; v < kPvVectors; ++v) {
        _mm512_store_ps(a0 + c0 + v * kFloatsPerVector, acc0[v]);
        if (r1 != r0) _mm512_store_ps(a1 + c0 + v * kFloatsPerVector, acc1[v]);
      }
    }
  }
}

// ---- AVX512-BF16 decode path ---------------------------------------------------
// Decodes (few rows) with bf16 queries and bf16 or e4m3 K/V: scores and P V
// with vdpbf16ps, so one instruction does 32 multiply-adds where the fp32
// rowwise loop did 16 plus a widening of K/V (docs/perf.md, attempt 13). e4m3
// becomes bf16 through two byte-table lookups (vpermi2b, AVX512-VBMI: every
// AVX512-BF16 CPU the dispatch admits has it), so fp8 costs the bf16 loop plus
// a few instructions per 64 values while reading half the bytes. The e4m3
// bytes are interleaved with in-lane unpacks, which Zen 4 issues beside
// vdpbf16ps where the cross-lane vpermt2b competes with it (attempt 43); the
// head dimensions then come in a permuted order, which the queries and the
// P V accumulators follow (e4m3_key_slot_dim, pv_slot_dim).
#define PAGEDATTN_DECODE_TARGET __attribute__((target("avx512bf16,avx512vbmi")))

// The K/V types the path reads.
template <DType KV>
constexpr bool kDecodeDotKV = KV == DType::BF16 || KV == DType::FP8_E4M3;

// K/V values one decode step converts: one 64-byte e4m3 load, two bf16 vectors.
constexpr int kDecodeChunk = kDecodeDotChunk;
// e4m3 magnitudes (7 bits) and the bf16 table built from them.
constexpr int kE4M3Magnitudes = 128;
constexpr std::uint16_t kE4M3NanMagnitude = 0x7F;
constexpr std::uint16_t kBf16QuietNan = 0x7FC0;
constexpr int kBf16MantissaBits = 7;
// bf16 exponent field of 2^-17, the smallest e4m3 subnormal (2^-9) over
// kE4M3HalfRescale; a normal e4m3 exponent e maps to this + 2 + e.
constexpr int kE4M3SubnormalBf16Exponent = 110;

// Bf16 bits of (e4m3 magnitude x) / kE4M3HalfRescale: the same 2^-8 offset as
// LoadKV's half reading, so every path of an item and the merge share one
// rescale. Exact (e4m3 has 3 mantissa bits); the NaN code stays NaN.
constexpr std::uint16_t e4m3_magnitude_bf16(int x) {
  constexpr int kE4M3MantissaBits = 3;
  const int e = x >> kE4M3MantissaBits;
  const int m = x & ((1 << kE4M3MantissaBits) - 1);
  if (x == kE4M3NanMagnitude) return kBf16QuietNan;
  if (e != 0) {
    return static_cast<std::uint16_t>(((kE4M3SubnormalBf16Exponent + 2 + e) << kBf16MantissaBits) |
                                      (m << (kBf16MantissaBits - kE4M3MantissaBits)));
  }
  if (m == 0) return 0;
  const int top = m >= 4 ? 2 : (m >= 2 ? 1 : 0);  // highest set bit of the subnormal mantissa
  return static_cast<std::uint16_t>(((kE4M3SubnormalBf16Exponent + top) << kBf16MantissaBits) |
                                    ((m - (1 << top)) << (kBf16MantissaBits - top)));
}

struct E4M3ByteTables {
  alignas(64) std::uint8_t hi[kE4M3Magnitudes];  // high byte of the bf16 (sign clear)
  alignas(64) std::uint8_t lo[kE4M3Magnitudes];  // low byte
};

constexpr E4M3ByteTables make_e4m3_tables() {
  E4M3ByteTables t{};
  for (int x = 0; x < kE4M3Magnitudes; ++x) {
    t.hi[x] = static_cast<std::uint8_t>(e4m3_magnitude_bf16(x) >> 8);
    t.lo[x] = static_cast<std::uint8_t>(e4m3_magnitude_bf16(x) & 0xFF);
  }
  return t;
}
constexpr E4M3ByteTables kE4M3Tables = make_e4m3_tables();

// The lookup tables, loaded into registers once per tile.
struct E4M3Regs {
  __m512i hi0, hi1, lo0, lo1, sign;
};

PAGEDATTN_DECODE_TARGET HWY_INLINE E4M3Regs LoadE4M3Regs() {
  constexpr int kSignBit = 0x80;
  constexpr int kSecondHalf = kE4M3Magnitudes / 2;
  return E4M3Regs{_mm512_load_si512(kE4M3Tables.hi), _mm512_load_si512(kE4M3Tables.hi + kSecondHalf),
                  _mm512_load_si512(kE4M3Tables.lo), _mm512_load_si512(kE4M3Tables.lo + kSecondHalf),
                  _mm512_set1_epi8(static_cast<char>(kSignBit))};
}

// The bf16 low and high bytes of 64 e4m3 values x, byte for byte.
PAGEDATTN_DECODE_TARGET HWY_INLINE void E4M3Bf16Bytes(__m512i x, const E4M3Regs& t, __m512i& lo,
                                                      __m512i& hi) {
  constexpr int kHiOrSign = 0xF8;  // ternary logic: A | (B & C)
  // The tables index with bits 0-6 (vpermi2b ignores bit 7); the sign bit is copied over.
  hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, x, t.hi1), x, t.sign, kHiOrSign);
  lo = _mm512_permutex2var_epi8(t.lo0, x, t.lo1);
}

// The 128-bit lanes the decode path's in-lane unpacks and lane shuffles work on.
constexpr int kLanesPerVector = 4;  // 128-bit lanes of a zmm
constexpr int kBytesPerLane = 16;
constexpr int kBf16PerLane = 8;
constexpr int kFloatsPerLane = 4;

// Head dimensions of one kDecodeChunk chunk of a K row as LoadKeyChunkBf16
// returns it: slot s (0-31 in out0, 32-63 in out1) holds dimension
// e4m3_key_slot_dim(s) for e4m3 keys (vpunpck{l,h}bw pair each 128-bit lane's
// first / last 8 bytes), dimension s for bf16 ones.
constexpr int e4m3_key_slot_dim(int s) {
  const int vector = s / kBf16PerVector;
  const int lane = s % kBf16PerVector / kBf16PerLane;
  return lane * kBytesPerLane + vector * kBf16PerLane + s % kBf16PerLane;
}

// kDecodeChunk values of a K row as bf16 (two vectors), in slot order.
template <DType KV>
PAGEDATTN_DECODE_TARGET HWY_INLINE void LoadKeyChunkBf16(const unsigned char* p, const E4M3Regs& t,
                                                         __m512i& out0, __m512i& out1) {
  if constexpr (KV == DType::BF16) {
    static_cast<void>(t);
    out0 = _mm512_loadu_si512(p);
    out1 = _mm512_loadu_si512(p + kBf16PerVector * sizeof(std::uint16_t));
  } else {
    static_assert(KV == DType::FP8_E4M3, "decode dot path: bf16 or e4m3 K/V");
    __m512i lo, hi;
    E4M3Bf16Bytes(_mm512_loadu_si512(p), t, lo, hi);
    out0 = _mm512_unpacklo_epi8(lo, hi);
    out1 = _mm512_unpackhi_epi8(lo, hi);
  }
}

// e4m3's key slot order moves whole 128-bit lanes (eight dimensions): slot
// vector v's lane l is lane 2 (l % 2) + v of the chunk's vector l / 2, so two
// lane shuffles per chunk put a query row in that order.
constexpr bool key_slots_are_lane_moves() {
  for (int s = 0; s < kDecodeChunk; ++s) {
    const int v = s / kBf16PerVector;
    const int l = s % kBf16PerVector / kBf16PerLane;
    const int source_lane = l / 2 * kLanesPerVector + l % 2 * 2 + v;  // of the chunk's eight
    if (e4m3_key_slot_dim(s) != source_lane * kBf16PerLane + s % kBf16PerLane) return false;
  }
  return true;
}
static_assert(key_slots_are_lane_moves(), "QueriesToKeySlotOrder's shuffles follow e4m3_key_slot_dim");

// Puts each bf16 query row of q [rows, d_size] into the key slot order of KV.
template <DType KV>
PAGEDATTN_DECODE_TARGET void QueriesToKeySlotOrder(std::uint16_t* q, int rows, int d_size) {
  if constexpr (KV == DType::FP8_E4M3) {
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < d_size; c += kDecodeChunk) {
        std::uint16_t* chunk = q + static_cast<std::size_t>(r) * d_size + c;
        const __m512i a = _mm512_loadu_si512(chunk);
        const __m512i b = _mm512_loadu_si512(chunk + kBf16PerVector);
        _mm512_storeu_si512(chunk, _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_si512(chunk + kBf16PerVector, _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
      }
    }
  } else {
    static_cast<void>(q), static_cast<void>(rows), static_cast<void>(d_size);
  }
}

// Head dimension of slot s of a kDecodeChunk chunk of a P V accumulator row.
// bf16: dimension s (vpermt2w pairs the keys in place; the in-lane
// vpunpck{l,h}wd measured slower for bf16, attempt 43). e4m3: after pairing
// the two rows' bytes, vpunpck{l,h}bw puts in 128-bit lane l of vector
// v = s / 16 the four key pairs of bytes 4v .. 4v + 3 of the 16-byte lane l.
template <DType KV>
constexpr int pv_slot_dim(int s) {
  if constexpr (KV == DType::BF16) {
    return s;
  } else {
    const int vector = s / kFloatsPerVector;
    const int lane = s % kFloatsPerVector / kFloatsPerLane;
    return lane * kBytesPerLane + vector * kFloatsPerLane + s % kFloatsPerLane;
  }
}

// e4m3's P V slot order is a 4 x 4 transposition of 128-bit lanes: slot
// vector v's lane l holds head dimensions [16 l + 4 v, +4), so head vector l
// gathers lane l of the four slot vectors.
constexpr bool pv_slots_are_lane_transpose() {
  for (int s = 0; s < kDecodeChunk; ++s) {
    const int v = s / kFloatsPerVector;
    const int l = s % kFloatsPerVector / kFloatsPerLane;
    if (pv_slot_dim<DType::FP8_E4M3>(s) != l * kFloatsPerVector + v * kFloatsPerLane + s % kFloatsPerLane)
      return false;
  }
  return true;
}
static_assert(pv_slots_are_lane_transpose(), "AccToHeadOrder's transposition follows pv_slot_dim");

// Puts each accumulator row of acc [rows, d_size] from slot order back into
// head order.
template <DType KV>
PAGEDATTN_DECODE_TARGET void AccToHeadOrder(float* acc, int rows, int d_size) {
  static_assert(kDecodeChunk == kLanesPerVector * kFloatsPerVector, "a chunk is four float vectors");
  if constexpr (KV == DType::FP8_E4M3) {
    constexpr int kLo = _MM_SHUFFLE(1, 0, 1, 0);
    constexpr int kHi = _MM_SHUFFLE(3, 2, 3, 2);
    constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0);
    constexpr int kOdd = _MM_SHUFFLE(3, 1, 3, 1);
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < d_size; c += kDecodeChunk) {
        float* chunk = acc + static_cast<std::size_t>(r) * d_size + c;
        __m512 x[kLanesPerVector];
        for (int v = 0; v < kLanesPerVector; ++v) x[v] = _mm512_loadu_ps(chunk + v * kFloatsPerVector);
        const __m512 t0 = _mm512_shuffle_f32x4(x[0], x[1], kLo);  // lanes 0, 1 of x0, x1
        const __m512 t1 = _mm512_shuffle_f32x4(x[2], x[3], kLo);
        const __m512 t2 = _mm512_shuffle_f32x4(x[0], x[1], kHi);  // lanes 2, 3 of x0, x1
        const __m512 t3 = _mm512_shuffle_f32x4(x[2], x[3], kHi);
        _mm512_storeu_ps(chunk, _mm512_shuffle_f32x4(t0, t1, kEven));
        _mm512_storeu_ps(chunk + kFloatsPerVector, _mm512_shuffle_f32x4(t0, t1, kOdd));
        _mm512_storeu_ps(chunk + 2 * kFloatsPerVector, _mm512_shuffle_f32x4(t2, t3, kEven));
        _mm512_storeu_ps(chunk + 3 * kFloatsPerVector, _mm512_shuffle_f32x4(t2, t3, kOdd));
      }
    }
  } else {
    static_cast<void>(acc), static_cast<void>(rows), static_cast<void>(d_size);
  }
}

// The V rows a (key 2j) and b (key 2j + 1; zeros without kSecondKey) of one
// chunk as vectors of bf16 key pairs, in slot order (pv_slot_dim).
constexpr int kPairVectors = kDecodeChunk / kFloatsPerVector;
template <DType KV, bool kSecondKey>
PAGEDATTN_DECODE_TARGET HWY_INLINE void PairValueChunk(const unsigned char* a, const unsigned char* b,
                                                       const E4M3Regs& t, __m512i x[kPairVectors]) {
  if constexpr (KV == DType::BF16) {
    static_cast<void>(t);
    const __m512i a0 = _mm512_loadu_si512(a);
    const __m512i a1 = _mm512_loadu_si512(a + kBf16PerVector * sizeof(std::uint16_t));
    const __m512i b0 = kSecondKey ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
    const __m512i b1 =
        kSecondKey ? _mm512_loadu_si512(b + kBf16PerVector * sizeof(std::uint16_t)) : _mm512_setzero_si512();
    const __m512i lo = KeyPairIndex();
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(kFloatsPerVector));
    x[0] = _mm512_permutex2var_epi16(a0, lo, b0);
    x[1] = _mm512_permutex2var_epi16(a0, hi, b0);
    x[2] = _mm512_permutex2var_epi16(a1, lo, b1);
    x[3] = _mm512_permutex2var_epi16(a1, hi, b1);
  } else {
    static_assert(KV == DType::FP8_E4M3, "decode dot path: bf16 or e4m3 K/V");
    // Pairing the bytes first converts the two rows in two lookups, not four.
    const __m512i va = _mm512_loadu_si512(a);
    const __m512i vb = kSecondKey ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
    __m512i lo0, hi0, lo1, hi1;
    E4M3Bf16Bytes(_mm512_unpacklo_epi8(va, vb), t, lo0, hi0);
    E4M3Bf16Bytes(_mm512_unpackhi_epi8(va, vb), t, lo1, hi1);
    x[0] = _mm512_unpacklo_epi8(lo0, hi0);
    x[1] = _mm512_unpackhi_epi8(lo0, hi0);
    x[2] = _mm512_unpacklo_epi8(lo1, hi1);
    x[3] = _mm512_unpackhi_epi8(lo1, hi1);
  }
}

// Keys per step of the decode score loop: four keys x four rows = 16
// accumulators, reduced together (one 128-bit lane per row) so a step ends in
// four vector stores instead of four reductions and 16 scalar stores.
constexpr int kDecodeKeyBlock = 4;

// Lane sums of a[0..3], partly folded: 128-bit lane l of the result holds
// partial sums of each a[r] in element r; the four lanes still add up.
HWY_INLINE __m512 Fold4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// The decode tiles' score layout: each block of kRowBlock rows holds one
// vector per score step, whose 128-bit lane r has row r's scores of the
// step's four keys, as the step's joint reduction leaves them (rows of a
// partial block repeat its first row). The softmax works on these vectors
// whole: each lane knows its row and key, so masks, row maxima and row sums
// need no pass per row.
static_assert(kRowBlock == kScoreRowBlock && kRowBlock * kDecodeKeyBlock == kFloatsPerVector,
              "a score step's sums fill one vector");
constexpr int kDecodeSteps = kTileKeys / kDecodeKeyBlock;
// The step of keys [i0, i0 + kDecodeKeyBlock) of the block of row r0 in
// sc.s: [rows / kRowBlock, kDecodeSteps, kRowBlock, kDecodeKeyBlock].
HWY_INLINE float* DecodeScoreStep(const Scratch& sc, int r0, int i0) {
  return sc.s + r0 * kTileKeys + i0 * kRowBlock;
}

// S = (Q K^T) * scale for a decode tile, four rows x four keys per step, in
// the layout above. Q holds the bf16 query rows (LoadQueriesBf16) in key slot
// order (QueriesToKeySlotOrder). Score columns past n get duplicates of a real
// key's scores; SoftmaxDecode masks them. The first row block's steps prefetch
// the tile ahead, a few keys per step.
template <DType KV>
PAGEDATTN_DECODE_TARGET void ScoresDecodeBf16(const Scratch& sc, int rows, int d_size, int n,
                                              const unsigned char* const* k_rows, float scale,
                                              const TilePrefetch& ahead) {
  static_assert(kTileKeys % kDecodeKeyBlock == 0, "key steps tile the score row");
  const E4M3Regs t = LoadE4M3Regs();
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
          LoadKeyChunkBf16<KV>(k[j] + c * esize, t, k0, k1);
          for (int r = 0; r < kRowBlock; ++r) {
            acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qv[r][0], (__m512bh)k0);
            acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qv[r][1], (__m512bh)k1);
          }
        }
      }
      // Row r's four key sums, folded to 128-bit lanes, then lane r of `sums`.
      __m512 f[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) f[r] = Fold4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      const __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(3, 2, 3, 2)));
      const __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(f[2], f[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_f32x4(f[2], f[3], _MM_SHUFFLE(3, 2, 3, 2)));
      const __m512 sums = _mm512_mul_ps(_mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(2, 0, 2, 0)),
                                                      _mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(3, 1, 3, 1))),
                                        vscale);
      _mm512_store_ps(DecodeScoreStep(sc, r0, i0), sums);
    }
  }
}

// Keys16-packed e4m3 K groups per pass of ScoresDecodePackedE4M3: each query
// pair is broadcast once for both (docs/perf.md, attempt 56).
constexpr int kPackedPassGroups = 2;
// Dimension quads between two prefetch calls of that pass.
constexpr int kPackedPrefetchQuads = 4;
static_assert(kPackedGroupElements == kLanesPerVector * kBytesPerLane, "a dimension quad of a group is one 64-byte load");
static_assert(kPackedKeyGroup == kFloatsPerVector && kPackedKeysPerLane == kDecodeKeyBlock,
              "a group's scores are one vector per row, a lane of it one score step");

// Scores of groups[0 .. kGroups) (keys key0 .. key0 + 16 kGroups of the tile)
// for the row block at r0, stored as DecodeScoreStep lays them out. Each
// quad's two unpacks leave 16 keys x one dimension pair per vector, so every
// row accumulates one vector per group and no lanes are reduced; a 4 x 4
// transposition of 128-bit lanes then gives the score steps. The pass
// prefetches the tile ahead's keys in proportion to its quads (rounded up:
// a few keys of the next pass may go twice).
template <int kGroups>
PAGEDATTN_DECODE_TARGET HWY_INLINE void ScoresPackedGroups(const Scratch& sc, int r0, const std::uint32_t* const* q,
                                                           int quads, int key0, const unsigned char* const* groups,
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
      E4M3Bf16Bytes(_mm512_loadu_si512(groups[u] + g * kPackedGroupElements), t, lo, hi);
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
    _mm512_store_ps(DecodeScoreStep(sc, r0, first), _mm512_shuffle_f32x4(t0, t1, kEven));
    _mm512_store_ps(DecodeScoreStep(sc, r0, first + kDecodeKeyBlock), _mm512_shuffle_f32x4(t0, t1, kOdd));
    _mm512_store_ps(DecodeScoreStep(sc, r0, first + 2 * kDecodeKeyBlock), _mm512_shuffle_f32x4(t2, t3, kEven));
    _mm512_store_ps(DecodeScoreStep(sc, r0, first + 3 * kDecodeKeyBlock), _mm512_shuffle_f32x4(t2, t3, kOdd));
  }
}

// S = (Q K^T) * scale for a decode tile of n keys whose first key starts a
// Keys16 group of an e4m3 cache (k_rows[16 j] is group j's first element), in
// the layout of ScoresDecodeBf16. Q holds the bf16 query rows in head order.
// A partial last group's missing keys get the scores of whatever their slots
// hold (inside the block), which SoftmaxDecode masks.
PAGEDATTN_DECODE_TARGET void ScoresDecodePackedE4M3(const Scratch& sc, int rows, int d_size, int n,
                                                    const unsigned char* const* k_rows, float scale,
                                                    const TilePrefetch& ahead) {
  const E4M3Regs t = LoadE4M3Regs();
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
      ScoresPackedGroups<kPackedPassGroups>(sc, r0, q, quads, j * kPackedKeyGroup, pass, vscale, t, pass_ahead);
    }
    if (j < groups) {
      const unsigned char* last = k_rows[j * kPackedKeyGroup];
      ScoresPackedGroups<1>(sc, r0, q, quads, j * kPackedKeyGroup, &last, vscale, t, pass_ahead);
    }
  }
}

// Vector lane i holds x[i / kDecodeKeyBlock] (x: one value per row of a block).
HWY_INLINE __m512 RowLanes(__m128 x) {
  const __m512i row_of_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(row_of_lane, _mm512_castps128_ps512(x));
}
HWY_INLINE __m512i RowLanes(__m128i x) { return _mm512_castps_si512(RowLanes(_mm_castsi128_ps(x))); }

// Lane r of the result: the value of row r (its first lane) in x.
HWY_INLINE __m128 RowValues(__m512 x) {
  const __m512i first_lane_of_row = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(first_lane_of_row, x));
}

// Max and sum of each 128-bit lane (one row's four keys), in all its elements.
HWY_INLINE __m512 RowMax(__m512 x) {
  x = _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_max_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
}
HWY_INLINE __m512 RowSum(__m512 x) {
  x = _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_add_ps(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
}

// Lane masks of whole rows: every lane of a row whose lanes have any bit set.
HWY_INLINE __mmask16 WholeRows(__mmask16 lanes) {
  constexpr unsigned kFirstLanes = 0x1111;  // lane 0 of each row
  constexpr unsigned kRowLanes = 0xF;
  unsigned m = lanes;
  m |= m >> 1;
  m |= m >> 2;
  return static_cast<__mmask16>((m & kFirstLanes) * kRowLanes);
}

// The probabilities of one row block as bf16 pairs of keys (2j, 2j + 1): dword
// DecodeProbIndex(j) + 2r holds row r's pair j (the order vcvtne2ps2bf16 gives
// two score-step vectors).
constexpr int kProbBlockDwords = kRowBlock * kTileKeys / 2;
// In the [D, kTileKeys] K tile buffer, which holds them: decode tiles have
// fewer than kTransposeMinRows rows and head sizes multiples of kDecodeChunk.
static_assert((kTransposeMinRows + kRowBlock - 1) / kRowBlock * kProbBlockDwords <= kDecodeChunk * kTileKeys,
              "a decode tile's probability blocks fit the K tile buffer");
HWY_INLINE std::uint32_t* DecodeProbBlock(const Scratch& sc, int r0) {
  return reinterpret_cast<std::uint32_t*>(sc.kt) + r0 / kRowBlock * kProbBlockDwords;
}
HWY_INLINE int DecodeProbIndex(int j) {
  constexpr int kStepsPerVector = 2;
  constexpr int kPairsPerVector = kStepsPerVector * kDecodeKeyBlock / 2;
  constexpr int kDwordsPerStep = kFloatsPerVector / 2;
  return j / kPairsPerVector * kFloatsPerVector + j / 2 % 2 * kDwordsPerStep + j % 2;
}

// Soft cap, ALiBi and masks on a decode tile's scores (DecodeScoreStep's
// layout), then the online-softmax update of each row block: P = exp(S - m_new)
// as bf16 pairs (DecodeProbBlock), l sums the unrounded P, alpha = exp(m_old -
// m_new). The same semantics as softmax_tile: a NaN visible score makes the
// row's alpha NaN; a row that sees no key of the tile keeps its state
// (alpha 1, or 0 while it has seen no key, its accumulator then being zero).
PAGEDATTN_DECODE_TARGET void SoftmaxDecode(const AttentionParams& p, const Scratch& sc, int rows, int t0,
                                           int n) {
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
    float* scores = DecodeScoreStep(sc, r0, 0);
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
      const LaneRows<D> lane_rows{{RowLanes(load_i32(lo_minus_one))},
                                  {RowLanes(load_i32(hi))},
                                  {RowLanes(_mm_load_ps(slope))},
                                  {RowLanes(_mm_load_ps(position))}};
      for (int i = 0; i < kDecodeSteps; ++i) {
        const auto key =
            hn::Add(hn::Vec512<std::int32_t>{key_of_lane}, hn::Set(di, t0 + i * kDecodeKeyBlock));
        sv[i] =
            mask_scores(d, modifiers, lane_rows, hn::Load(d, scores + i * kFloatsPerVector), key, nan).raw;
        vmax = _mm512_max_ps(vmax, sv[i]);
      }
    }
    const __m512 m_old = RowLanes(_mm_maskz_loadu_ps(real_rows, sc.m + r0));
    const __m512 m_new = _mm512_max_ps(RowMax(vmax), m_old);
    __m512 vsum = _mm512_setzero_ps();
    for (int i = 0; i < kDecodeSteps; ++i) {
      sv[i] = exp_avx512(_mm512_sub_ps(sv[i], m_new));  // exp(-inf) = 0 for masked keys
      vsum = _mm512_add_ps(vsum, sv[i]);
    }
    // exp_avx512 gives 0 for a NaN argument, so a NaN score has P = 0 (and
    // exp(-inf - -inf) is 0): a NaN alpha makes the row's accumulator and
    // sum NaN instead, as the oracle's are.
    const __m512 alpha = _mm512_mask_mov_ps(exp_avx512(_mm512_sub_ps(m_old, m_new)), WholeRows(nan.raw),
                                            _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    const __m512 l_old = RowLanes(_mm_maskz_loadu_ps(real_rows, sc.l + r0));
    const __m512 l_new = _mm512_add_ps(_mm512_mul_ps(l_old, alpha), RowSum(vsum));
    _mm_mask_storeu_ps(sc.m + r0, real_rows, RowValues(m_new));
    _mm_mask_storeu_ps(sc.l + r0, real_rows, RowValues(l_new));
    _mm_mask_storeu_ps(sc.alpha + r0, real_rows, RowValues(alpha));
    std::uint32_t* prob = DecodeProbBlock(sc, r0);
    for (int i = 0; i < kDecodeSteps; i += 2) {
      const __m512bh packed = _mm512_cvtne2ps_pbh(sv[i + 1], sv[i]);
      _mm512_store_si512(prob + i / 2 * kFloatsPerVector, (__m512i)packed);
    }
  }
}

// acc = alpha * acc + P V for a decode tile, acc in slot order (pv_slot_dim):
// V rows interleaved in key pairs as they are read, probabilities as bf16
// pairs (SoftmaxDecode; as the prefill path, AccumulatePvBf16). Four rows x four vectors
// (16 accumulators) per pass over kDecodeChunk columns. The first row block's
// passes prefetch the `far` unit's K and V into L2, the columns and keys each
// pass reads.
template <DType KV>
PAGEDATTN_DECODE_TARGET void AccumulatePvDecodeBf16(const Scratch& sc, int rows, int d_size, int n,
                                                    const unsigned char* const* v_rows,
                                                    const TilePrefetch& far) {
  constexpr int kVectors = kPairVectors;
  const E4M3Regs t = LoadE4M3Regs();
  const auto esize = static_cast<int>(dtype_size(KV));
  constexpr int kChunkLines = kDecodeChunk * static_cast<int>(dtype_size(KV)) / kCacheLine;
  const int whole_pairs = n / 2;
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int rb = std::min(kRowBlock, rows - r0);
    const std::uint32_t* prob = DecodeProbBlock(sc, r0);
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
        PairValueChunk<KV, decltype(second_key)::value>(
            v_rows[2 * j] + c0 * esize, second_key ? v_rows[2 * j + 1] + c0 * esize : nullptr, t, x);
        const std::uint32_t* prob_j = prob + DecodeProbIndex(j);
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
#endif  // HWY_TARGET == HWY_AVX3
