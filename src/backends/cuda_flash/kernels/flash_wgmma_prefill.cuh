// The Hopper prefill kernel of CUDA_FLASH (sm_90a, head class 128, 16-bit
// K/V): the mma.sync kernel's work items and online softmax, with S = Q K^T
// and O += P V on warpgroup MMAs (wgmma) that read Q, K and V straight from
// 128-byte swizzled shared memory, where mma.sync had every warp load its
// operands through ldmatrix into registers it did not have (255, with spills).
//
// A CTA is two warpgroups (256 threads) and takes a 128-row pass: warpgroup w
// owns packed rows [64w, 64w + 64) and every key of a tile, so each K/V tile
// in shared memory serves 128 rows, as in the mma.sync prefill pass. All 256
// threads copy K/V tiles (cp.async into five buffers, three tiles ahead)
// through the same KvRunWalker. Any item runs here as 128-row passes (a
// decode item too: a graph captured on a prefill-only step may replay a mixed
// plan), correct and, for decode items, slower.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "flash_params.h"
#include "flash_pass.cuh"
#include "flash_primitives.cuh"
#include "flash_wgmma.cuh"

namespace pagedattn::cuda_flash::detail {

inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kWgmmaTileRows = 64;  // rows of one warpgroup's MMA tile
inline constexpr int kWgmmaWarpgroups = kPrefillRows / kWgmmaTileRows;
inline constexpr int kWgmmaThreads = kWgmmaWarpgroups * kWarpgroupThreads;
inline constexpr int kWgmmaK = 16;  // the reduction depth of one 16-bit wgmma

// Shared memory: alignment slack (swizzled tiles start on 1024-byte atoms),
// Q [128 rows, 128 dims], then kStages buffers of K and V tiles [64 keys, 128
// dims] (all swizzled, 64-dim panels), which the fp32 O stage [128, 128]
// reuses, then (m, l) per row, then the buffers' mbarriers.
struct WgmmaLayout {
  static constexpr int kHC = kWgmmaClass;
  static constexpr int kChunks = kHC / kChunkElems;
  static constexpr int kKeysPerRun = kBlockN * kChunks / kWgmmaThreads;
  static constexpr int kStages = 5;  // K/V tile buffers (the key loop says why)
  static constexpr int kQBytes = kPrefillRows * kHC * 2;
  static constexpr int kTileBytes = kBlockN * kHC * 2;  // one K or V tile
  static constexpr int kKVBytes = kStages * 2 * kTileBytes;
  static constexpr int kStageBytes = kPrefillRows * kHC * 4;
  static constexpr int kBodyBytes = kKVBytes > kStageBytes ? kKVBytes : kStageBytes;
  static constexpr int kMLBytes = kPrefillRows * 2 * 4;
  static constexpr int kBarrierBytes = 2 * kStages * static_cast<int>(sizeof(std::uint64_t));  // full + empty
  static constexpr int kSmemBytes = kSwizzleAtomBytes + kQBytes + kBodyBytes + kMLBytes + kBarrierBytes;
  static_assert(kWgmmaThreads % kChunks == 0, "a thread's column must not change between its keys");
};

// Descriptor offsets of the swizzled tiles: 8-row atoms are 1024 B apart; the
// 64-dim panels of a K or V tile are kBlockN rows apart.
inline constexpr std::uint32_t kAtomStride = kSwizzleAtomBytes;
inline constexpr std::uint32_t kPanelStride = kBlockN * kSwizzleBytes;
inline constexpr int kKStepsPerPanel = kSwizzleElems / kWgmmaK;
// Named barriers of the ping-pong: warpgroup w waits on kTurnBarrier + w.
inline constexpr int kTurnBarrier = 1;

// The K/V buffers' synchronization, shared by the passes of a CTA: `full[b]`
// completes a phase when every thread's copies of the tile in buffer b have
// landed, `empty[b]` when every thread has retired the MMAs reading it. Tiles
// are numbered across passes (`seq`), so tile G lives in buffer G % kStages
// and is that buffer's phase G / kStages.
struct TileSync {
  std::uint64_t* full;
  std::uint64_t* empty;
  int seq;  // number of tiles of the CTA's earlier passes
};

// One 128-row pass of an item. Shared memory (swizzled where marked):
//   q_s    [kPrefillRows, kHC] swizzled
//   kv_s   [kStages][K, V][kBlockN, kHC] swizzled; aliased by
//   stage  [kPrefillRows, kHC] fp32 O, after the key loop
//   ml     [kPrefillRows, 2] (m, l)
template <typename T>
__device__ void wgmma_prefill_pass(const FlashParams& p, const WorkItem& item, int kv_head, int group,
                                   int bt_stride, int row0, int rows, unsigned char* q_s, unsigned char* kv_s,
                                   float* stage, float* ml, TileSync& sync) {
  using L = WgmmaLayout;
  constexpr int kHC = L::kHC;
  constexpr int kNT = kBlockN / 8;  // 8-key n-tiles of S
  constexpr int kDT = kHC / 8;      // 8-dim n-tiles of O
  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid / kWarpgroupThreads;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int tig = lane % 4;

  __syncthreads();  // the previous pass has finished with shared memory

  // ---- query rows -> swizzled shared memory (one cp.async group) ----
  for (int c = tid; c < kPrefillRows * L::kChunks; c += kWgmmaThreads) {
    const int r = c / L::kChunks;
    const int ch = c % L::kChunks;
    bool valid = false;
    const T* src = query_chunk_src<T>(p, item, kv_head, group, row0, rows, r, ch, valid);
    cp_async_16(q_s + swizzled_offset(r, ch, kPrefillRows), valid ? src : p.query, valid);
  }
  cp_async_commit();

  const PassRange range = pass_range(p, item, group, row0, rows);
  const int tile_lo = range.kv_lo - range.kv_lo % kBlockN;
  const int num_tiles = range.kv_hi > range.kv_lo ? (range.kv_hi - tile_lo + kBlockN - 1) / kBlockN : 0;

  // This thread's rows: g and g + 8 of its warp's 16 rows of the warpgroup tile.
  const int row_base = wg * kWgmmaTileRows + (tid % kWarpgroupThreads) / 32 * kMmaRows;
  const int warp_pos_lo = item.position_begin + (row0 + row_base) / group;
  const int warp_pos_hi = item.position_begin + (row0 + row_base + kMmaRows - 1) / group;
  const float qk_scale = p.variant.scale;
  const float qk_scale_log2 = qk_scale * kLog2e;

  float o[kDT][4];
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;

  const int my_ch = tid % L::kChunks;
  const int my_run = tid / L::kChunks;
  const KvRunWalker<L::kKeysPerRun> walker(p, item, kv_head, bt_stride, range, tile_lo, my_ch, my_run, 2);
  const auto issue_tile = [&](int t, int buf, RunStart run) {
    unsigned char* k_tile = kv_s + buf * 2 * L::kTileBytes;
    walker.walk(t, run, [&](int i, bool valid, const char* k_src, const char* v_src) {
      const int off = swizzled_offset(my_run * L::kKeysPerRun + i, my_ch, kBlockN);
      cp_async_16(k_tile + off, k_src, valid);
      cp_async_16(k_tile + L::kTileBytes + off, v_src, valid);
    });
  };

  const std::uint32_t q_addr =
      smem_addr(q_s) + static_cast<std::uint32_t>(wg * kWgmmaTileRows * kSwizzleBytes);
  const auto tile_addr = [&](int t) {
    return smem_addr(kv_s + ((sync.seq + t) % L::kStages) * 2 * L::kTileBytes);
  };
  // S = Q K^T of tile t over the head dims, 16 at a time (a step's 32 bytes
  // of each row sit inside one 64-dim panel), issued, not waited for.
  const auto issue_qk = [&](int t, float(&s)[kNT][4]) {
    const std::uint32_t k_addr = tile_addr(t);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHC / kWgmmaK; ++kk) {
      const auto step = static_cast<std::uint32_t>((kk % kKStepsPerPanel) * kWgmmaK * 2);
      const auto panel = static_cast<std::uint32_t>(kk / kKStepsPerPanel);
      const std::uint64_t dq =
          smem_desc(q_addr + panel * kPrefillRows * kSwizzleBytes + step, kChunkBytes, kAtomStride);
      const std::uint64_t dk = smem_desc(k_addr + panel * kPanelStride + step, kChunkBytes, kAtomStride);
      if (kk == 0) {
        wgmma_m64n64k16_ss<T, true>(s, dq, dk);
      } else {
        wgmma_m64n64k16_ss<T, false>(s, dq, dk);
      }
    }
    wgmma_commit();
  };

