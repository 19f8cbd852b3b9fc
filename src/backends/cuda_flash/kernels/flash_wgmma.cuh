// Warpgroup MMA (wgmma, sm_90a) building blocks of the CUDA_FLASH Hopper
// prefill kernel: shared-memory matrix descriptors for 128-byte swizzled
// tiles, the two MMA shapes the kernel runs, their fences, and the mbarriers
// and named barriers its warpgroups meet at. Inline PTX; compiled only for
// sm_90a (the architecture-specific feature set): the sm_90-only bodies are
// empty elsewhere, so the header stays includable.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "flash_primitives.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PAGEDATTN_WGMMA_ENABLED 1
#else
#define PAGEDATTN_WGMMA_ENABLED 0
#endif

namespace pagedattn::cuda_flash::detail {

// A 128-byte swizzled tile of 16-bit elements: rows of 64 elements (128 B),
// grouped in atoms of 8 rows (1024 B) whose 16-byte chunks are permuted by
// chunk ^= row % 8, so the 8 rows an MMA operand reads hit distinct banks.
// Wider rows are stored as several such column panels, one after another.
inline constexpr int kSwizzleBytes = 128;
inline constexpr int kSwizzleElems = kSwizzleBytes / 2;
inline constexpr int kSwizzleAtomRows = 8;
inline constexpr int kSwizzleAtomBytes = kSwizzleAtomRows * kSwizzleBytes;  // the alignment a tile needs
inline constexpr int kChunkBytes = 16;

// Byte offset of 16-byte chunk `ch` (8 elements) of row `row` in a swizzled
// tile of `rows` rows.
__device__ __forceinline__ int swizzled_offset(int row, int ch, int rows) {
  constexpr int kChunksPerRow = kSwizzleBytes / kChunkBytes;
  const int panel = ch / kChunksPerRow;
  const int within = (ch % kChunksPerRow) ^ (row % kSwizzleAtomRows);
  return (panel * rows + row) * kSwizzleBytes + within * kChunkBytes;
}

// Matrix descriptor fields (PTX ISA, "Matrix Descriptor Format"): addresses
// and offsets in 16-byte units, 14 bits each; layout 1 = 128-byte swizzle.
inline constexpr int kDescUnitShift = 4;
inline constexpr int kDescLboShift = 16;
inline constexpr int kDescSboShift = 32;
inline constexpr int kDescLayoutShift = 62;
inline constexpr std::uint64_t kDescSwizzle128 = 1;
inline constexpr std::uint64_t kDescFieldMask = 0x3FFF;

// Descriptor of an operand at shared address `addr` inside a swizzled tile.
// K-major operands (Q, K: the reduction dimension contiguous) step 8-row
// atoms by `sbo` (1024 B); their leading offset is unused. MN-major ones
// (V read as B with N = head dims contiguous) step 64-column panels by `lbo`
// and 8-row atoms by `sbo`.
__device__ __forceinline__ std::uint64_t smem_desc(std::uint32_t addr, std::uint32_t lbo, std::uint32_t sbo) {
  return ((static_cast<std::uint64_t>(addr) >> kDescUnitShift) & kDescFieldMask) |
         (((static_cast<std::uint64_t>(lbo) >> kDescUnitShift) & kDescFieldMask) << kDescLboShift) |
         (((static_cast<std::uint64_t>(sbo) >> kDescUnitShift) & kDescFieldMask) << kDescSboShift) |
         (kDescSwizzle128 << kDescLayoutShift);
}

// `x` through an empty asm the compiler cannot see through or move: values
// derived from it inside a loop are computed there each iteration instead of
// hoisted out and kept live (or spilled) across the loop.
__device__ __forceinline__ std::uint32_t opaque(std::uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

// Orders this thread's register writes before the next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() {
#if PAGEDATTN_WGMMA_ENABLED
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if PAGEDATTN_WGMMA_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if PAGEDATTN_WGMMA_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Makes this thread's generic-proxy shared-memory writes (cp.async copies
// included) visible to the async proxy, which wgmma reads operands through.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if PAGEDATTN_WGMMA_ENABLED
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// ---- mbarriers and named barriers: the two warpgroups of the prefill kernel
// synchronize through these instead of CTA-wide barriers, so they can drift
// half a step apart (one's softmax under the other's MMAs). ----

__device__ __forceinline__ void mbarrier_init(std::uint64_t* bar, int count) {
#if PAGEDATTN_WGMMA_ENABLED
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#else
  (void)bar, (void)count;
#endif
}

// Arrives on `bar` once every cp.async this thread has issued so far has
// landed (without raising the pending count: the init count includes it).
__device__ __forceinline__ void cp_async_arrive(std::uint64_t* bar) {
#if PAGEDATTN_WGMMA_ENABLED
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#else
  (void)bar;
#endif
}

__device__ __forceinline__ void mbarrier_arrive(std::uint64_t* bar) {
#if PAGEDATTN_WGMMA_ENABLED
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#else
  (void)bar;
#endif
}

// Waits until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* bar, int parity) {
#if PAGEDATTN_WGMMA_ENABLED
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "retry:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra retry;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#else
  (void)bar, (void)parity;
#endif
}

// Named hardware barriers (0 is __syncthreads): `count` threads take part,
// those that sync wait, those that arrive do not.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Warp specialization (setmaxnreg): a warpgroup gives registers back to the
// multiprocessor's pool (dec) or takes them from it (inc) for the rest of the
// kernel; every warp of the warpgroup executes it. kRegs: a multiple of 8 in
// [24, 256].
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if PAGEDATTN_WGMMA_ENABLED
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if PAGEDATTN_WGMMA_ENABLED
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// Keeps the compiler from moving accumulator registers across a wgmma in
// flight (it does not know the asynchronous instruction still owns them).
template <int kN>
__device__ __forceinline__ void wgmma_pin(float (&d)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
  }
}

