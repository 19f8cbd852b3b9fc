// CPU_ATTN's forward allocates nothing once the builder ran: the workspace
// lives in the step's metadata. This file replaces the global operator new /
// delete of the test binary with versions that count while a test says so.
#include <gtest/gtest.h>
#include <pagedattn/backend/backend.h>
#include <pagedattn/metadata.h>
#include <pagedattn/tensor.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <utility>
#include <vector>

#include "backends/cpu_attn/cpu_attn_backend.h"
#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cpu_attn/cpu_attn_test_problem.h"
#include "backends/cpu_attn/kernels/cpu_attn_isa.h"

namespace {

// Whether allocations count now (any thread: the pool's workers run items too).
std::atomic<bool> g_counting{false};
std::atomic<long> g_allocations{0};

void* allocate(std::size_t size, std::size_t alignment) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (size == 0) size = 1;
  if (alignment <= alignof(std::max_align_t)) return std::malloc(size);
  return std::aligned_alloc(alignment, (size + alignment - 1) / alignment * alignment);
}

void* allocate_or_throw(std::size_t size, std::size_t alignment) {
  void* p = allocate(size, alignment);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t size) { return allocate_or_throw(size, alignof(std::max_align_t)); }
void* operator new[](std::size_t size) { return allocate_or_throw(size, alignof(std::max_align_t)); }
void* operator new(std::size_t size, std::align_val_t a) {
  return allocate_or_throw(size, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t size, std::align_val_t a) {
  return allocate_or_throw(size, static_cast<std::size_t>(a));
}
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  return allocate(size, alignof(std::max_align_t));
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  return allocate(size, alignof(std::max_align_t));
}
void* operator new(std::size_t size, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(size, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t size, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(size, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

namespace pagedattn {
namespace {

const CpuAttnBackend kBackend;

constexpr int kHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadSize = 64;
constexpr int kBlockSize = 16;

// Allocations while `f` runs, on any thread.
template <class F>
long allocations_during(F&& f) {
  g_allocations.store(0);
  g_counting.store(true);
  f();
  g_counting.store(false);
  return g_allocations.load();
}

AttentionImplParams layer_params(AttentionType type) {
  AttentionImplParams params = cpu_attn_test::bf16_layer(kHeads, kKvHeads, kHeadSize, CacheDType::Auto);
  params.attn_type = type;
  return params;
}

std::unique_ptr<AttentionMetadataBuilder> builder() {
  return kBackend.make_builder(cpu_attn_test::builder_params(kBlockSize, kKvHeads, kHeadSize, kHeads));
}

// (query_len, seq_len) per request, each request on its own blocks.
CommonAttentionMetadata step(const std::vector<std::pair<int, int>>& requests, bool causal, int& blocks) {
  std::vector<RequestSpec> specs;
  blocks = 0;
  for (const auto& [query_len, seq_len] : requests) {
    RequestSpec spec{query_len, seq_len, {}};
    for (int b = 0; b < (seq_len + kBlockSize - 1) / kBlockSize; ++b) spec.blocks.push_back(blocks++);
    specs.push_back(spec);
  }
  MetadataOptions options;
  options.block_size = kBlockSize;
  options.causal = causal;
  return make_common_metadata(specs, options);
}

// Counts the allocations of a decoder step's forward call over a paged cache
// (the builder ran), on every ISA.
void expect_no_allocation(const std::vector<std::pair<int, int>>& requests) {
  int blocks = 0;
  const CommonAttentionMetadata common = step(requests, true, blocks);
  const auto md = builder()->build(common);
  const Tensor cache = Tensor::zeros(
      kBackend.kv_cache_shape(blocks, kBlockSize, kKvHeads, kHeadSize, CacheDType::Auto), DType::BF16);
  const KVCacheView kv = kBackend.unbind_kv_cache(cache);
  const auto impl = kBackend.make_impl(layer_params(AttentionType::Decoder));
  const Tensor query = Tensor::zeros({common.num_actual_tokens, kHeads, kHeadSize}, DType::BF16);
  const Tensor out = Tensor::zeros({common.num_actual_tokens, kHeads, kHeadSize}, DType::BF16);
  const Tensor lse = Tensor::zeros({kHeads, common.num_actual_tokens}, DType::F32);
  cpu_attn_test::for_each_isa([&](cpu_attn::Isa isa) {
    const auto forward = [&] { impl->forward({}, query, {}, {}, kv, *md, out, lse); };
    EXPECT_EQ(allocations_during(forward), 0) << cpu_attn::isa_name(isa);
  });
}

TEST(CpuAttnForwardAllocTest, DecodeAllocatesNothing) { expect_no_allocation({{1, 300}, {1, 40}}); }

TEST(CpuAttnForwardAllocTest, PrefillAllocatesNothing) { expect_no_allocation({{40, 100}, {17, 17}}); }

TEST(CpuAttnForwardAllocTest, SplitDecodeAllocatesNothing) {
  expect_no_allocation({{1, cpu_attn::kSplitKeys * 2 + 100}, {3, cpu_attn::kSplitKeys + 1}});
}

TEST(CpuAttnForwardAllocTest, EncoderAllocatesNothing) {
  int blocks = 0;
  const CommonAttentionMetadata common = step({{30, 30}, {12, 12}}, false, blocks);
  const auto md = builder()->build(common);
  const auto impl = kBackend.make_impl(layer_params(AttentionType::Encoder));
  const int tokens = common.num_actual_tokens;
  const Tensor query = Tensor::zeros({tokens, kHeads, kHeadSize}, DType::BF16);
  const Tensor key = Tensor::zeros({tokens, kKvHeads, kHeadSize}, DType::BF16);
  const Tensor value = Tensor::zeros({tokens, kKvHeads, kHeadSize}, DType::BF16);
  const Tensor out = Tensor::zeros({tokens, kHeads, kHeadSize}, DType::BF16);
  cpu_attn_test::for_each_isa([&](cpu_attn::Isa isa) {
    const auto forward = [&] { impl->forward({}, query, key, value, {}, *md, out, {}); };
    EXPECT_EQ(allocations_during(forward), 0) << cpu_attn::isa_name(isa);
  });
}

// The counter sees what runs in its span: a builder run allocates (the tests
// above would otherwise pass vacuously).
TEST(CpuAttnForwardAllocTest, CounterSeesTheBuilder) {
  int blocks = 0;
  const CommonAttentionMetadata common = step({{1, 40}}, true, blocks);
  const auto step_builder = builder();
  EXPECT_GT(allocations_during([&] { static_cast<void>(step_builder->build(common)); }), 0);
}

}  // namespace
}  // namespace pagedattn
