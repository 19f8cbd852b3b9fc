// The Hopper prefill kernel of CUDA_FLASH (sm_90a, head classes 64, 128 and
// 256, 16-bit or per-tensor fp8 K/V), warp-specialized as FlashAttention-3: a producer warpgroup copies
// each pass's queries and its K and V tiles of kTileKeys keys from the paged
// cache into 128-byte swizzled shared memory (cp.async, one page run per
// thread: a page table rules out one bulk copy per tile), and two consumer
// warpgroups run S = Q K^T and O += P V on warpgroup MMAs (wgmma) that read
// the tiles through descriptors, with the online softmax of the mma.sync
// kernels (flash_pass.cuh), so both give the same scores. The producer gives
// its registers to the consumers (setmaxnreg) and runs ahead through the
// CTA's passes, so the next pass's loads overlap this pass's last MMAs and
// epilogue. Persistent: the grid is one CTA per multiprocessor, striding over
// the (item, KV head) units.
//
// fp8 K/V (e4m3 or e5m2, a scale per tensor or KV head): the producer stages
// each tile raw (cp.async) and converts it, exactly for both formats, into
// the tiles the consumers read: K to the queries' 16-bit type, V to f16
// (Compute, flash_pass.cuh), so they run the 16-bit kernel's MMAs; the K
// scale joins the score scale and the V scale the epilogue's normalization.
//
// A pass is 128 packed rows of an item: consumer warpgroup w owns rows
// [64w, 64w + 64) and every key of a tile, so each K/V tile in shared memory
// serves 128 rows. Any item runs here as 128-row passes (a decode item too:
// a graph captured on a prefill-only step may replay a mixed plan), correct
// and, for decode items, slower.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flash_params.h"
#include "flash_pass.cuh"
#include "flash_primitives.cuh"
#include "flash_wgmma.cuh"

