// Test helper of the DCP tests (dcp_test.cpp on the CPU, dcp_multi_gpu_test.cpp
// on CUDA devices): one step's requests and values, and one rank running it
// with its own model, layer and KV cache holding only its share of the context.
#pragma once

#include <pagedattn/conformance.h>
#include <pagedattn/parallel.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace pagedattn::test {

inline constexpr int kDcpBlockSize = 16;

struct DcpStepDims {
  int heads = 4;
  int kv_heads = 2;
  int head_size = 64;
};

std::vector<float> random_values(std::size_t n, std::mt19937& rng);

// A step's requests and every value attention reads: the context keys already
// in the cache and the step's query/key/value rows (host tensors).
struct Step {
  DcpStepDims dims;
  std::vector<std::pair<int, int>> shape;         // (query_len, seq_len) per request
  std::vector<std::vector<float>> context_key;    // per request [context, Hkv, D]
  std::vector<std::vector<float>> context_value;  // per request [context, Hkv, D]
  Tensor query;                                   // [T, H, D] bf16
  Tensor key;                                     // [T, Hkv, D] bf16
  Tensor value;                                   // [T, Hkv, D] bf16
  std::vector<std::int32_t> block_ids;  // a random permutation with spare blocks; requests take them in order
  std::int64_t num_blocks = 0;          // of every rank's cache, block 0 the null block
};

Step make_step(std::vector<std::pair<int, int>> shape, std::uint32_t seed, DcpStepDims dims = {});

struct Result {
  std::vector<float> output;  // [T, H, D]
  std::vector<float> lse;     // [H, T]
};

// How run_rank calls dcp_attention_forward.
struct DcpRunOptions {
  // 0: the overload that allocates its workspace; otherwise a workspace
  // preallocated for this many tokens (at least the step's).
  std::int64_t workspace_tokens = 0;
};

// One rank on `device`: its own model, layer and cache, holding only its
// share of the context (every position when dcp.size == 1), then the step:
// an ordinary forward when comm is null, dcp_attention_forward otherwise.
Result run_rank(const Step& s, const DcpConfig& dcp, Communicator* comm, const AttentionBackend& backend,
                Device device = Device::cpu(), DcpRunOptions options = {});

// Elementwise |got - want| <= atol + rtol |want| (equal -inf passes).
void expect_close(const std::vector<float>& got, const std::vector<float>& want, Tolerance tol,
                  const std::string& what);

// Every rank's result within the bf16 tolerances of `want`, and every rank
// bitwise equal to rank 0.
void expect_ranks_match(const std::vector<Result>& ranks, const Result& want, const std::string& what);

}  // namespace pagedattn::test