  // O += P V of tile t over its keys, 16 at a time (V read MN-major).
  const auto issue_pv = [&](int t, const std::uint32_t(&a)[kBlockN / kWgmmaK][4]) {
    const std::uint32_t v_addr = tile_addr(t) + L::kTileBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / kWgmmaK; ++kk) {
      const std::uint64_t dv = smem_desc(v_addr + static_cast<std::uint32_t>(kk * kWgmmaK * kSwizzleBytes),
                                         kPanelStride, kAtomStride);
      wgmma_m64n128k16_rs<T>(o, a[kk], dv);
    }
    wgmma_commit();
  };
  const auto softmax_tile = [&](int t, float(&s)[kNT][4]) {
    const int k0 = tile_lo + t * kBlockN;
    const bool whole = whole_block(p, range, k0, k0 + kBlockN - 1, warp_pos_lo, warp_pos_hi);
    const ScoreRows at{{row0 + row_base + g, row0 + row_base + g + 8}, row0 + rows, k0, tig};
    return softmax_scores(p, item, kv_head, group, range, at, whole, qk_scale, qk_scale_log2, s, m, l);
  };

  // ---- the key loop ----
  // FlashAttention-3's intra-warpgroup pipelining: step t issues S of tile t,
  // then P V of tile t - 1, and runs the softmax of tile t on the CUDA cores
  // while P V runs on the tensor cores; O is rescaled just before the next
  // P V. Every step retires its MMAs (ptxas serializes the wgmmas of a loop
  // whose MMAs in flight differ between paths), and a pass with no key tile
  // still runs one, on a zero-filled tile 0 whose keys are all masked.
  // And its ping-pong: the warpgroups take turns to issue their MMAs (named
  // barriers), so each one's softmax runs under the other's MMAs. They meet
  // only at the buffers' mbarriers, not at a CTA barrier per step. A tile's
  // buffer is read from step t (K) to t + 1 (V), so copies run kAhead tiles
  // ahead into the buffer of tile t - 2 once both warpgroups released it.
  // Every copy into a used buffer waits for its release, the prologue's too:
  // those phases completed before the previous pass's CTA barrier, so the wait
  // returns at once, but a thread must observe a phase complete before it
  // arrives on the barrier's next one (compute-sanitizer's synccheck reports
  // the arrival otherwise).
  constexpr int kAhead = L::kStages - 2;
  const int steps = max(num_tiles, 1);
  RunStart run = walker.locate(0);
  const auto copy_tile = [&](int c) {
    const int gt = sync.seq + c;
    const int buf = gt % L::kStages;
    if (gt >= L::kStages) mbarrier_wait(&sync.empty[buf], (gt / L::kStages - 1) & 1);
    issue_tile(c, buf, run);
    cp_async_arrive(&sync.full[buf]);
    cp_async_commit();
    run = walker.locate(c + 1);
  };
  for (int c = 0; c < kAhead && c < steps; ++c) copy_tile(c);
  cp_async_wait<0>();  // the queries (and the first tiles)
  fence_proxy_async_shared();
  __syncthreads();

  const auto wait_tile = [&](int t) {
    const int gt = sync.seq + t;
    mbarrier_wait(&sync.full[gt % L::kStages], (gt / L::kStages) & 1);
    fence_proxy_async_shared();  // the copies, to the wgmma reads
  };
  const auto release_tile = [&](int t) { mbarrier_arrive(&sync.empty[(sync.seq + t) % L::kStages]); };
  const int my_turn = kTurnBarrier + wg;
  const int their_turn = kTurnBarrier + 1 - wg;
  if (wg == 1) named_barrier_arrive(their_turn, kWgmmaThreads);  // warpgroup 0 goes first

  float s[kNT][4];
  std::uint32_t a[kBlockN / kWgmmaK][4];
  wait_tile(0);
  named_barrier_sync(my_turn, kWgmmaThreads);
  issue_qk(0, s);
  named_barrier_arrive(their_turn, kWgmmaThreads);
  if (kAhead < num_tiles) copy_tile(kAhead);
  wgmma_wait<0>();
  wgmma_pin(s);
  Rescale rescale = softmax_tile(0, s);