namespace pagedattn::cuda_flash::detail {

inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kWgmmaTileRows = 64;  // rows of one warpgroup's MMA tile
inline constexpr int kWgmmaConsumers = kPrefillRows / kWgmmaTileRows;
inline constexpr int kWgmmaConsumerThreads = kWgmmaConsumers * kWarpgroupThreads;
inline constexpr int kWgmmaProducerWg = kWgmmaConsumers;  // the last warpgroup
inline constexpr int kWgmmaThreads = kWgmmaConsumerThreads + kWarpgroupThreads;
inline constexpr int kWgmmaK = 16;  // the reduction depth of one 16-bit wgmma
inline constexpr int kSm90MaxSmemBytes = 227 * 1024;  // dynamic shared memory a CTA may opt into
// Registers per thread after the hand-over: the launch gets 168 per thread
// (384 threads), 504 per thread slot of the three warpgroups. The producer
// walks the page table, issues copies and converts fp8 tiles; with 56 it
// spilled in that loop, so it keeps 72 and passes the rest to the consumers'
// accumulators (2 x 216 + 72 = 504; docs/perf-log/cuda_flash-issue-31b.md).
inline constexpr int kProducerRegs = 72;
inline constexpr int kConsumerRegs = 216;

// Shared memory: alignment slack (swizzled tiles start on 1024-byte atoms),
// Q [128 rows, kHC dims], then kStages K tiles and kStages V tiles [kTileKeys
// keys, kHC dims] (all swizzled, 64-dim panels), then the mbarriers.
// Class 256 takes 64-key tiles: its O accumulators alone are 128 registers a
// thread, and its tiles fill shared memory at that size (192 KiB).
template <int kHeadClass>
struct WgmmaLayout {
  static constexpr int kHC = kHeadClass;
  static constexpr int kTileKeys = kHC > 128 ? 64 : 128;  // keys per K/V tile: N of S = Q K^T
  static constexpr int kStages = 2;                       // K (and V) tile buffers
  static constexpr int kChunks = kHC / kChunkElems;
  static constexpr int kQBytes = kPrefillRows * kHC * 2;
  static constexpr int kTileBytes = kTileKeys * kHC * 2;  // one K or V tile
  static constexpr int kKBytes = kStages * kTileBytes;
  // q_full, q_empty, then k_full, k_empty, v_full, v_empty per stage.
  static constexpr int kBarriers = 2 + 4 * kStages;
  static constexpr int kSmemBytes =
      kSwizzleAtomBytes + kQBytes + 2 * kKBytes + kBarriers * static_cast<int>(sizeof(std::uint64_t));
  static constexpr std::uint32_t kPanelStride = kTileKeys * kSwizzleBytes;  // 64-dim panels of a K or V tile
  static_assert(has_wgmma_kernel(kHC), "a head class with a wgmma kernel");
};

// fp8 kernels' staging ring of raw K and V tiles (1 byte an element, rows of
// kHC bytes), between the V tiles and the barriers: two stages (a tile's
// copies in flight while the previous one is converted), one at class 256,
// whose 64-key tiles already fill shared memory (227 KB with it).
template <int kHC, bool kFp8>
struct WgmmaRawRing {
  static constexpr int kStages = !kFp8 ? 0 : (kHC > 128 ? 1 : 2);
  static constexpr int kTileBytes = WgmmaLayout<kHC>::kTileKeys * kHC;  // one raw K or V tile
  static constexpr int kBytes = kStages * 2 * kTileBytes;
};

// The producer's K/V copies of a tile, 16 bytes each (8 values of 16-bit
// K/V, 16 of fp8): thread tid copies column tid % kCols of kKeysPerRun
// consecutive keys (KvRunWalker), which start at 8-value chunk
// kChunksPerCopy * (tid % kCols) of the row.
template <int kHC, int kElemBytes>
struct WgmmaCopyRuns {
  static constexpr int kCols = kHC * kElemBytes / kChunkBytes;
  static constexpr int kChunksPerCopy = kHC / kChunkElems / kCols;
  static constexpr int kKeysPerRun = WgmmaLayout<kHC>::kTileKeys * kCols / kWarpgroupThreads;
  static_assert(kWarpgroupThreads % kCols == 0, "a thread's column must not change between its keys");
};

// Descriptor offsets of the swizzled tiles: 8-row atoms are 1024 B apart; the
// 64-dim panels of a K or V tile are kTileKeys rows apart, of Q kPrefillRows.
inline constexpr std::uint32_t kAtomStride = kSwizzleAtomBytes;
inline constexpr std::uint32_t kQPanelStride = kPrefillRows * kSwizzleBytes;
inline constexpr int kKStepsPerPanel = kSwizzleElems / kWgmmaK;
// Named barriers of the ping-pong: consumer warpgroup w waits on kTurnBarrier + w.
inline constexpr int kTurnBarrier = 1;

// The CTA's barriers. Tiles are numbered across the CTA's passes (`seq`), so
// tile G lives in buffer G % kStages and is that buffer's phase G / kStages;
// passes likewise number the phases of the Q buffer. `full` completes a phase
// when every producer thread's copies have landed, `empty` when every
// consumer thread has retired the MMAs reading the buffer.
struct WgmmaBarriers {
  std::uint64_t* q_full;
  std::uint64_t* q_empty;
  std::uint64_t* k_full;   // [kStages]
  std::uint64_t* k_empty;  // [kStages]
  std::uint64_t* v_full;   // [kStages]
  std::uint64_t* v_empty;  // [kStages]
};

// The K/V storage this kernel takes: Bits16, E4M3 or E5M2 (KvStore; per
// tensor or KV head scales only, never I8).
template <KvStore kKv>
inline constexpr std::int64_t kKvElemBytes = kIsFp8<kKv> ? 1 : 2;

// Eight fp8 values (an 8-byte chunk) -> eight T (16 bytes), exact.
template <typename T, KvStore kKv>
__device__ __forceinline__ uint4 fp8x8_to(uint2 raw) {
  std::uint32_t w[4];
  kv8x4_to_f16x2<kKv>(raw.x, w[0], w[1]);
  kv8x4_to_f16x2<kKv>(raw.y, w[2], w[3]);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (std::uint32_t& x : w) {
      __half2 h;
      std::memcpy(&h, &x, sizeof h);
      const float2 f = __half22float2(h);
      x = Elem<__nv_bfloat16>::pack(f.x, f.y);
    }
  }
  return {w[0], w[1], w[2], w[3]};
}

