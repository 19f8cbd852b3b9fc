// Warp-level building blocks of the CUDA_FLASH kernels: tensor-core MMA
// (m16n8k16, 16-bit operands, fp32 accumulation), ldmatrix, cp.async and the
// fp8 / int8 -> 16-bit conversions. Inline PTX, sm_80 and newer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace pagedattn::cuda_flash::detail {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

template <typename T>
struct Elem;

template <>
struct Elem<half> {
  __device__ __forceinline__ static void mma(float c[4], const std::uint32_t a[4], std::uint32_t b0,
                                             std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    std::uint32_t u;
    std::memcpy(&u, &h, sizeof u);
    return u;
  }
};

template <>
struct Elem<__nv_bfloat16> {
  __device__ __forceinline__ static void mma(float c[4], const std::uint32_t a[4], std::uint32_t b0,
                                             std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    std::uint32_t u;
    std::memcpy(&u, &h, sizeof u);
    return u;
  }
};

// 2^x by the SFU (about 2 ulp; 2^-inf = 0): exp2f's exact path costs several
// extra instructions per score.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two MMAs sharing one A operand: b[0..1] and b[2..3] are the B operands of
// two adjacent n-tiles, as one ldmatrix.x4 delivers them.
template <typename T>
__device__ __forceinline__ void mma_x2(float c0[4], float c1[4], const std::uint32_t a[4],
                                       const std::uint32_t b[4]) {
  Elem<T>::mma(c0, a, b[0], b[1]);
  Elem<T>::mma(c1, a, b[2], b[3]);
}

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(std::uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_trans(std::uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// 16-byte global -> shared copy of which only the first src_bytes (0..16)
// are read; the rest of the destination is zero-filled. Both addresses are
// 16-byte aligned.
__device__ __forceinline__ void cp_async_16_prefix(void* dst, const void* src, int src_bytes) {
  // No memory clobber: it would pin every surrounding load in program order;
  // the commit/wait below and __syncthreads() order the shared memory. The
  // L2::128B prefetch-size hint made the paged decodes 1.8-2.0 % faster on an
  // H100, prefill level (docs/perf-log/cuda_flash-issue-31.md).
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}

// 16-byte global -> shared copy; when !valid nothing is read and the
// destination is zero-filled (masked loads: poisoned slots are never touched).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  cp_async_16_prefix(dst, src, valid ? 16 : 0);
}

// kBytes-byte (16, 8 or 4) global -> shared copy through L1; when !valid
// nothing is read and the destination is zero-filled. fp8 rows (16 values,
// has_wide_fp8_rows, or 8-value chunks) and f32 per-token-head scales: their
// copies are faster through L1 than cp_async_16's L2-only path.
template <int kBytes>
__device__ __forceinline__ void cp_async_ca(void* dst, const void* src, bool valid) {
  static_assert(kBytes == 16 || kBytes == 8 || kBytes == 4, "cp.async copies 4, 8 or 16 bytes");
  const int src_bytes = valid ? kBytes : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(kBytes),
               "r"(src_bytes));
}

// Reads one plan entry (a struct of whole 16-byte words, 16-byte aligned)
// with vector loads the compiler may not move: issued at the call, they run
// beside loads issued next to them instead of after the first use of those.
template <typename T>
__device__ __forceinline__ T load_plan_entry(const T* src) {
  static_assert(sizeof(T) % 16 == 0 && alignof(T) >= 16);
  constexpr int kWords = static_cast<int>(sizeof(T) / 16);
  uint4 words[kWords];
  const auto* from = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(words[i].x), "=r"(words[i].y), "=r"(words[i].z), "=r"(words[i].w)
                 : "l"(from + i));
  }
  T entry;
  std::memcpy(&entry, words, sizeof(T));
  return entry;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four fp8 values (bytes 0..3 of w) -> two f16x2 words: bytes (0, 1) -> lo,
// bytes (2, 3) -> hi; one hardware conversion each, exact for e4m3 and e5m2.
template <__nv_fp8_interpretation_t kKind>
__device__ __forceinline__ void fp8x4_to_f16x2(std::uint32_t w, std::uint32_t& lo, std::uint32_t& hi) {
  const __half2_raw l = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xFFFFu), kKind);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), kKind);
  lo = static_cast<std::uint32_t>(l.x) | (static_cast<std::uint32_t>(l.y) << 16);
  hi = static_cast<std::uint32_t>(h.x) | (static_cast<std::uint32_t>(h.y) << 16);
}

// Four int8 values (bytes 0..3 of w) -> two f16x2 words, as
// fp8x4_to_f16x2 pairs them, each value exact: each byte, offset to unsigned
// (b = q + 128), becomes the low mantissa byte of the f16 1024 + b (a byte
// permute); then (1024 + b) - 1152, one add, is exact.
__device__ __forceinline__ void i8x4_to_f16x2(std::uint32_t w, std::uint32_t& lo, std::uint32_t& hi) {
  constexpr std::uint32_t kSignFlip = 0x80808080u;
  constexpr std::uint32_t kHighBytes = 0x64646464u;  // 0x64xx is the f16 1024 + xx
  constexpr std::uint32_t kBytes01 = 0x4140;         // (byte 0, 0x64, byte 1, 0x64)
  constexpr std::uint32_t kBytes23 = 0x4342;         // (byte 2, 0x64, byte 3, 0x64)
  const __half2 offset = __float2half2_rn(-1152.0f);
  const std::uint32_t u = w ^ kSignFlip;
  const std::uint32_t l = __byte_perm(u, kHighBytes, kBytes01);
  const std::uint32_t h = __byte_perm(u, kHighBytes, kBytes23);
  __half2 lh;
  __half2 hh;
  std::memcpy(&lh, &l, sizeof lh);
  std::memcpy(&hh, &h, sizeof hh);
  const __half2 rl = __hadd2(lh, offset);
  const __half2 rh = __hadd2(hh, offset);
  std::memcpy(&lo, &rl, sizeof lo);
  std::memcpy(&hi, &rh, sizeof hi);
}

// The two 16-bit values of a word (low half first) as floats.
template <typename T>
__device__ __forceinline__ float2 to_float2(std::uint32_t w);

template <>
__device__ __forceinline__ float2 to_float2<half>(std::uint32_t w) {
  __half2 h;
  std::memcpy(&h, &w, sizeof h);
  return __half22float2(h);
}

template <>
__device__ __forceinline__ float2 to_float2<__nv_bfloat16>(std::uint32_t w) {
  return {__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u)};  // a bf16 is the top half of its float
}

// Stores eight floats as T at a 16-byte aligned address.
template <typename T>
__device__ __forceinline__ void store8(void* dst, const float v[8]) {
  uint4 packed;
  packed.x = Elem<T>::pack(v[0], v[1]);
  packed.y = Elem<T>::pack(v[2], v[3]);
  packed.z = Elem<T>::pack(v[4], v[5]);
  packed.w = Elem<T>::pack(v[6], v[7]);
  *static_cast<uint4*>(dst) = packed;
}

}  // namespace pagedattn::cuda_flash::detail
