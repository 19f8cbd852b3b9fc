// The CUDA_FLASH attention kernel: FlashAttention-2 style online softmax on
// tensor cores over a paged KV cache, for a mixed batch in one launch.
//
// A CTA (4 warps) takes work items from the uploaded work list; its KV head
// is blockIdx.x % num_kv_heads. All query heads of that KV head are packed
// into the rows of one MMA tile (row = token * group + head_in_group), so
// each K/V tile is read once per group. Prefill items give each warp 16 rows;
// decode items give all warps the same 16 rows and split every key tile between the warps, whose
// partial softmax states are merged in shared memory at the end. Items of a
// split group, and every item of a cascade plan, write normalized partial
// outputs plus their LSE, merged by combine_kernel.
#pragma once

#include <math_constants.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "flash_params.h"
#include "flash_pass.cuh"
#include "flash_primitives.cuh"
#include "instantiations.h"

namespace pagedattn::cuda_flash::detail {

inline constexpr int kSmemPad = 8;  // elements per row: ldmatrix rows land on distinct banks

// kFp8: the cache holds 8-bit values (fp8, or int8 of a per-token-head
// cache), staged raw in shared memory and converted to f16 in registers as
// the MMA fragments are read (its own instantiation: a different
// shared-memory layout and pipeline, and the 16-bit kernel keeps its
// registers for two M-tiles). Per-token-head scales ride along in a ring of
// their own.
template <int kHeadClass, bool kFp8>
struct Shape {
  static constexpr int kD = kHeadClass;
  static constexpr int kStride = kD + kSmemPad;
  // 16-bit K/V: double-buffer the tiles when both stages fit beside the other
  // CTA of the SM. fp8: a ring of raw tiles (half the bytes each), three deep,
  // read by ldmatrix and converted in registers.
  static constexpr int kStages = kD <= 128 && !kFp8 ? 2 : 1;
  static constexpr int kRawStages = 3;  // fp8 only
  // Raw rows padded by 16 bytes: the 8 rows an ldmatrix reads land on 8
  // distinct groups of 4 banks.
  static constexpr int kRawStride = kD + 16;
  static constexpr int kRawTileBytes = kBlockN * kRawStride;  // one raw K or V tile
  // Per-token-head scales of a raw stage: kBlockN K scales, then kBlockN V
  // scales, after the raw tiles; each run's are 16-byte aligned
  // (copy_token_scales).
  static constexpr int kScaleStageFloats = 2 * kBlockN;
  // 16-row MMA tiles per warp in a prefill pass: two share every K/V fragment
  // loaded from shared memory (half the shared-memory reads per MMA); the
  // largest class and the fp8 kernels have no registers for a second one.
  static constexpr int kPrefillMTiles = kD <= 128 && !kFp8 ? 2 : 1;
  static constexpr int kPassRows = kWarps * kMmaRows * kPrefillMTiles;  // prefill rows per pass
  static_assert(kPrefillRows % kPassRows == 0, "a prefill item is a whole number of passes");
  static constexpr int kDTiles = kD / 8;
  static constexpr int kChunks = kD / kChunkElems;
  static constexpr int kTileElems = kBlockN * kStride;  // one K or V tile
  static constexpr int kKVStageBytes = 2 * kTileElems * 2;  // a 16-bit K and V tile
  static constexpr int kKVBytes =
      kFp8 ? kRawStages * (2 * kRawTileBytes + kScaleStageFloats * 4) : kStages * kKVStageBytes;
  // Each thread copies one fixed 8-element column (tid % kChunks) of a run of
  // kKeysPerThread consecutive keys of a tile (run tid / kChunks).
  static constexpr int kKeysPerThread = kBlockN * kChunks / kThreads;
  static_assert(kThreads % kChunks == 0, "a thread's column must not change between its keys");
  static_assert(kRawStages * 2 * kRawTileBytes % kScaleChunkBytes == 0 &&
                    kKeysPerThread % kScaleChunkKeys == 0 && kBlockN % kScaleChunkKeys == 0,
                "per-token-head scale chunks are 16-byte aligned in shared memory");
};

// Shared memory of a kernel: the query rows of a pass, then the K/V tiles,
// which the fp32 O stage of the pass's rows (every warp's 16 rows in decode
// passes) reuses, then (m, l) per stage row. kDecodeOnly kernels hold 16
// query rows instead of a prefill pass.
template <int kHeadClass, bool kFp8, bool kDecodeOnly>
struct SmemLayout {
  using S = Shape<kHeadClass, kFp8>;
  // K/V buffers a decode pass's warps ring through (run_pass): the 16-bit
  // decode-only kernels hold kDecodeOnlyStages 64-key tiles.
  static constexpr int kDecodeRing = kFp8 ? S::kRawStages : (kDecodeOnly ? kDecodeOnlyStages : S::kStages);
  // Decode passes copy fp8 rows 16 values at a time (run_pass's kWideRaw).
  static constexpr bool kWideRaw = kDecodeOnly && kFp8 && has_wide_fp8_rows(kHeadClass);
  static constexpr int kKVBytes = kDecodeOnly && !kFp8 ? kDecodeOnlyStages * S::kKVStageBytes : S::kKVBytes;
  static constexpr int kQRows = kDecodeOnly ? kDecodeRows : S::kPassRows;
  static constexpr int kStageRows = kDecodeOnly ? kWarps * kMmaRows : S::kPassRows;
  static_assert(S::kPassRows >= kWarps * kMmaRows, "a prefill pass's stage holds every warp's decode rows");
  static constexpr int kQBytes = kQRows * S::kStride * 2;
  static constexpr int kStageBytes = kStageRows * kHeadClass * 4;
  static constexpr int kBodyBytes = kKVBytes > kStageBytes ? kKVBytes : kStageBytes;
  static constexpr int kMLBytes = kStageRows * 2 * 4;
  static constexpr int kSmemBytes = kQBytes + kBodyBytes + kMLBytes;
};

struct SmemPtrs {
  void* q;
  void* kv;
  float* stage;
  float* ml;
};

// Calls f(std::true_type) when the head size fills its class (no padded MMA
// steps to test for), else f(std::false_type).
template <typename F>
__device__ __forceinline__ void with_full_head(bool full, F&& f) {
  if (full) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// One pass: up to kRows packed query rows of an item against its key range.
// TIO: the query and output dtype. The tensor cores run on Compute<TIO, kFp8>
// (flash_pass.cuh) for both MMAs: bf16 queries against fp8 K/V are converted
// to f16 once per pass, scaled by a power of two that keeps them below the
// f16 maximum (folded back into the score scale).

inline constexpr unsigned kBf16AbsMask = 0x7FFF;
inline constexpr unsigned kBf16Inf = 0x7F80;  // the smallest non-finite magnitude pattern
inline constexpr int kBf16ExpShift = 7;
// bf16 exponent field of [2^15, 2^16): every bf16 there is below the f16
// maximum 65504, every larger one is not.
inline constexpr int kBf16LargestF16Exp = 142;

// Magnitude bit pattern of a bf16 (low 16 bits of `bits`); 0 for inf and NaN,
// which convert to inf and NaN as they are and must not scale the rest.
__device__ __forceinline__ unsigned bf16_finite_abs(unsigned bits) {
  const unsigned a = bits & kBf16AbsMask;
  return a < kBf16Inf ? a : 0u;
}

// The power-of-two exponent that brings finite bf16 magnitudes up to the
// pattern `abs_bits` below the f16 maximum (0 when they fit).
__device__ __forceinline__ int f16_range_shift(unsigned abs_bits) {
  const int e = static_cast<int>(abs_bits >> kBf16ExpShift);
  return e <= kBf16LargestF16Exp ? 0 : e - kBf16LargestF16Exp;
}

// Shared-memory word (two f16) of the queries of an fp8 pass that holds dims
// d, d + 1 (d even) of pass row r. Each 16-row tile and 16-dim chunk is 32
// lanes x 4 words, a lane's 4 words its A operand in the order of the MMA:
// dims 4t, 4t + 1 of rows g and g + 8, then dims 4t + 2, 4t + 3 of both (the
// k positions 2t, 2t + 1, 2t + 8, 2t + 9 of the permuted chunk).
template <int kHC>
__device__ __forceinline__ int q_fragment_word(int r, int d) {
  const int tile = r / kMmaRows;
  const int rr = r % kMmaRows;
  const int within = d % 16;
  const int lane = (rr % 8) * 4 + within / 4;
  const int word = ((within % 4) / 2) * 2 + rr / 8;
  return ((tile * (kHC / 16) + d / 16) * 32 + lane) * 4 + word;
}

// Multiplies a warp's scores by their keys' per-token-head scales (`scales`:
// the warp's first key); in the C layout the thread's keys of n-tile nt are
// 8 nt + 2 tig and the one after.
template <int kNT>
__device__ __forceinline__ void scale_by_key(float (&s)[kNT][4], const float* scales, int tig) {
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    const float2 f = *reinterpret_cast<const float2*>(scales + nt * 8 + 2 * tig);
    s[nt][0] *= f.x;
    s[nt][1] *= f.y;
    s[nt][2] *= f.x;
    s[nt][3] *= f.y;
  }
}

// kRing: the K/V tile buffers decode passes ring through (SmemLayout::kDecodeRing).
// kWideRaw: fp8 rows are copied 16 values at a time (has_wide_fp8_rows).
template <int kHC, typename TIO, KvStore kKv, bool kDecode, int kRing, bool kWideRaw = false>
__device__ void run_pass(const FlashParams& p, const WorkItem& item, int kv_head, int group, int bt_stride,
                         int row0, int rows, const SmemPtrs& sm) {
  constexpr bool kFp8 = kIsFp8<kKv>;
  using S = Shape<kHC, kFp8>;
  using T = Compute<TIO, kFp8>;
  constexpr int kRows = kDecode ? kDecodeRows : S::kPassRows;
  constexpr int kMT = kDecode ? 1 : S::kPrefillMTiles;  // 16-row MMA tiles per warp
  constexpr int kWarpRows = kMT * kMmaRows;
  constexpr int kWarpKeys = kDecode ? kBlockN / kWarps : kBlockN;
  constexpr int kNT = kWarpKeys / 8;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int head_size = p.head_size;
  T* q_s = static_cast<T*>(sm.q);
  T* kv_s = static_cast<T*>(sm.kv);

  __syncthreads();  // the previous pass has finished with shared memory

  // ---- query rows -> shared memory (one cp.async group) ----
  const auto query_chunk = [&](int c, bool& valid) {
    return query_chunk_src<TIO>(p, item, kv_head, group, row0, rows, c / S::kChunks, c % S::kChunks, valid);
  };
  int q_shift = 0;  // the queries in shared memory are 2^-q_shift times the given ones
  if constexpr (!kFp8) {
    for (int c = tid; c < kRows * S::kChunks; c += kThreads) {
      bool valid = false;
      const TIO* src = query_chunk(c, valid);
      T* dst = q_s + (c / S::kChunks) * S::kStride + (c % S::kChunks) * kChunkElems;
      cp_async_16(dst, valid ? src : p.query, valid);
    }
  } else {
    // fp8 passes: the queries go to f16 through registers, bf16 ones scaled
    // into the f16 range, and land in MMA-fragment order (q_fragment_word),
    // so the key loop reads a thread's A operand with one 16-byte load.
    if constexpr (std::is_same_v<TIO, __nv_bfloat16>) {
      __shared__ unsigned q_abs_max;  // bit pattern of the largest |q| of the pass
      if (tid == 0) q_abs_max = 0;
      __syncthreads();
      unsigned local_max = 0;
      for (int c = tid; c < kRows * S::kChunks; c += kThreads) {
        bool valid = false;
        const TIO* src = query_chunk(c, valid);
        if (!valid) continue;
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (const unsigned w : words) local_max = max(local_max, max(bf16_finite_abs(w), bf16_finite_abs(w >> 16)));
      }
      atomicMax(&q_abs_max, local_max);
      __syncthreads();
      q_shift = f16_range_shift(q_abs_max);
    }
    auto* q_words = reinterpret_cast<std::uint32_t*>(q_s);
    for (int c = tid; c < kRows * S::kChunks; c += kThreads) {
      bool valid = false;
      const TIO* src = query_chunk(c, valid);
      uint4 v{0u, 0u, 0u, 0u};
      if (valid) v = *reinterpret_cast<const uint4*>(src);
      const unsigned words[4] = {v.x, v.y, v.z, v.w};
      const int r = c / S::kChunks;
      const int d0 = (c % S::kChunks) * kChunkElems;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 x = to_float2<TIO>(words[i]);
        q_words[q_fragment_word<kHC>(r, d0 + 2 * i)] = Elem<T>::pack(ldexpf(x.x, -q_shift), ldexpf(x.y, -q_shift));
      }
    }
  }
  cp_async_commit();