// What producer and consumers both derive from a pass: its key range and tiles.
struct PassTiles {
  PassRange range;
  int tile_lo;    // first key of tile 0
  int num_tiles;  // tiles with visible keys
  int steps;      // tiles run: a pass without keys runs one, zero-filled and masked
};

template <int kN>
__device__ __forceinline__ PassTiles pass_tiles(const FlashParams& p, const WorkItem& item, int group, int row0,
                                                int rows) {
  const PassRange range = pass_range(p, item, group, row0, rows);
  const int tile_lo = range.kv_lo - range.kv_lo % kN;
  const int num_tiles = range.kv_hi > range.kv_lo ? (range.kv_hi - tile_lo + kN - 1) / kN : 0;
  return {range, tile_lo, num_tiles, max(num_tiles, 1)};
}

// Calls f(row0, rows) for each 128-row pass of an item.
template <typename F>
__device__ __forceinline__ void for_each_pass(const WorkItem& item, int group, F&& f) {
  const int rows_total = item.num_tokens * group;
  for (int row0 = 0; row0 < rows_total; row0 += kPrefillRows) f(row0, min(kPrefillRows, rows_total - row0));
}

// The producer warpgroup: for every pass of the CTA, in the consumers' order,
// the queries into the Q buffer once the previous pass has released it, then
// each tile's K and V into their buffers once released. Every thread arrives
// on a `full` barrier when its own copies land (cp.async's mbarrier arrive).
template <int kHC, typename T, KvStore kKv>
__device__ __forceinline__ void wgmma_produce(const FlashParams& p, unsigned char* q_s, unsigned char* k_s, unsigned char* v_s,
                              unsigned char* raw_s, const WgmmaBarriers& bars) {
  using L = WgmmaLayout<kHC>;
  const int tid = static_cast<int>(threadIdx.x) - kWgmmaConsumerThreads;
  int seq = 0;
  int pass = 0;
  for_each_unit(p, [&](const WorkItem& item, int kv_head, int group, int bt_stride) {
    for_each_pass(item, group, [&](int row0, int rows) {
      if (pass > 0) mbarrier_wait(bars.q_empty, (pass - 1) & 1);
      for (int c = tid; c < kPrefillRows * L::kChunks; c += kWarpgroupThreads) {
        const int r = c / L::kChunks;
        const int ch = c % L::kChunks;
        bool valid = false;
        const T* src = query_chunk_src<T>(p, item, kv_head, group, row0, rows, r, ch, valid);
        cp_async_16(q_s + swizzled_offset(r, ch, kPrefillRows), valid ? src : p.query, valid);
      }
      cp_async_arrive(bars.q_full);

      const PassTiles pt = pass_tiles<L::kTileKeys>(p, item, group, row0, rows);
      // Waits until the consumers have released the previous tile of the
      // buffer of the CTA's tile gt in the K or V ring (`empty`: its release
      // barriers); a buffer's first tile waits for nothing.
      const auto wait_released = [&](int gt, std::uint64_t* empty) {
        if (gt >= L::kStages) mbarrier_wait(&empty[gt % L::kStages], (gt / L::kStages - 1) & 1);
      };
      using C = WgmmaCopyRuns<kHC, kKvElemBytes<kKv>>;
      const int my_run = tid / C::kCols;
      const int my_ch = tid % C::kCols * C::kChunksPerCopy;  // the thread's first 8-value chunk of a row
      const KvRunWalker<C::kKeysPerRun, L::kTileKeys> walker(p, item, kv_head, bt_stride, pt.range,
                                                             pt.tile_lo, my_ch, my_run, kKvElemBytes<kKv>);
      if constexpr (kKv == KvStore::Bits16) {
        RunStart run = walker.locate(0);
        for (int t = 0; t < pt.steps; ++t) {
          const int gt = seq + t;
          const int buf = gt % L::kStages;
          const int tile_off = buf * L::kTileBytes;
          wait_released(gt, bars.k_empty);
          walker.walk(t, run, [&](int i, bool valid, const char* k_src, const char*) {
            cp_async_16(k_s + tile_off + swizzled_offset(my_run * C::kKeysPerRun + i, my_ch, L::kTileKeys), k_src,
                        valid);
          });
          cp_async_arrive(&bars.k_full[buf]);
          wait_released(gt, bars.v_empty);
          walker.walk(t, run, [&](int i, bool valid, const char*, const char* v_src) {
            cp_async_16(v_s + tile_off + swizzled_offset(my_run * C::kKeysPerRun + i, my_ch, L::kTileKeys), v_src,
                        valid);
          });
          cp_async_arrive(&bars.v_full[buf]);
          run = walker.locate(t + 1);
        }
      } else {
        // fp8: each thread copies its chunks of tile t + 1 raw into the
        // staging ring (cp.async, zeros outside the range) while it converts
        // the same chunks of tile t, which only it wrote, into the swizzled
        // 16-bit tiles; it arrives once its stores are fenced for wgmma's
        // async reads.
        // The raw rows are copied through L1 (choose_kernel's kv_rows_16b).
        using R = WgmmaRawRing<kHC, true>;
        const int raw_off = my_run * C::kKeysPerRun * kHC + my_ch * kChunkElems;  // one byte a value
        const auto raw_tile = [&](int t) { return raw_s + (t % R::kStages) * 2 * R::kTileBytes + raw_off; };
        const auto issue_raw = [&](int t, RunStart run) {
          unsigned char* k_raw = raw_tile(t);
          walker.walk(t, run, [&](int i, bool valid, const char* k_src, const char* v_src) {
            cp_async_ca<16>(k_raw + i * kHC, k_src, valid);
            cp_async_ca<16>(k_raw + R::kTileBytes + i * kHC, v_src, valid);
          });
          cp_async_commit();
        };
        // Into tiles of TOut: T for K, P V's type for V.
        const auto convert = [&]<typename TOut>(std::type_identity<TOut>, const unsigned char* raw,
                                                unsigned char* tile, std::uint64_t* full) {
          // By two: fully unrolled, the producer spilled (32-64 B more at class 128).
#pragma unroll 2
          for (int i = 0; i < C::kKeysPerRun; ++i) {
            const uint4 w = *reinterpret_cast<const uint4*>(raw + i * kHC);
            const int key = my_run * C::kKeysPerRun + i;
            *reinterpret_cast<uint4*>(tile + swizzled_offset(key, my_ch, L::kTileKeys)) =
                fp8x8_to<TOut, kKv>(make_uint2(w.x, w.y));
            *reinterpret_cast<uint4*>(tile + swizzled_offset(key, my_ch + 1, L::kTileKeys)) =
                fp8x8_to<TOut, kKv>(make_uint2(w.z, w.w));
          }
          fence_proxy_async_shared();
          mbarrier_arrive(full);
        };
        issue_raw(0, walker.locate(0));
        for (int t = 0; t < pt.steps; ++t) {
          const bool ahead = R::kStages > 1 && t + 1 < pt.steps;
          if (ahead) {
            issue_raw(t + 1, walker.locate(t + 1));
            cp_async_wait<1>();
          } else {
            cp_async_wait<0>();
          }
          const int gt = seq + t;
          const int buf = gt % L::kStages;
          const int tile_off = buf * L::kTileBytes;
          wait_released(gt, bars.k_empty);
          convert(std::type_identity<T>{}, raw_tile(t), k_s + tile_off, &bars.k_full[buf]);
          wait_released(gt, bars.v_empty);
          convert(std::type_identity<Compute<T, true>>{}, raw_tile(t) + R::kTileBytes, v_s + tile_off,
                  &bars.v_full[buf]);
          if (!ahead && t + 1 < pt.steps) issue_raw(t + 1, walker.locate(t + 1));
        }
      }
      seq += pt.steps;
      ++pass;
    });
  });
  cp_async_wait<0>();
}