#define PAGEDATTN_WG_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define PAGEDATTN_WG_D32                                                                              \
  PAGEDATTN_WG_D4(0), PAGEDATTN_WG_D4(1), PAGEDATTN_WG_D4(2), PAGEDATTN_WG_D4(3), PAGEDATTN_WG_D4(4), \
      PAGEDATTN_WG_D4(5), PAGEDATTN_WG_D4(6), PAGEDATTN_WG_D4(7)
#define PAGEDATTN_WG_W4(j) "=f"(d[j][0]), "=f"(d[j][1]), "=f"(d[j][2]), "=f"(d[j][3])
#define PAGEDATTN_WG_W32                                                                              \
  PAGEDATTN_WG_W4(0), PAGEDATTN_WG_W4(1), PAGEDATTN_WG_W4(2), PAGEDATTN_WG_W4(3), PAGEDATTN_WG_W4(4), \
      PAGEDATTN_WG_W4(5), PAGEDATTN_WG_W4(6), PAGEDATTN_WG_W4(7)
#define PAGEDATTN_WG_D64                                                                              \
  PAGEDATTN_WG_D32, PAGEDATTN_WG_D4(8), PAGEDATTN_WG_D4(9), PAGEDATTN_WG_D4(10), PAGEDATTN_WG_D4(11), \
      PAGEDATTN_WG_D4(12), PAGEDATTN_WG_D4(13), PAGEDATTN_WG_D4(14), PAGEDATTN_WG_D4(15)
#define PAGEDATTN_WG_W64                                                                              \
  PAGEDATTN_WG_W32, PAGEDATTN_WG_W4(8), PAGEDATTN_WG_W4(9), PAGEDATTN_WG_W4(10), PAGEDATTN_WG_W4(11), \
      PAGEDATTN_WG_W4(12), PAGEDATTN_WG_W4(13), PAGEDATTN_WG_W4(14), PAGEDATTN_WG_W4(15)