  const PassRange range = pass_range(p, item, group, row0, rows);
  // Tiles lie on the absolute 64-key grid, so a run of keys never straddles a
  // block whose size is a multiple of the run length.
  const int tile_lo = range.kv_lo - range.kv_lo % kBlockN;
  const int num_tiles = range.kv_hi > range.kv_lo ? (range.kv_hi - tile_lo + kBlockN - 1) / kBlockN : 0;

  // ---- this thread's rows: g and g + 8 of each of the warp's 16-row tiles ----
  const int row_base = kDecode ? 0 : warp * kWarpRows;          // first pass row of the warp
  const int stage_base = kDecode ? warp * kMmaRows : row_base;  // its first row in the O stage
  const bool warp_active = row_base < rows;
  const int g = lane / 4;
  const int tig = lane % 4;
  const auto thread_row = [&](int mt, int i) { return row_base + mt * kMmaRows + g + 8 * i; };
  // Positions of the warp's first and last row (rows past `rows` included:
  // only ever makes the whole-block test below stricter).
  const int warp_pos_lo = item.position_begin + (row0 + row_base) / group;
  const int warp_pos_hi = item.position_begin + (row0 + row_base + kWarpRows - 1) / group;
  // Per-token-head caches scale each key in the key loop instead.
  const bool token_scaled = kKv == KvStore::I8 || (kFp8 && p.k_token_scale != nullptr);
  const float k_scale = token_scaled ? 1.0f : kv_tensor_scale<kKv>(p, p.k_scale, kv_head);
  const float qk_scale = ldexpf(p.variant.scale * k_scale, q_shift);
  const float qk_scale_log2 = qk_scale * kLog2e;