// Writes a consumer thread's two rows of a pass (g and g + 8 of its warp's
// 16) from the O accumulators: normalized (finish_row), as the output and its
// LSE or as a split's partial. A quad's 4 threads hold a row's dims
// 8 dt + 2 tig, + 1.
template <typename T, int kDT>
__device__ __forceinline__ void wgmma_store_rows(const FlashParams& p, const WorkItem& item, int kv_head, int group,
                                                 int row0, int rows, int r0, int tig, const float (&o)[kDT][4],
                                                 const float (&m)[2], float (&l)[2], float v_scale) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i;
    if (r >= rows) continue;
    const RowOut out = row_out(p, item, kv_head, group, row0 + r);
    const RowFinish fin = finish_row(p, item, out.head, m[i], l[i], v_scale);
    if (item.writes_partial) {
      float* dst = p.partial_out + out.partial_row * p.head_size;
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        const int d = dt * 8 + 2 * tig;
        if (d < p.head_size) {
          *reinterpret_cast<float2*>(dst + d) = make_float2(o[dt][2 * i] * fin.f, o[dt][2 * i + 1] * fin.f);
        }
      }
      if (tig == 0) p.partial_lse[out.partial_row] = fin.lse;
      continue;
    }
    T* dst = static_cast<T*>(p.output) + out.token * p.o_row_stride + out.head * p.o_head_stride;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int d = dt * 8 + 2 * tig;
      if (d < p.head_size) {
        *reinterpret_cast<std::uint32_t*>(dst + d) = Elem<T>::pack(o[dt][2 * i] * fin.f, o[dt][2 * i + 1] * fin.f);
      }
    }
    if (p.lse != nullptr && tig == 0) p.lse[out.head * p.lse_head_stride + out.token * p.lse_token_stride] = fin.lse;
  }
}

