// The tile loop's fp32 micro-kernels, for every target: score tiles (rowwise
// for few rows, through a transposed K tile for many) and P V (from the V rows,
// or a converted V tile). Targets add faster overloads for their full vector
// (store_row_sums, transpose_k_tile) and the AVX512-BF16 kernels (Bf16Tiles),
// in the headers included below. Highway per-target header.
#if defined(PAGEDATTN_CPU_ATTN_PREFILL_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEDATTN_CPU_ATTN_PREFILL_TILES_INL_H_
#undef PAGEDATTN_CPU_ATTN_PREFILL_TILES_INL_H_
#else
#define PAGEDATTN_CPU_ATTN_PREFILL_TILES_INL_H_
#endif

#include <hwy/highway.h>

#include "backends/cpu_attn/kernels/cpu_attn_common-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_prefill_tiles_avx2-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_prefill_tiles_avx512-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_target-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Stores the sums of kRowBlock accumulators into column i of the score tile
// (rows r0 .. r0 + rb). Targets may overload it for their full vector.
template <class D>
HWY_INLINE void store_row_sums(D d, const Scratch& sc, int r0, int rb, int i,
                               const hn::Vec<D> (&acc)[kRowBlock]) {
  static_assert(kRowBlock == 4, "rows are summed four at a time");
  store_sums4(d, acc, sc.s + r0 * kTileKeys + i, kTileKeys, rb);
}

// S[r, i] = q_r . k_i for keys straight from their rows (few rows). Always
// kRowBlock rows (missing rows of a partial block reuse row r0 and are not
// stored), so the accumulators stay in registers.
template <DType KV, class D>
void scores_rowwise(D d, const Scratch& sc, int rows, int d_size, int n, const unsigned char* const* k_rows) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  const auto esize = static_cast<int>(dtype_size(KV));
  for (int i = 0; i < n; ++i) {
    for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int rb = std::min(kRowBlock, rows - r0);
      const float* q[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) q[r] = sc.q + (r0 + (r < rb ? r : 0)) * d_size;
      hn::Vec<D> acc[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) acc[r] = hn::Zero(d);
      for (int c = 0; c < d_size; c += lanes) {
        const auto k = load_kv<KV>(d, k_rows[i] + c * esize);
        for (int r = 0; r < kRowBlock; ++r) acc[r] = hn::MulAdd(hn::LoadU(d, q[r] + c), k, acc[r]);
      }
      store_row_sums(d, sc, r0, rb, i, acc);
    }
  }
}

// sc.kt [D, kTileKeys] = the tile's K rows, converted and transposed element
// by element; keys past n are zeros (the softmax masks their columns).
// Targets may overload it for their full vector.
template <DType KV, class D>
void transpose_k_tile(D d, const Scratch& sc, int d_size, int n, const unsigned char* const* k_rows) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  const auto esize = static_cast<int>(dtype_size(KV));
  for (int i = 0; i < kTileKeys; ++i) {
    if (i < n) {
      for (int c = 0; c < d_size; c += lanes)
        hn::StoreU(load_kv<KV>(d, k_rows[i] + c * esize), d, sc.tmp + c);
      for (int e = 0; e < d_size; ++e) sc.kt[e * kTileKeys + i] = sc.tmp[e];
    } else {
      for (int e = 0; e < d_size; ++e) sc.kt[e * kTileKeys + i] = 0.0f;
    }
  }
}

// S = Q K^T through a transposed K tile (many rows): no horizontal reductions.
// Not inlined: inside the tile loop its register block lost registers to the
// caller's live values and spilled (q2k ~10% slower, docs/cpu_attn.md).
template <DType KV, class D>
HWY_NOINLINE void scores_transposed(D d, const Scratch& sc, int rows, int d_size, int n,
                                    const unsigned char* const* k_rows) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  transpose_k_tile<KV>(d, sc, d_size, n, k_rows);
  const int key_vecs = kTileKeys / lanes;
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int rb = std::min(kRowBlock, rows - r0);
    // Always kRowBlock rows (missing rows of a partial block reuse row r0 and
    // are not stored): a runtime row count would keep the accumulators in
    // memory, which is what AVX2 (no vdpbf16ps path) runs for every prefill.
    const float* q[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) q[r] = sc.q + (r0 + (r < rb ? r : 0)) * d_size;
    for (int kv0 = 0; kv0 < key_vecs; kv0 += 2) {
      // Two key vectors x four rows: eight accumulators stay in registers.
      const int kvn = std::min(2, key_vecs - kv0);
      hn::Vec<D> acc[kRowBlock][2];
      for (int r = 0; r < kRowBlock; ++r) acc[r][0] = acc[r][1] = hn::Zero(d);
      for (int e = 0; e < d_size; ++e) {
        const float* col = sc.kt + e * kTileKeys + kv0 * lanes;
        const auto k0 = hn::Load(d, col);
        const auto k1 = kvn > 1 ? hn::Load(d, col + lanes) : hn::Zero(d);
        for (int r = 0; r < kRowBlock; ++r) {
          const auto qv = hn::Set(d, q[r][e]);
          acc[r][0] = hn::MulAdd(qv, k0, acc[r][0]);
          acc[r][1] = hn::MulAdd(qv, k1, acc[r][1]);
        }
      }
      for (int r = 0; r < rb; ++r) {
        float* out = sc.s + (r0 + r) * kTileKeys + kv0 * lanes;
        hn::Store(acc[r][0], d, out);
        if (kvn > 1) hn::Store(acc[r][1], d, out + lanes);
      }
    }
  }
}