  float o[kMT][S::kDTiles][4];
  float m[kMT][2];
  float l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < S::kDTiles; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
    m[mt][0] = m[mt][1] = -CUDART_INF_F;
    l[mt][0] = l[mt][1] = 0.0f;
  }

  // This thread copies one column (my_ch) of kRunKeys consecutive keys of
  // every tile (KvRunWalker): 8 values a copy, 16 (16 bytes) in kWideRaw
  // passes.
  constexpr int kCopyElems = kWideRaw ? 2 * kChunkElems : kChunkElems;
  constexpr int kCopyCols = kHC / kCopyElems;
  constexpr int kRunKeys = kBlockN * kCopyCols / kThreads;
  static_assert(!kWideRaw || (kFp8 && kDecode && kRunKeys % kScaleChunkKeys == 0),
                "16-value copies are for fp8 decode passes whose runs are whole scale chunks");
  static_assert(!kDecode || kRunKeys * (32 / kCopyCols) == kBlockN / kWarps,
                "a decode pass's warp copies exactly the keys it computes on");
  const int my_ch = tid % kCopyCols;
  const int my_run = tid / kCopyCols;
  const KvRunWalker<kRunKeys> walker(p, item, kv_head, bt_stride, range, tile_lo,
                                     my_ch * (kCopyElems / kChunkElems), my_run, kFp8 ? 1 : 2);

  const auto issue_tile = [&](int t, int buf, RunStart run) {
    T* k_dst = kv_s + buf * 2 * S::kTileElems + my_run * kRunKeys * S::kStride + my_ch * kChunkElems;
    T* v_dst = k_dst + S::kTileElems;
    walker.walk(t, run, [&](int i, bool valid, const char* k_src, const char* v_src) {
      cp_async_16(k_dst + i * S::kStride, k_src, valid);
      cp_async_16(v_dst + i * S::kStride, v_src, valid);
    });
  };

  // fp8: raw tiles land in a ring of kRawStages slots through 8-byte copies
  // in the thread layout of the 16-bit copies (16-byte ones in kWideRaw
  // passes, half the columns and runs); the MMA fragments are read
  // from them with ldmatrix and converted in registers (no 16-bit tile).
  // Per-token-head scales: the threads of column 0 copy their run's K and V
  // scales into the stage's scale slot (zeros for keys outside the range).
  unsigned char* raw_s = static_cast<unsigned char*>(sm.kv);
  float* scale_s = reinterpret_cast<float*>(raw_s + S::kRawStages * 2 * S::kRawTileBytes);
  const int raw_offset = my_run * kRunKeys * S::kRawStride + my_ch * kCopyElems;
  const auto issue_raw = [&](int t, RunStart run) {
    unsigned char* k_dst = raw_s + (t % S::kRawStages) * 2 * S::kRawTileBytes + raw_offset;
    unsigned char* v_dst = k_dst + S::kRawTileBytes;
    walker.walk(t, run, [&](int i, bool valid, const char* k_src, const char* v_src) {
      if constexpr (kWideRaw) {
        cp_async_ca<16>(k_dst + i * S::kRawStride, k_src, valid);
        cp_async_ca<16>(v_dst + i * S::kRawStride, v_src, valid);
      } else {
        cp_async_ca<8>(k_dst + i * S::kRawStride, k_src, valid);
        cp_async_ca<8>(v_dst + i * S::kRawStride, v_src, valid);
      }
    });
    if (token_scaled && my_ch == 0) {
      float* ks_dst = scale_s + (t % S::kRawStages) * S::kScaleStageFloats + my_run * kRunKeys;
      copy_token_scales(walker, t, run, kv_head, p, ks_dst, ks_dst + kBlockN);
    }
  };
  // 16-bit: starts copying tile t into `buf`. With two stages the run start
  // of tile t + 1 is looked up right after, to land while tile t is
  // computed; the one-stage (largest head) class looks it up just before use.
  RunStart run{-1, 0};
  const auto start_tile = [&](int t, int buf) {
    if (S::kStages == 1) run = walker.locate(t);
    issue_tile(t, buf, run);
    cp_async_commit();
    if (S::kStages == 2 && t + 1 < num_tiles) run = walker.locate(t + 1);
  };

  const auto compute_tile = [&](int t, int buf) {
    if (!warp_active) return;
    const T* k_s = kv_s + buf * 2 * S::kTileElems;
    const T* v_s = k_s + S::kTileElems;
    const int key_base = kDecode ? warp * kWarpKeys : 0;
    const int k0 = tile_lo + t * kBlockN + key_base;
    const int k_last = k0 + kWarpKeys - 1;
    // S = Q K^T: each K fragment serves every M-tile of the warp.
    float s[kMT][kNT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
    }
    // `full` (head size = class) drops the per-step padding tests, whose
    // branches would cut the unrolled MMA stream into blocks the scheduler
    // cannot interleave.
    const int d16 = (head_size + 15) / 16;
    // fp8: each key's 16 dims of a k-chunk are one 16-byte ldmatrix row, so a
    // thread receives dims 4t .. 4t + 3 of key g, which it uses as the MMA's
    // k positions 2t, 2t + 1, 2t + 8, 2t + 9; its Q fragment takes the same
    // dims (one 16-byte load, q_fragment_word). The dot product does not care.
    const unsigned char* k_raw = raw_s + buf * 2 * S::kRawTileBytes;
    const unsigned char* v_raw = k_raw + S::kRawTileBytes;
    const float* k_scales = scale_s + buf * S::kScaleStageFloats;  // per-token-head: this tile's keys
    const float* v_scales = k_scales + kBlockN;
    const auto qk_fp8 = [&](auto full) {
      static_assert(!kFp8 || kMT == 1, "fp8 passes have one M-tile per warp");
#pragma unroll
      for (int kk = 0; kk < kHC / 16; kk += 2) {
        if (decltype(full)::value || kk < d16) {  // a chunk past the head size is zeros on both sides
          std::uint32_t a[2][4];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const uint4 q4 = reinterpret_cast<const uint4*>(q_s)[q_fragment_word<kHC>(row_base, (kk + c) * 16) / 4 + lane];
            a[c][0] = q4.x;
            a[c][1] = q4.y;
            a[c][2] = q4.z;
            a[c][3] = q4.w;
          }
#pragma unroll
          for (int nt = 0; nt < kNT; nt += 2) {
            std::uint32_t r[4];  // (nt, kk), (nt + 1, kk), (nt, kk + 1), (nt + 1, kk + 1)
            ldsm_x4(r, k_raw + (key_base + nt * 8 + (lane & 7) + ((lane >> 3) & 1) * 8) * S::kRawStride +
                           (kk + (lane >> 4)) * 16);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              std::uint32_t b0;
              std::uint32_t b1;
              kv8x4_to_f16x2<kKv>(r[j], b0, b1);
              Elem<T>::mma(s[0][nt + (j & 1)], a[j >> 1], b0, b1);
            }
          }
        }
      }
    };
    const auto qk = [&](auto full) {
#pragma unroll
      for (int kk = 0; kk < kHC / 16; ++kk) {
        if (decltype(full)::value || kk < d16) {
          std::uint32_t a[kMT][4];
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            ldsm_x4(a[mt],
                    q_s + (row_base + mt * kMmaRows + (lane & 15)) * S::kStride + kk * 16 + (lane >> 4) * 8);
          }
#pragma unroll
          for (int nt = 0; nt < kNT; nt += 2) {
            std::uint32_t b[4];
            ldsm_x4(b, k_s + (key_base + nt * 8 + (lane & 7) + ((lane >> 4) << 3)) * S::kStride + kk * 16 +
                           ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) mma_x2<T>(s[mt][nt], s[mt][nt + 1], a[mt], b);
          }
        }
      }
    };
    if constexpr (kFp8) {
      with_full_head(head_size == kHC, qk_fp8);
      if (token_scaled) scale_by_key(s[0], k_scales + key_base, tig);  // scores times their K scales
    } else {
      with_full_head(head_size == kHC, qk);
    }
    // The online softmax, per 16-row M-tile (flash_pass.cuh).
    const bool whole = whole_block(p, range, k0, k_last, warp_pos_lo, warp_pos_hi);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const ScoreRows at{{row0 + thread_row(mt, 0), row0 + thread_row(mt, 1)}, row0 + rows, k0, tig};
      online_softmax(p, item, kv_head, group, range, at, whole, qk_scale, qk_scale_log2, s[mt], o[mt], m[mt], l[mt]);
    }
    // Per-token-head V: sum_k p_k (s_k v_k) = sum_k (p_k s_k) v_k, so each
    // probability is multiplied by its key's V scale in f32 (l already holds
    // the plain sum) and V enters the MMA as converted: 8 multiplies per
    // thread and warp-tile where scaling V took 32 f16 multiplies
    // (docs/cuda_flash.md). p <= 2^kRescaleLog2, so p s stays a finite f16 up
    // to amax(V) = 65504 qmax / 2^kRescaleLog2.
    if constexpr (kFp8) {
      if (token_scaled) scale_by_key(s[0], v_scales + key_base, tig);
    }
    // O += P V: the score accumulators of two adjacent n-tiles form one A
    // operand; each V fragment serves every M-tile of the warp.
    const auto pv = [&](auto full) {
#pragma unroll
      for (int kk = 0; kk < kWarpKeys / 16; ++kk) {
        std::uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) scores_to_a<T>(s[mt], kk, a[mt]);
#pragma unroll
        for (int dt = 0; dt < S::kDTiles; dt += 2) {
          if (decltype(full)::value || dt * 8 < head_size) {
            std::uint32_t b[4];
            ldsm_x4_trans(b, v_s + (key_base + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S::kStride +
                                 dt * 8 + (lane >> 4) * 8);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) mma_x2<T>(o[mt][dt], o[mt][dt + 1], a[mt], b);
          }
        }
      }
    };
    // fp8: a transposed ldmatrix row is 16 bytes of one key (16 dims), so a
    // thread receives dims 2g and 2g + 1 of keys 2t and 2t + 1: the even dims
    // feed one n-tile and the odd dims another (o[2j], o[2j + 1] of 16-dim
    // group j; the O stage puts them back in order).
    const auto pv_fp8 = [&](auto full) {
#pragma unroll
      for (int kk = 0; kk < kWarpKeys / 16; ++kk) {
        std::uint32_t a[4];
        scores_to_a<T>(s[0], kk, a);
#pragma unroll
        for (int dg = 0; dg < kHC / 16; dg += 2) {
          if (decltype(full)::value || dg * 16 < head_size) {
            std::uint32_t r[4];  // keys 0-7 / 8-15 of group dg, then of group dg + 1
            ldsm_x4_trans(r, v_raw + (key_base + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S::kRawStride +
                                 (dg + (lane >> 4)) * 16);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              constexpr std::uint32_t kEvenThenOddBytes = 0x3120;
              std::uint32_t even[2];
              std::uint32_t odd[2];
#pragma unroll
              for (int k8 = 0; k8 < 2; ++k8) {
                kv8x4_to_f16x2<kKv>(__byte_perm(r[2 * h + k8], 0, kEvenThenOddBytes), even[k8], odd[k8]);
              }
              Elem<T>::mma(o[0][2 * (dg + h)], a, even[0], even[1]);
              Elem<T>::mma(o[0][2 * (dg + h) + 1], a, odd[0], odd[1]);
            }
          }
        }
      }
    };
    if constexpr (kFp8) {
      with_full_head(head_size == kHC, pv_fp8);
    } else {
      with_full_head(head_size == kHC, pv);
    }
  };

  if constexpr (kDecode) {
    // ---- the key loop, decode: each warp on its own ----
    // A thread's copy run lies among its warp's 16 keys of the tile (run
    // my_run's keys 16 w .. 16 w + 15 are warp w's, KvRunWalker), which only
    // that warp computes on: the warps wait for their own copies (cp.async
    // groups, then __syncwarp) and never for each other inside the loop. Tiles
    // t + 1 .. t + kRing - 1 are in flight while tile t is computed; block ids
    // are looked up kLocateAhead tiles before their copies issue, so the
    // page-table loads are not on the copy-issue path.
    constexpr int kLocateAhead = 2;
    RunStart ahead[kLocateAhead];
#pragma unroll
    for (int i = 0; i < kLocateAhead; ++i) ahead[i] = walker.locate(i);
    const auto issue_next = [&](int t) {
      if constexpr (kFp8) {
        issue_raw(t, ahead[0]);
      } else {
        issue_tile(t, t % kRing, ahead[0]);
      }
#pragma unroll
      for (int i = 0; i + 1 < kLocateAhead; ++i) ahead[i] = ahead[i + 1];
      ahead[kLocateAhead - 1] = walker.locate(t + kLocateAhead);
    };
    for (int t = 0; t + 1 < kRing; ++t) {
      if (t < num_tiles) issue_next(t);
      cp_async_commit();
    }
    // The queries (the oldest group, or stored directly) are read by every warp.
    cp_async_wait<kRing - 1>();
    __syncthreads();
    for (int t = 0; t < num_tiles; ++t) {
      // Tile t + kRing - 1 reuses the buffer of tile t - 1, which this warp is done with.
      if (t + kRing - 1 < num_tiles) issue_next(t + kRing - 1);
      cp_async_commit();  // possibly empty: keeps the group count per tile fixed
      cp_async_wait<kRing - 1>();
      __syncwarp();  // tile t landed for every lane of the warp
      compute_tile(t, t % kRing);
      __syncwarp();  // every lane is done reading tile t's buffer
    }
  } else if constexpr (kFp8) {
    // ---- the key loop, fp8: tiles t + 1 .. t + kRawStages - 1 in flight ----
    run = walker.locate(0);
    for (int t = 0; t < S::kRawStages - 1; ++t) {
      if (t < num_tiles) {
        issue_raw(t, run);
        run = walker.locate(t + 1);
      }
      cp_async_commit();
    }
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<S::kRawStages - 2>();
      __syncthreads();  // tile t landed for every thread; every warp is done with tile t - 1's slot
      const int ahead = t + S::kRawStages - 1;
      if (ahead < num_tiles) {
        issue_raw(ahead, run);
        run = walker.locate(ahead + 1);
      }
      cp_async_commit();  // possibly empty: keeps the group count per tile fixed
      compute_tile(t, t % S::kRawStages);
    }
  } else {
    // ---- the key loop, 16-bit: tile t + 1 in flight while tile t is computed ----
    if (num_tiles > 0) {
      if (S::kStages == 2) run = walker.locate(0);
      start_tile(0, 0);
    }
    for (int t = 0; t < num_tiles; ++t) {
      const int buf = S::kStages == 2 ? (t & 1) : 0;
      const bool prefetch = S::kStages == 2 && t + 1 < num_tiles;
      if (prefetch) {
        start_tile(t + 1, buf ^ 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      compute_tile(t, buf);
      __syncthreads();
      if (S::kStages == 1 && t + 1 < num_tiles) start_tile(t + 1, 0);
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- stage each warp's (m, l, O) in shared memory (aliases the K/V tiles) ----
  if (warp_active) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      stage_warp_rows<kHC, kFp8>(o[mt], m[mt], l[mt], stage_base + mt * kMmaRows + g, tig, sm.stage, sm.ml);
    }
  }
  __syncthreads();
  const float v_scale = token_scaled ? 1.0f : kv_tensor_scale<kKv>(p, p.v_scale, kv_head);
  write_pass_output<kHC, TIO, kDecode, kThreads>(p, item, kv_head, group, row0, rows, sm.stage, sm.ml, v_scale);
}

// kDecodeOnly: runs every item as decode passes (a prefill item, should a
// replayed graph meet one, as passes of 16 rows: correct, slower), built for
// decode_only_ctas_per_sm(kHC) CTAs per multiprocessor.
template <int kHC, typename T, KvStore kKv, bool kDecodeOnly>
__global__ void __launch_bounds__(kThreads, kDecodeOnly ? decode_only_ctas_per_sm(kHC) : 1)
    attention_kernel(const FlashParams p) {
  using S = Shape<kHC, kIsFp8<kKv>>;
  using L = SmemLayout<kHC, kIsFp8<kKv>, kDecodeOnly>;
  extern __shared__ __align__(16) unsigned char smem[];
  const SmemPtrs sm{smem, smem + L::kQBytes, reinterpret_cast<float*>(smem + L::kQBytes),
                    reinterpret_cast<float*>(smem + L::kQBytes + L::kBodyBytes)};
  for_each_item(p, [&](const WorkItem& item, int kv_head, int group, int bt_stride) {
    const int rows_total = item.num_tokens * group;
    if (kDecodeOnly || item.mode == static_cast<int>(TileMode::Decode)) {
      for (int row0 = 0; row0 < rows_total; row0 += kDecodeRows) {
        run_pass<kHC, T, kKv, true, L::kDecodeRing, L::kWideRaw>(p, item, kv_head, group, bt_stride, row0,
                                                                 min(kDecodeRows, rows_total - row0), sm);
      }
    } else if constexpr (!kDecodeOnly) {
      for (int row0 = 0; row0 < rows_total; row0 += S::kPassRows) {
        run_pass<kHC, T, kKv, false, L::kDecodeRing>(p, item, kv_head, group, bt_stride, row0,
                                                     min(S::kPassRows, rows_total - row0), sm);
      }
    }
  });
}

// Splits of a group whose partial loads the combine kernel issues at once.
inline constexpr int kCombineUnroll = 8;

// Calls f(partial token-row) for every partial of token `token_rel` of a
// combine item, group by group. The split loops are unrolled so that their
// loads issue together: one load and its use per split made the 32-split
// merge of a lone decode (1q1s8k) a chain of 64 memory latencies (ncu, caches
// flushed: 21 us, longer than the attention kernel before it).
template <typename F>
__device__ __forceinline__ void for_each_partial(const CombineItem& item, int token_rel, F&& f) {
#pragma unroll
  for (int g = 0; g < kMaxCombineGroups; ++g) {
    const PartialGroup& group = item.groups[g];
#pragma unroll kCombineUnroll
    for (int s = 0; s < group.num_splits; ++s) f(group.first_row + s * group.split_stride + token_rel);
  }
}

// Merges one combine item's partials by LSE (natural log) into the output
// (and LSE) of the CTA's KV head; the sink, if any, joins here once.
template <typename T>
__device__ __forceinline__ void merge_partials(const FlashParams& p, const CombineItem& item, int kv_head) {
  const int group = p.num_heads / p.num_kv_heads;
  const int chunks = p.head_size / kChunkElems;
  const int rows = item.num_tokens * group;
  for (int u = static_cast<int>(threadIdx.x); u < rows * chunks; u += kThreads) {
    const int r = u / chunks;
    const int ch = u % chunks;
    const int token_rel = r / group;
    const int head = kv_head * group + r % group;
    const auto prow = [&](std::int32_t row) { return static_cast<std::int64_t>(row) * p.num_heads + head; };
    float m_keys = -CUDART_INF_F;
    for_each_partial(item, token_rel, [&](std::int32_t row) { m_keys = fmaxf(m_keys, p.partial_lse[prow(row)]); });
    float acc[8] = {};
    float lse = -CUDART_INF_F;
    if (m_keys != -CUDART_INF_F) {
      float mm = m_keys;
      float den = 0.0f;
      if (p.variant.sinks != nullptr) {
        mm = fmaxf(mm, p.variant.sinks[head]);
        den = expf(p.variant.sinks[head] - mm);
      }
      for_each_partial(item, token_rel, [&](std::int32_t row) {
        const float w = expf(p.partial_lse[prow(row)] - mm);
        den += w;
        const float* src = p.partial_out + prow(row) * p.head_size + ch * kChunkElems;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += w * src[e];
      });
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] /= den;
      lse = mm + logf(den);
    }
    const std::int64_t token = item.token_begin + token_rel;
    store8<T>(
        static_cast<T*>(p.output) + token * p.o_row_stride + head * p.o_head_stride + ch * kChunkElems,
        acc);
    if (p.lse != nullptr && ch == 0) p.lse[head * p.lse_head_stride + token * p.lse_token_stride] = lse;
  }
}