#define PAGEDATTN_WG_REGS32                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define PAGEDATTN_WG_REGS64                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "     \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, " \
  "%39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, " \
  "%58, %59, %60, %61, %62, %63}"

#define PAGEDATTN_WG_D128                                                                    \
  PAGEDATTN_WG_D64, PAGEDATTN_WG_D4(16), PAGEDATTN_WG_D4(17), PAGEDATTN_WG_D4(18), PAGEDATTN_WG_D4(19), \
      PAGEDATTN_WG_D4(20), PAGEDATTN_WG_D4(21), PAGEDATTN_WG_D4(22), PAGEDATTN_WG_D4(23), PAGEDATTN_WG_D4(24), \
      PAGEDATTN_WG_D4(25), PAGEDATTN_WG_D4(26), PAGEDATTN_WG_D4(27), PAGEDATTN_WG_D4(28), PAGEDATTN_WG_D4(29), \
      PAGEDATTN_WG_D4(30), PAGEDATTN_WG_D4(31)
#define PAGEDATTN_WG_REGS128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, " \
  "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, " \
  "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, " \
  "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, " \
  "%123, %124, %125, %126, %127}"
// One wgmma statement per operand type (`ty`: "f16" or "bf16", both operands).
// SS: both operands from shared memory, K-major; scale_d "0" ignores the old D.
#define PAGEDATTN_WG_SS(shape, regs, descs, ty, scale_d, ...)                                          \
  asm volatile("wgmma.mma_async.sync.aligned." shape ".f32." ty "." ty " " regs ", " descs ", " scale_d \
               ", 1, 1, 0, 0;\n"                                                                        \
               : __VA_ARGS__                                                                            \
               : "l"(desc_a), "l"(desc_b))
// RS: A from registers, B from shared memory, MN-major (transposed).
#define PAGEDATTN_WG_RS(shape, regs, ops, ty, ...)                                             \
  asm volatile("wgmma.mma_async.sync.aligned." shape ".f32." ty "." ty " " regs ", " ops ", 1, 1, 1, 1;\n" \
               : __VA_ARGS__                                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))

// D[64 x 64] (+)= A[64 x 16] B[16 x 64]^T, both from shared memory, K-major
// (S = Q K^T of one 16-dim step; kFirst: D = A B^T, the old D neither read
// nor, as far as the compiler knows, needed: no zeroing instructions between
// asynchronous MMAs, which would make ptxas serialize them). Thread layout of
// D: warp w of the warpgroup holds rows 16w .. 16w + 15, d[nt] as an m16n8 C
// fragment of n-tile nt.
template <typename T, bool kFirst>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], std::uint64_t desc_a,
                                                   std::uint64_t desc_b) {
#if PAGEDATTN_WGMMA_ENABLED
  constexpr bool kHalf = std::is_same_v<T, half>;
#define PAGEDATTN_WG_SS64(ty, scale_d, ...) \
  PAGEDATTN_WG_SS("m64n64k16", PAGEDATTN_WG_REGS32, "%32, %33", ty, scale_d, __VA_ARGS__)
  if constexpr (kFirst && kHalf) {
    PAGEDATTN_WG_SS64("f16", "0", PAGEDATTN_WG_W32);
  } else if constexpr (kFirst) {
    PAGEDATTN_WG_SS64("bf16", "0", PAGEDATTN_WG_W32);
  } else if constexpr (kHalf) {
    PAGEDATTN_WG_SS64("f16", "1", PAGEDATTN_WG_D32);
  } else {
    PAGEDATTN_WG_SS64("bf16", "1", PAGEDATTN_WG_D32);
  }
#undef PAGEDATTN_WG_SS64
#else
  (void)d, (void)desc_a, (void)desc_b;
#endif
}