// The AVX512-BF16 tile-loop kernels (TileScores::kTransposedBf16,
// TilePv::kBf16): defined by the targets whose TargetShape has bf16_dot
// (cpu_attn_prefill_tiles_avx512-inl.h); the host names them nowhere else.
template <DType KV>
struct Bf16Tiles;

// acc = alpha * acc + P V. `v_rows` point at the rows of the tile, or null when
// the tile was converted into sc.vf. Full blocks of kRowBlock rows keep their
// accumulators in registers (a runtime row count would spill them).
template <DType KV, class D>
HWY_INLINE hn::Vec<D> load_v(D d, const Scratch& sc, const unsigned char* const* v_rows, int i, int c,
                             int d_size) {
  if (v_rows != nullptr) return load_kv<KV>(d, v_rows[i] + c * static_cast<int>(dtype_size(KV)));
  return hn::Load(d, sc.vf + i * d_size + c);
}

template <DType KV, class D>
void accumulate_pv(D d, const Scratch& sc, int rows, int d_size, int n, const unsigned char* const* v_rows) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  int r0 = 0;
  for (; r0 + kRowBlock <= rows; r0 += kRowBlock) {
    float* a[kRowBlock];
    const float* prob[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) {
      a[r] = sc.acc + (r0 + r) * d_size;
      prob[r] = sc.s + (r0 + r) * kTileKeys;
    }
    const auto alpha0 = hn::Set(d, sc.alpha[r0]);
    const auto alpha1 = hn::Set(d, sc.alpha[r0 + 1]);
    const auto alpha2 = hn::Set(d, sc.alpha[r0 + 2]);
    const auto alpha3 = hn::Set(d, sc.alpha[r0 + 3]);
    for (int c = 0; c < d_size; c += lanes) {
      auto acc0 = hn::Mul(hn::Load(d, a[0] + c), alpha0);
      auto acc1 = hn::Mul(hn::Load(d, a[1] + c), alpha1);
      auto acc2 = hn::Mul(hn::Load(d, a[2] + c), alpha2);
      auto acc3 = hn::Mul(hn::Load(d, a[3] + c), alpha3);
      for (int i = 0; i < n; ++i) {
        const auto v = load_v<KV>(d, sc, v_rows, i, c, d_size);
        acc0 = hn::MulAdd(hn::Set(d, prob[0][i]), v, acc0);
        acc1 = hn::MulAdd(hn::Set(d, prob[1][i]), v, acc1);
        acc2 = hn::MulAdd(hn::Set(d, prob[2][i]), v, acc2);
        acc3 = hn::MulAdd(hn::Set(d, prob[3][i]), v, acc3);
      }
      hn::Store(acc0, d, a[0] + c);
      hn::Store(acc1, d, a[1] + c);
      hn::Store(acc2, d, a[2] + c);
      hn::Store(acc3, d, a[3] + c);
    }
  }
  for (; r0 < rows; ++r0) {  // leftover rows, one at a time
    float* a = sc.acc + r0 * d_size;
    const float* prob = sc.s + r0 * kTileKeys;
    const auto alpha = hn::Set(d, sc.alpha[r0]);
    for (int c = 0; c < d_size; c += lanes) {
      auto acc = hn::Mul(hn::Load(d, a + c), alpha);
      for (int i = 0; i < n; ++i)
        acc = hn::MulAdd(hn::Set(d, prob[i]), load_v<KV>(d, sc, v_rows, i, c, d_size), acc);
      hn::Store(acc, d, a + c);
    }
  }
}

// acc = alpha * acc + P V for a converted V tile (prefills), kWidePvRows rows
// x kWidePvVectors vectors at a time (the target's TargetShape), so each V
// load feeds kWidePvRows FMAs and each probability broadcast kWidePvVectors
// (the 4-row loop above is load-bound). Needs d_size % (kWidePvVectors lanes) == 0.
constexpr int kWidePvVectors = kTarget.wide_pv_vectors;
constexpr int kWidePvRows = kTarget.wide_pv_rows;

template <int kR, class D>
void pv_wide_block(D d, const Scratch& sc, int r0, int d_size, int n) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  float* a[kR];
  const float* prob[kR];
  for (int r = 0; r < kR; ++r) {
    a[r] = sc.acc + (r0 + r) * d_size;
    prob[r] = sc.s + (r0 + r) * kTileKeys;
  }
  for (int c0 = 0; c0 < d_size; c0 += kWidePvVectors * lanes) {
    hn::Vec<D> acc[kR][kWidePvVectors];
    load_rescaled(d, sc, r0, a, c0, acc);
    for (int i = 0; i < n; ++i) {
      const float* vrow = sc.vf + i * d_size + c0;
      for (int r = 0; r < kR; ++r) {
        const auto b = hn::Set(d, prob[r][i]);
        for (int v = 0; v < kWidePvVectors; ++v)
          acc[r][v] = hn::MulAdd(b, hn::Load(d, vrow + v * lanes), acc[r][v]);
      }
    }
    store_accumulators(d, a, c0, acc);
  }
}

template <class D>
void accumulate_pv_wide(D d, const Scratch& sc, int rows, int d_size, int n) {
  int r0 = 0;
  for (; r0 + kWidePvRows <= rows; r0 += kWidePvRows) pv_wide_block<kWidePvRows>(d, sc, r0, d_size, n);
  if constexpr (kWidePvRows > 2) {
    if (rows - r0 >= 2) {
      pv_wide_block<2>(d, sc, r0, d_size, n);
      r0 += 2;
    }
  }
  if (r0 < rows) pv_wide_block<1>(d, sc, r0, d_size, n);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // PAGEDATTN_CPU_ATTN_PREFILL_TILES_INL_H_