// Merges each combine item's partials (merge_partials), items strided over the grid's x, KV heads its y.
template <typename T>
__global__ void __launch_bounds__(kThreads) combine_kernel(const FlashParams p) {
  const int kv_head = static_cast<int>(blockIdx.y);
  for_each_plan_entry(
      p, p.combine, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x),
      [](const PlanHeader& h) { return h.num_combine; },
      [&](const CombineItem& item, const PlanHeader&) { merge_partials<T>(p, item, kv_head); });
}

// Launches the attention kernel of one head-size class, dtype, KV storage and
// step kind.
template <int kHC, typename T, KvStore kKv, bool kDecodeOnly>
int launch_attention(const FlashParams& p, cudaStream_t stream) {
  static std::atomic<std::uint64_t> configured{0};
  return launch_over_items(attention_kernel<kHC, T, kKv, kDecodeOnly>, kThreads,
                           SmemLayout<kHC, kIsFp8<kKv>, kDecodeOnly>::kSmemBytes, configured, p, stream);
}

// Launches the attention kernel choose_kernel picked for one head-size class
// and dtype (the wgmma one lives in its own sm_90a translation unit), then the
// combine kernel when asked.
template <int kHC, typename T>
int launch_class(const FlashParams& p, bool launch_combine, cudaStream_t stream) {
  if (p.grid_items > 0) {
    const auto launch = [&](auto decode_only) {
      constexpr bool kDecodeOnly = decltype(decode_only)::value;
      if (p.kv_dtype == DType::FP8_E4M3) return launch_attention<kHC, T, KvStore::E4M3, kDecodeOnly>(p, stream);
      if (p.kv_dtype == DType::FP8_E5M2) return launch_attention<kHC, T, KvStore::E5M2, kDecodeOnly>(p, stream);
      if (p.kv_dtype == DType::I8) return launch_attention<kHC, T, KvStore::I8, kDecodeOnly>(p, stream);
      return launch_attention<kHC, T, KvStore::Bits16, kDecodeOnly>(p, stream);
    };
    int rc = kLaunchOk;
    if (p.kernel == KernelKind::WgmmaPrefill && has_wgmma_kernel(kHC)) {
      rc = launch_wgmma_prefill<kHC>(p, std::is_same_v<T, half> ? DType::F16 : DType::BF16, stream);
    } else if (p.kernel == KernelKind::DecodeOnly && has_decode_only_kernel(kHC)) {
      if constexpr (has_decode_only_kernel(kHC)) rc = launch(std::true_type{});
    } else {
      rc = launch(std::false_type{});
    }
    if (rc != kLaunchOk) return rc;
  }
  if (launch_combine && p.grid_combine > 0) {
    combine_kernel<T><<<dim3(static_cast<unsigned>(p.grid_combine), static_cast<unsigned>(p.num_kv_heads)),
                        kThreads, 0, stream>>>(p);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  }
  return kLaunchOk;
}

}  // namespace pagedattn::cuda_flash::detail