// A consumer warpgroup's passes. The key loop is FlashAttention-3's
// intra-warpgroup pipelining: step t issues S of tile t, then P V of tile
// t - 1, and runs the softmax of tile t on the CUDA cores while P V runs on
// the tensor cores; O is rescaled just before the next P V. Every step
// retires its MMAs (ptxas serializes the wgmmas of a loop whose MMAs in
// flight differ between paths), and a pass with no key tile still runs one,
// on a zero-filled tile whose keys are all masked. And its ping-pong: the
// two warpgroups take turns to issue their MMAs (named barriers), so each
// one's softmax runs under the other's MMAs. K of tile t is released as soon
// as S of t has retired, V after P V; the queries after the pass's last S.
template <int kHC, typename T, KvStore kKv>
__device__ __forceinline__ void wgmma_consume(const FlashParams& p, unsigned char* q_s, unsigned char* k_s, unsigned char* v_s,
                              const WgmmaBarriers& bars) {
  using L = WgmmaLayout<kHC>;
  constexpr int kNT = L::kTileKeys / 8;  // 8-key n-tiles of S
  constexpr int kDT = kHC / 8;           // 8-dim n-tiles of O
  constexpr int kPvSteps = L::kTileKeys / kWgmmaK;
  using TP = Compute<T, kIsFp8<kKv>>;  // P V's type
  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid / kWarpgroupThreads;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int tig = lane % 4;
  // This thread's rows: g and g + 8 of its warp's 16 rows of the warpgroup tile.
  const int row_base = wg * kWgmmaTileRows + (tid % kWarpgroupThreads) / 32 * kMmaRows;
  const int my_turn = kTurnBarrier + wg;
  const int their_turn = kTurnBarrier + 1 - wg;
  const std::uint32_t q_addr = smem_addr(q_s) + static_cast<std::uint32_t>(wg * kWgmmaTileRows * kSwizzleBytes);
  // Class 256: the eight Q descriptors of S = Q K^T are computed each tile;
  // hoisted, ptxas spilled and reloaded them every tile. At classes 64 and
  // 128 their spills are fewer and computing them cost more than it saved
  // (docs/perf-log/cuda_flash-issue-31b.md).
  constexpr bool kPerTileQDescriptors = kHC > 128;

  int seq = 0;
  int pass = 0;
  for_each_unit(p, [&](const WorkItem& item, int kv_head, int group, int) {
    const float qk_scale = p.variant.scale * kv_tensor_scale<kKv>(p, p.k_scale, kv_head);
    const float qk_scale_log2 = qk_scale * kLog2e;
    const float v_scale = kv_tensor_scale<kKv>(p, p.v_scale, kv_head);
    for_each_pass(item, group, [&](int row0, int rows) {
      const PassTiles pt = pass_tiles<L::kTileKeys>(p, item, group, row0, rows);
      const int warp_pos_lo = item.position_begin + (row0 + row_base) / group;
      const int warp_pos_hi = item.position_begin + (row0 + row_base + kMmaRows - 1) / group;
      const auto buf_of = [&](int t) { return (seq + t) % L::kStages; };
      const auto parity_of = [&](int t) { return ((seq + t) / L::kStages) & 1; };
      const auto wait_full = [&](std::uint64_t* full, int t) {
        mbarrier_wait(&full[buf_of(t)], parity_of(t));
        fence_proxy_async_shared();  // the copies, to the wgmma reads
      };

      // S = Q K^T of tile t over the head dims, 16 at a time (a step's 32
      // bytes of each row sit inside one 64-dim panel), issued, not waited for.
      const auto issue_qk = [&](int t, float(&s)[kNT][4]) {
        const std::uint32_t k_addr = smem_addr(k_s + buf_of(t) * L::kTileBytes);
        const std::uint32_t q_tile_addr = kPerTileQDescriptors ? opaque(q_addr) : q_addr;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHC / kWgmmaK; ++kk) {
          const auto step = static_cast<std::uint32_t>((kk % kKStepsPerPanel) * kWgmmaK * 2);
          const auto panel = static_cast<std::uint32_t>(kk / kKStepsPerPanel);
          const std::uint64_t dq = smem_desc(q_tile_addr + panel * kQPanelStride + step, kChunkBytes, kAtomStride);
          const std::uint64_t dk = smem_desc(k_addr + panel * L::kPanelStride + step, kChunkBytes, kAtomStride);
          if constexpr (L::kTileKeys == 128) {
            if (kk == 0) {
              wgmma_m64n128k16_ss<T, true>(s, dq, dk);
            } else {
              wgmma_m64n128k16_ss<T, false>(s, dq, dk);
            }
          } else {
            if (kk == 0) {
              wgmma_m64n64k16_ss<T, true>(s, dq, dk);
            } else {
              wgmma_m64n64k16_ss<T, false>(s, dq, dk);
            }
          }
        }
        wgmma_commit();
      };
      // O += P V of tile t over its keys, 16 at a time (V read MN-major).
      const auto issue_pv = [&](int t, const std::uint32_t(&a)[kPvSteps][4], float(&o)[kDT][4]) {
        const std::uint32_t v_addr = smem_addr(v_s + buf_of(t) * L::kTileBytes);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kPvSteps; ++kk) {
          const std::uint64_t dv =
              smem_desc(v_addr + static_cast<std::uint32_t>(kk * kWgmmaK * kSwizzleBytes), L::kPanelStride, kAtomStride);
          wgmma_m64nk16_rs<TP, kHC>(o, a[kk], dv);
        }
        wgmma_commit();
      };
      float o[kDT][4];
      float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
      float l[2] = {0.0f, 0.0f};
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
      const auto softmax_tile = [&](int t, float(&s)[kNT][4]) {
        const int k0 = pt.tile_lo + t * L::kTileKeys;
        const bool whole = whole_block(p, pt.range, k0, k0 + L::kTileKeys - 1, warp_pos_lo, warp_pos_hi);
        const ScoreRows at{{row0 + row_base + g, row0 + row_base + g + 8}, row0 + rows, k0, tig};
        return softmax_scores(p, item, kv_head, group, pt.range, at, whole, qk_scale, qk_scale_log2, s, m, l);
      };
      const auto release = [&](std::uint64_t* empty, int t) { mbarrier_arrive(&empty[buf_of(t)]); };

      mbarrier_wait(bars.q_full, pass & 1);
      fence_proxy_async_shared();
      if (wg == 1) named_barrier_arrive(their_turn, kWgmmaConsumerThreads);  // warpgroup 0 goes first

      float s[kNT][4];
      std::uint32_t a[kPvSteps][4];
      wait_full(bars.k_full, 0);
      named_barrier_sync(my_turn, kWgmmaConsumerThreads);
      issue_qk(0, s);
      named_barrier_arrive(their_turn, kWgmmaConsumerThreads);
      wgmma_wait<0>();
      wgmma_pin(s);
      release(bars.k_empty, 0);
      if (pt.steps == 1) mbarrier_arrive(bars.q_empty);
      Rescale rescale = softmax_tile(0, s);
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) scores_to_a<TP>(s, kk, a[kk]);
      for (int t = 1; t < pt.steps; ++t) {
        wait_full(bars.k_full, t);
        wait_full(bars.v_full, t - 1);
        named_barrier_sync(my_turn, kWgmmaConsumerThreads);
        issue_qk(t, s);
        apply_rescale(rescale, o);
        issue_pv(t - 1, a, o);
        named_barrier_arrive(their_turn, kWgmmaConsumerThreads);
        wgmma_wait<1>();  // S of tile t (P V of t - 1 runs on)
        wgmma_pin(s);
        release(bars.k_empty, t);
        if (t == pt.steps - 1) mbarrier_arrive(bars.q_empty);
        rescale = softmax_tile(t, s);
        wgmma_wait<0>();
        wgmma_pin(o);
        release(bars.v_empty, t - 1);
#pragma unroll
        for (int kk = 0; kk < kPvSteps; ++kk) scores_to_a<TP>(s, kk, a[kk]);
      }
      wait_full(bars.v_full, pt.steps - 1);
      named_barrier_sync(my_turn, kWgmmaConsumerThreads);
      apply_rescale(rescale, o);
      issue_pv(pt.steps - 1, a, o);
      // Warpgroup 1 arrived once ahead at the start; it skips its last turn.
      if (wg == 0) named_barrier_arrive(their_turn, kWgmmaConsumerThreads);
      wgmma_wait<0>();
      wgmma_pin(o);
      release(bars.v_empty, pt.steps - 1);
      seq += pt.steps;
      ++pass;

      wgmma_store_rows<T>(p, item, kv_head, group, row0, rows, row_base + g, tig, o, m, l, v_scale);
    });
  });
}

