// The AVX512-BF16 decode tiles' K/V reads (cpu_attn_decode_tiles_avx512-inl.h):
// bf16 or e4m3 K and V chunks as bf16 vectors, e4m3 through two byte-table
// lookups, the head-dimension orders those reads leave (the key and P V slot
// orders) and the moves of the queries and accumulators into and out of
// them. Highway per-target header; only the AVX3 pass compiles anything.
#if defined(PAGEDATTN_CPU_ATTN_DECODE_CONVERT_AVX512_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEDATTN_CPU_ATTN_DECODE_CONVERT_AVX512_INL_H_
#undef PAGEDATTN_CPU_ATTN_DECODE_CONVERT_AVX512_INL_H_
#else
#define PAGEDATTN_CPU_ATTN_DECODE_CONVERT_AVX512_INL_H_
#endif

#include <hwy/highway.h>

#include "backends/cpu_attn/kernels/cpu_attn_avx512-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_common-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
#if HWY_TARGET == HWY_AVX3

// The decode tiles' instructions: vdpbf16ps and the e4m3 lookups' vpermi2b
// (AVX512-VBMI: every AVX512-BF16 CPU the dispatch admits has it).
#define PAGEDATTN_DECODE_TARGET __attribute__((target("avx512bf16,avx512vbmi")))

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
// load_kv's half reading, so every path of an item and the merge share one
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

PAGEDATTN_DECODE_TARGET HWY_INLINE E4M3Regs load_e4m3_regs() {
  constexpr int kSignBit = 0x80;
  constexpr int kSecondHalf = kE4M3Magnitudes / 2;
  return E4M3Regs{_mm512_load_si512(kE4M3Tables.hi), _mm512_load_si512(kE4M3Tables.hi + kSecondHalf),
                  _mm512_load_si512(kE4M3Tables.lo), _mm512_load_si512(kE4M3Tables.lo + kSecondHalf),
                  _mm512_set1_epi8(static_cast<char>(kSignBit))};
}

// The bf16 low and high bytes of 64 e4m3 values x, byte for byte.
PAGEDATTN_DECODE_TARGET HWY_INLINE void e4m3_bf16_bytes(__m512i x, const E4M3Regs& t, __m512i& lo,
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

// Head dimensions of one kDecodeChunk chunk of a K row as load_key_chunk_bf16
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
PAGEDATTN_DECODE_TARGET HWY_INLINE void load_key_chunk_bf16(const unsigned char* p, const E4M3Regs& t,
                                                            __m512i& out0, __m512i& out1) {
  if constexpr (KV == DType::BF16) {
    static_cast<void>(t);
    out0 = _mm512_loadu_si512(p);
    out1 = _mm512_loadu_si512(p + kBf16PerVector * sizeof(std::uint16_t));
  } else {
    static_assert(KV == DType::FP8_E4M3, "decode dot path: bf16 or e4m3 K/V");
    __m512i lo, hi;
    e4m3_bf16_bytes(_mm512_loadu_si512(p), t, lo, hi);
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
static_assert(key_slots_are_lane_moves(), "queries_to_key_slot_order's shuffles follow e4m3_key_slot_dim");

// Puts each bf16 query row of q [rows, d_size] into the key slot order of KV.
template <DType KV>
PAGEDATTN_DECODE_TARGET void queries_to_key_slot_order(std::uint16_t* q, int rows, int d_size) {
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
// vpunpck{l,h}wd measured slower for bf16). e4m3: after pairing
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
static_assert(pv_slots_are_lane_transpose(), "acc_to_head_order's transposition follows pv_slot_dim");

// Puts each accumulator row of acc [rows, d_size] from slot order back into
// head order.
template <DType KV>
PAGEDATTN_DECODE_TARGET void acc_to_head_order(float* acc, int rows, int d_size) {
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
PAGEDATTN_DECODE_TARGET HWY_INLINE void pair_value_chunk(const unsigned char* a, const unsigned char* b,
                                                         const E4M3Regs& t, __m512i x[kPairVectors]) {
  if constexpr (KV == DType::BF16) {
    static_cast<void>(t);
    const __m512i a0 = _mm512_loadu_si512(a);
    const __m512i a1 = _mm512_loadu_si512(a + kBf16PerVector * sizeof(std::uint16_t));
    const __m512i b0 = kSecondKey ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
    const __m512i b1 =
        kSecondKey ? _mm512_loadu_si512(b + kBf16PerVector * sizeof(std::uint16_t)) : _mm512_setzero_si512();
    const __m512i lo = key_pair_index();
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
    e4m3_bf16_bytes(_mm512_unpacklo_epi8(va, vb), t, lo0, hi0);
    e4m3_bf16_bytes(_mm512_unpackhi_epi8(va, vb), t, lo1, hi1);
    x[0] = _mm512_unpacklo_epi8(lo0, hi0);
    x[1] = _mm512_unpackhi_epi8(lo0, hi0);
    x[2] = _mm512_unpacklo_epi8(lo1, hi1);
    x[3] = _mm512_unpackhi_epi8(lo1, hi1);
  }
}

#endif  // HWY_TARGET == HWY_AVX3
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // PAGEDATTN_CPU_ATTN_DECODE_CONVERT_AVX512_INL_H_
