// Test helper of the CPU_ATTN tests: one decoder layer over a paged KV cache
// with random contents, run through any backend's builder and impl (each run
// writes its own cache, so an ISA's K packing applies), and the comparison of
// CPU_ATTN's result with REFERENCE's under the conformance tolerance table.
#pragma once

#include <gtest/gtest.h>
#include <pagedattn/backend/backend.h>
#include <pagedattn/conformance.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backends/cpu_attn/kernels/cpu_attn_isa.h"

namespace pagedattn::cpu_attn_test {

// Runs check(isa) with each ISA this CPU runs active, stopping at the first
// fatal failure, and puts the active ISA back.
template <class F>
void for_each_isa(F check) {
  const cpu_attn::Isa saved = cpu_attn::active_isa();
  for (const cpu_attn::Isa isa : cpu_attn::available_isas()) {
    ASSERT_TRUE(cpu_attn::set_isa(isa));
    check(isa);
    if (::testing::Test::HasFatalFailure()) break;
  }
  cpu_attn::set_isa(saved);
}

// The impl arguments of a bf16 decoder layer with a `cache` KV cache.
AttentionImplParams bf16_layer(int heads, int kv_heads, int head_size, CacheDType cache);

// The builder arguments for layers of at most `heads` query heads (CPU_ATTN
// sizes the step's workspace for them).
BuilderParams builder_params(int block_size, int kv_heads, int head_size, int heads);

// The layer: shape, dtypes, cache and scoring features.
struct LayerSpec {
  int heads = 4;
  int kv_heads = 4;
  int head_size = 64;
  int block_size = 16;
  DType dtype = DType::BF16;
  CacheDType cache = CacheDType::Auto;
  bool per_head_scales = false;  // fp8: [Hkv] scales
  KVCacheLayout layout = KVCacheLayout::NHD;
  bool causal = true;
  std::optional<int> window;
  std::optional<float> soft_cap;
  std::optional<float> scale;  // default head_size^-0.5
  bool alibi = false;
  bool sinks = false;

  std::string describe() const;
};

// What a forward call returned, as floats: output [T, H, D], LSE [H, T].
struct ForwardResult {
  std::vector<float> output;
  std::vector<float> lse;
};

class PagedProblem {
 public:
  // (query_len, seq_len) per request; standard-normal q, k, v from `seed`.
  PagedProblem(const LayerSpec& spec, std::vector<std::pair<int, int>> requests, std::uint32_t seed);

  int num_tokens() const { return num_tokens_; }
  const LayerSpec& spec() const { return spec_; }
  std::string describe() const;

  // Element (token, head, dim) of the query, and of key / value position
  // `pos` of request `r`: tests set NaN there before running.
  float& query(int token, int head, int dim);
  float& key(int r, int pos, int kv_head, int dim);

  ForwardResult run(const AttentionBackend& backend) const;

 private:
  std::size_t kv_row(int r, int pos, int kv_head) const;

  LayerSpec spec_;
  std::vector<std::pair<int, int>> requests_;
  std::vector<int> first_position_;  // of each request in key_ / value_
  int num_tokens_ = 0;
  int num_positions_ = 0;
  int blocks_per_request_ = 0;
  AttentionImplParams params_;
  std::vector<float> query_;  // [T, H, D]
  std::vector<float> key_;    // [positions, Hkv, D], requests one after another
  std::vector<float> value_;
  std::vector<float> k_scale_;
  std::vector<float> v_scale_;
};

// nullopt when `got` matches `want` (REFERENCE's result): NaN exactly where
// `want` is NaN (output and LSE), every other element within
// tolerance(quantity, dtype) of it; else what differs.
std::optional<std::string> compare_with_reference(const ForwardResult& want, const ForwardResult& got,
                                                  const PagedProblem& problem);

// The REFERENCE backend (the registry's).
const AttentionBackend& reference_backend();

}  // namespace pagedattn::cpu_attn_test