template <int kHC, typename T, KvStore kKv>
__global__ void __launch_bounds__(kWgmmaThreads, kWgmmaCtasPerSm) wgmma_prefill_kernel(const FlashParams p) {
#if PAGEDATTN_WGMMA_ENABLED
  using L = WgmmaLayout<kHC>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Swizzled tiles need 1024-byte aligned addresses (the swizzle reads
  // address bits); the layout reserves the slack.
  const std::uint32_t misalign = smem_addr(smem_raw) % kSwizzleAtomBytes;
  unsigned char* smem = smem_raw + (misalign == 0 ? 0 : kSwizzleAtomBytes - misalign);
  unsigned char* q_s = smem;
  unsigned char* k_s = q_s + L::kQBytes;
  unsigned char* v_s = k_s + L::kKBytes;
  unsigned char* raw_s = v_s + L::kKBytes;
  auto* bar = reinterpret_cast<std::uint64_t*>(raw_s + WgmmaRawRing<kHC, kIsFp8<kKv>>::kBytes);
  const WgmmaBarriers bars{bar, bar + 1, bar + 2, bar + 2 + L::kStages, bar + 2 + 2 * L::kStages,
                           bar + 2 + 3 * L::kStages};
  if (threadIdx.x == 0) {
    mbarrier_init(bars.q_full, kWarpgroupThreads);
    mbarrier_init(bars.q_empty, kWgmmaConsumerThreads);
    for (int b = 0; b < L::kStages; ++b) {
      mbarrier_init(&bars.k_full[b], kWarpgroupThreads);
      mbarrier_init(&bars.k_empty[b], kWgmmaConsumerThreads);
      mbarrier_init(&bars.v_full[b], kWarpgroupThreads);
      mbarrier_init(&bars.v_empty[b], kWgmmaConsumerThreads);
    }
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) / kWarpgroupThreads == kWgmmaProducerWg) {
    setmaxnreg_dec<kProducerRegs>();
    wgmma_produce<kHC, T, kKv>(p, q_s, k_s, v_s, raw_s, bars);
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    wgmma_consume<kHC, T, kKv>(p, q_s, k_s, v_s, bars);
  }
#else
  (void)p;
#endif
}