#pragma unroll
  for (int kk = 0; kk < kBlockN / kWgmmaK; ++kk) scores_to_a<T>(s, kk, a[kk]);
  for (int t = 1; t < num_tiles; ++t) {
    wait_tile(t);
    named_barrier_sync(my_turn, kWgmmaThreads);
    issue_qk(t, s);
    apply_rescale(rescale, o);
    issue_pv(t - 1, a);
    named_barrier_arrive(their_turn, kWgmmaThreads);
    if (t + kAhead < num_tiles) copy_tile(t + kAhead);
    wgmma_wait<1>();  // S of tile t (P V of t - 1 runs on)
    wgmma_pin(s);
    rescale = softmax_tile(t, s);
    wgmma_wait<0>();
    wgmma_pin(o);
    release_tile(t - 1);
#pragma unroll
    for (int kk = 0; kk < kBlockN / kWgmmaK; ++kk) scores_to_a<T>(s, kk, a[kk]);
  }
  named_barrier_sync(my_turn, kWgmmaThreads);
  apply_rescale(rescale, o);
  issue_pv(steps - 1, a);
  // Warpgroup 1 arrived once ahead at the start; it skips its last turn.
  if (wg == 0) named_barrier_arrive(their_turn, kWgmmaThreads);
  wgmma_wait<0>();
  wgmma_pin(o);
  release_tile(steps - 1);
  sync.seq += steps;
  cp_async_wait<0>();
  __syncthreads();

  // ---- stage (m, l, O) (aliases the K/V tiles), then the epilogue ----
  stage_warp_rows<kHC, false>(o, m, l, row_base + g, tig, stage, ml);
  __syncthreads();
  write_pass_output<kHC, T, false, kWgmmaThreads>(p, item, kv_head, group, row0, rows, stage, ml, 1.0f);
}

