// Google Benchmark suite for the CPU_ATTN inner kernel: one work item at a time
// (single thread), per ISA, for the shapes of the targets (32/8 heads,
// head size 128, block 16). Not part of CTest: run bin/cpu_attn_kernel_bench.
#include <benchmark/benchmark.h>

#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cpu_attn/kernels/cpu_attn_isa.h"
#include "backends/cpu_attn/kernels/cpu_attn_kernel.h"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

namespace pagedattn::cpu_attn {
namespace {

constexpr int kHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadSize = 128;
constexpr int kBlockSize = 16;

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

// One request with `keys` cached keys (blocks in random order; NHD or HND
// layout) and `queries` query tokens; scratch for items of `heads` KV heads.
struct Fixture {
  std::vector<std::uint8_t> k_cache, v_cache, query, output;
  std::vector<std::int32_t> block_table, query_start_loc, seq_lens;
  std::vector<float> partials;
  std::unique_ptr<void, AlignedFree> scratch;
  AttentionParams p;

  Fixture(int queries, int keys, DType kv_dtype, bool hnd, int heads) {
    const int blocks = (keys + kBlockSize - 1) / kBlockSize;
    const std::size_t kv_elems = static_cast<std::size_t>(blocks) * kBlockSize * kKvHeads * kHeadSize;
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    auto fill = [&](std::vector<std::uint8_t>& v, std::size_t n, DType t) {
      v.resize(n * dtype_size(t));
      for (std::size_t i = 0; i < n; ++i) store_from_float(v.data() + i * dtype_size(t), t, dist(rng));
    };
    fill(k_cache, kv_elems, kv_dtype);
    fill(v_cache, kv_elems, kv_dtype);
    fill(query, static_cast<std::size_t>(queries) * kHeads * kHeadSize, DType::BF16);
    output.resize(static_cast<std::size_t>(queries) * kHeads * kHeadSize * 2);
    block_table.resize(static_cast<std::size_t>(blocks));
    std::iota(block_table.begin(), block_table.end(), 0);
    std::shuffle(block_table.begin(), block_table.end(), rng);
    query_start_loc = {0, queries};
    seq_lens = {keys};
    partials.resize(static_cast<std::size_t>(queries) * kHeads * partial_row_floats(kHeadSize));
    const int rows = queries * (kHeads / kKvHeads);
    scratch.reset(std::aligned_alloc(kScratchAlignment,
                                     (scratch_bytes(kHeadSize, rows, heads) + kScratchAlignment - 1) /
                                         kScratchAlignment * kScratchAlignment));

    p.num_heads = kHeads;
    p.num_kv_heads = kKvHeads;
    p.head_size = kHeadSize;
    p.variant.scale = 0.088f;
    p.variant.mask = MaskKind::Causal;
    p.query_start_loc = query_start_loc.data();
    p.seq_lens = seq_lens.data();
    p.block_table = block_table.data();
    p.block_table_row_stride = blocks;
    p.block_size = kBlockSize;
    p.query = {query.data(), DType::BF16, kHeads * kHeadSize, kHeadSize};
    const std::int64_t block = static_cast<std::int64_t>(kBlockSize) * kKvHeads * kHeadSize;
    // NHD: [num_blocks, block_size, Hkv, D]; HND: [num_blocks, Hkv, block_size, D].
    const std::int64_t slot = hnd ? kHeadSize : kKvHeads * kHeadSize;
    const std::int64_t head = hnd ? kBlockSize * kHeadSize : kHeadSize;
    // As the backend binds a cache: HND e4m3 K packed where the active ISA prefers it
    // (the random contents need no reordering).
    const KeyPacking packing = hnd ? preferred_key_packing(kv_dtype, kHeadSize) : KeyPacking::None;
    p.key_cache = {k_cache.data(), block, slot, head, packing};
    p.value_cache = {v_cache.data(), block, slot, head};
    p.kv_dtype = kv_dtype;
    static const float kUnitScale = 1.0f;
    if (is_fp8(kv_dtype)) {
      p.k_scale = &kUnitScale;
      p.v_scale = &kUnitScale;
    }
    p.output = output.data();
    p.output_row_stride = kHeads * kHeadSize;
    p.output_head_stride = kHeadSize;
  }
};

// Args: ISA index (cpu_attn_isa.h order), query tokens, keys, KV dtype, HND (1)
// or NHD (0), KV heads of the item.
void BM_WorkItem(benchmark::State& state) {
  const auto isa = static_cast<Isa>(state.range(0));
  if (!set_isa(isa)) {
    state.SkipWithError("ISA not available");
    return;
  }
  const int queries = static_cast<int>(state.range(1));
  const int keys = static_cast<int>(state.range(2));
  const int heads = static_cast<int>(state.range(5));
  Fixture f(queries, keys, static_cast<DType>(state.range(3)), state.range(4) != 0, heads);
  const WorkItem item{0, 0, heads, 0, queries, 0, keys, -1, 0};
  const KernelVariant variant = choose_kernel_variant(f.p, isa);
  for (auto _ : state) {
    run_work_item(f.p, variant, item, PartialState{f.partials.data(), kHeads / kKvHeads}, f.scratch.get());
    benchmark::ClobberMemory();
  }
  const double group = static_cast<double>(kHeads) / kKvHeads * heads;
  const double pairs = queries == 1 ? keys : static_cast<double>(queries) * keys;  // non-causal item
  state.counters["GFLOP/s"] = benchmark::Counter(4.0 * pairs * group * kHeadSize * 1e-9 * state.iterations(),
                                                 benchmark::Counter::kIsRate);
  state.counters["GB/s"] = benchmark::Counter(
      2.0 * keys * heads * kHeadSize * dtype_size(f.p.kv_dtype) * 1e-9 * state.iterations(),
      benchmark::Counter::kIsRate);
  state.SetLabel(std::string(isa_name(isa)));
}

void Args(benchmark::internal::Benchmark* b) {
  const auto bf16 = static_cast<std::int64_t>(DType::BF16);
  const auto fp8 = static_cast<std::int64_t>(DType::FP8_E4M3);
  for (const Isa isa : compiled_isas()) {
    const auto i = static_cast<std::int64_t>(isa);
    for (const std::int64_t hnd : {0, 1}) {
      b->Args({i, 1, 8192, bf16, hnd, 1});  // decode, one KV head
      b->Args({i, 1, 8192, fp8, hnd, 1});   // fp8 decode
      // Every KV head: one core reads whole blocks (32 MiB of bf16 K/V).
      b->Args({i, 1, 8192, bf16, hnd, kKvHeads});
      b->Args({i, 1, 8192, fp8, hnd, kKvHeads});
      // The item's K/V (128 KiB of 256 keys) stays in L2: the compute alone.
      b->Args({i, 1, 256, bf16, hnd, 1});
      b->Args({i, 1, 256, fp8, hnd, 1});
    }
    b->Args({i, 16, 2048, bf16, 0, 1});  // prefill tile
  }
}

BENCHMARK(BM_WorkItem)->Apply(Args)->ArgNames({"isa", "q", "keys", "kv", "hnd", "heads"});

}  // namespace
}  // namespace pagedattn::cpu_attn

BENCHMARK_MAIN();