template <int kHC, typename T, KvStore kKv>
int launch_wgmma_kernel(const FlashParams& p, cudaStream_t stream) {
  static std::atomic<std::uint64_t> configured{0};
  constexpr int kSmem = WgmmaLayout<kHC>::kSmemBytes + WgmmaRawRing<kHC, kIsFp8<kKv>>::kBytes;
  static_assert(kSmem <= kSm90MaxSmemBytes, "the CTA's shared memory fits an sm_90 multiprocessor");
  return launch_over_items(wgmma_prefill_kernel<kHC, T, kKv>, kWgmmaThreads, kSmem, configured, p, stream,
                           p.num_sms * kWgmmaCtasPerSm);
}

// The kernel of class kHC for the queries' dtype and the cache's storage.
template <int kHC, typename T>
int launch_wgmma_kv(const FlashParams& p, cudaStream_t stream) {
  if (p.kv_dtype == DType::FP8_E4M3) return launch_wgmma_kernel<kHC, T, KvStore::E4M3>(p, stream);
  if (p.kv_dtype == DType::FP8_E5M2) return launch_wgmma_kernel<kHC, T, KvStore::E5M2>(p, stream);
  if (p.kv_dtype == DType::BF16 || p.kv_dtype == DType::F16) {
    return launch_wgmma_kernel<kHC, T, KvStore::Bits16>(p, stream);
  }
  return kLaunchUnsupportedDType;
}

// The class's kernel for the queries' dtype (each class's translation unit
// instantiates it: instantiations.h).
template <int kHC>
int launch_wgmma_dtype(const FlashParams& p, DType dtype, cudaStream_t stream) {
  if (dtype == DType::F16) return launch_wgmma_kv<kHC, half>(p, stream);
  if (dtype == DType::BF16) return launch_wgmma_kv<kHC, __nv_bfloat16>(p, stream);
  return kLaunchUnsupportedDType;
}

}  // namespace pagedattn::cuda_flash::detail