// D[64 x 128] (+)= A[64 x 16] B[16 x 128]^T, both from shared memory,
// K-major: wgmma_m64n64k16_ss over 128 keys (d[nt] for n-tiles 0 .. 15).
template <typename T, bool kFirst>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[16][4], std::uint64_t desc_a,
                                                    std::uint64_t desc_b) {
#if PAGEDATTN_WGMMA_ENABLED
  constexpr bool kHalf = std::is_same_v<T, half>;
#define PAGEDATTN_WG_SS128(ty, scale_d, ...) \
  PAGEDATTN_WG_SS("m64n128k16", PAGEDATTN_WG_REGS64, "%64, %65", ty, scale_d, __VA_ARGS__)
  if constexpr (kFirst && kHalf) {
    PAGEDATTN_WG_SS128("f16", "0", PAGEDATTN_WG_W64);
  } else if constexpr (kFirst) {
    PAGEDATTN_WG_SS128("bf16", "0", PAGEDATTN_WG_W64);
  } else if constexpr (kHalf) {
    PAGEDATTN_WG_SS128("f16", "1", PAGEDATTN_WG_D64);
  } else {
    PAGEDATTN_WG_SS128("bf16", "1", PAGEDATTN_WG_D64);
  }
#undef PAGEDATTN_WG_SS128
#else
  (void)d, (void)desc_a, (void)desc_b;
#endif
}

// D[64 x kN] += A[64 x 16] B[16 x kN], A from registers (an m16k16 A
// fragment per warp, as mma.sync takes it), B from shared memory, MN-major
// (O += P V of one 16-key step; V's rows are keys, head dims contiguous).
// kN: the head class, 64, 128 or 256.
template <typename T, int kN>
__device__ __forceinline__ void wgmma_m64nk16_rs(float (&d)[kN / 8][4], const std::uint32_t (&a)[4],
                                                 std::uint64_t desc_b) {
#if PAGEDATTN_WGMMA_ENABLED
  static_assert(kN == 64 || kN == 128 || kN == 256, "a head class");
  constexpr bool kHalf = std::is_same_v<T, half>;
#define PAGEDATTN_WG_RS64(ty) \
  PAGEDATTN_WG_RS("m64n64k16", PAGEDATTN_WG_REGS32, "{%32, %33, %34, %35}, %36", ty, PAGEDATTN_WG_D32)
#define PAGEDATTN_WG_RS128(ty) \
  PAGEDATTN_WG_RS("m64n128k16", PAGEDATTN_WG_REGS64, "{%64, %65, %66, %67}, %68", ty, PAGEDATTN_WG_D64)
#define PAGEDATTN_WG_RS256(ty) \
  PAGEDATTN_WG_RS("m64n256k16", PAGEDATTN_WG_REGS128, "{%128, %129, %130, %131}, %132", ty, PAGEDATTN_WG_D128)
  if constexpr (kN == 64) {
    if constexpr (kHalf) {
      PAGEDATTN_WG_RS64("f16");
    } else {
      PAGEDATTN_WG_RS64("bf16");
    }
  } else if constexpr (kN == 128) {
    if constexpr (kHalf) {
      PAGEDATTN_WG_RS128("f16");
    } else {
      PAGEDATTN_WG_RS128("bf16");
    }
  } else {
    if constexpr (kHalf) {
      PAGEDATTN_WG_RS256("f16");
    } else {
      PAGEDATTN_WG_RS256("bf16");
    }
  }
#undef PAGEDATTN_WG_RS64
#undef PAGEDATTN_WG_RS128
#undef PAGEDATTN_WG_RS256
#else
  (void)d, (void)a, (void)desc_b;
#endif
}

#undef PAGEDATTN_WG_D4
#undef PAGEDATTN_WG_D32
#undef PAGEDATTN_WG_W4
#undef PAGEDATTN_WG_W32
#undef PAGEDATTN_WG_D64
#undef PAGEDATTN_WG_D128
#undef PAGEDATTN_WG_REGS128
#undef PAGEDATTN_WG_W64
#undef PAGEDATTN_WG_REGS32
#undef PAGEDATTN_WG_REGS64
#undef PAGEDATTN_WG_SS
#undef PAGEDATTN_WG_RS

}  // namespace pagedattn::cuda_flash::detail