template <typename T>
__global__ void __launch_bounds__(kWgmmaThreads, kWgmmaCtasPerSm) wgmma_prefill_kernel(const FlashParams p) {
#if PAGEDATTN_WGMMA_ENABLED
  using L = WgmmaLayout;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Swizzled tiles need 1024-byte aligned addresses (the swizzle reads
  // address bits); the layout reserves the slack.
  const std::uint32_t misalign = smem_addr(smem_raw) % kSwizzleAtomBytes;
  unsigned char* smem = smem_raw + (misalign == 0 ? 0 : kSwizzleAtomBytes - misalign);
  unsigned char* q_s = smem;
  unsigned char* kv_s = smem + L::kQBytes;
  auto* stage = reinterpret_cast<float*>(kv_s);
  auto* ml = reinterpret_cast<float*>(kv_s + L::kBodyBytes);
  auto* bars = reinterpret_cast<std::uint64_t*>(kv_s + L::kBodyBytes + L::kMLBytes);
  TileSync sync{bars, bars + L::kStages, 0};
  if (threadIdx.x == 0) {
    for (int b = 0; b < L::kStages; ++b) {
      mbarrier_init(&sync.full[b], kWgmmaThreads);
      mbarrier_init(&sync.empty[b], kWgmmaThreads);
    }
  }
  __syncthreads();
  for_each_item(p, [&](const WorkItem& item, int kv_head, int group, int bt_stride) {
    const int rows_total = item.num_tokens * group;
    for (int row0 = 0; row0 < rows_total; row0 += kPrefillRows) {
      wgmma_prefill_pass<T>(p, item, kv_head, group, bt_stride, row0, min(kPrefillRows, rows_total - row0),
                            q_s, kv_s, stage, ml, sync);
    }
  });
#else
  (void)p;
#endif
}

template <typename T>
int launch_wgmma_kernel(const FlashParams& p, cudaStream_t stream) {
  static std::atomic<std::uint64_t> configured{0};
  return launch_over_items(wgmma_prefill_kernel<T>, kWgmmaThreads, WgmmaLayout::kSmemBytes, configured, p,
                           stream);
}

}  // namespace pagedattn::cuda_flash::detail
