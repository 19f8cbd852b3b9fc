// Test helper of the DCP tests: see dcp_test_step.h.
#include "parallel/dcp_test_step.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <pagedattn/attention.h>
#include <pagedattn/ops.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace pagedattn::test {
namespace {

constexpr std::int64_t kSpareBlocks = 8;  // so the permutation leaves pages unused

// Requests whose block-table entries each cover `positions_per_block` tokens.
std::vector<RequestSpec> requests_of(const Step& s, int positions_per_block) {
  std::vector<RequestSpec> requests;
  std::size_t next = 0;
  for (const auto& [q_len, seq_len] : s.shape) {
    RequestSpec r{.query_len = q_len, .seq_len = seq_len, .blocks = {}};
    for (int b = 0; b < (seq_len + positions_per_block - 1) / positions_per_block; ++b) {
      r.blocks.push_back(s.block_ids.at(next++));
    }
    requests.push_back(std::move(r));
  }
  return requests;
}

}  // namespace

std::vector<float> random_values(std::size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

Step make_step(std::vector<std::pair<int, int>> shape, std::uint32_t seed, DcpStepDims dims) {
  std::mt19937 rng(seed);
  Step s;
  s.dims = dims;
  s.shape = std::move(shape);
  int num_tokens = 0;
  std::int64_t blocks_needed = 0;  // on one rank, the most any rank needs
  const std::size_t row = static_cast<std::size_t>(dims.kv_heads) * dims.head_size;
  for (const auto& [q_len, seq_len] : s.shape) {
    num_tokens += q_len;
    blocks_needed += (seq_len + kDcpBlockSize - 1) / kDcpBlockSize;
    s.context_key.push_back(random_values(static_cast<std::size_t>(seq_len - q_len) * row, rng));
    s.context_value.push_back(random_values(static_cast<std::size_t>(seq_len - q_len) * row, rng));
  }
  const std::size_t t = static_cast<std::size_t>(num_tokens);
  s.query = Tensor::from_floats(random_values(t * dims.heads * dims.head_size, rng),
                                {num_tokens, dims.heads, dims.head_size}, DType::BF16);
  s.key = Tensor::from_floats(random_values(t * row, rng), {num_tokens, dims.kv_heads, dims.head_size},
                              DType::BF16);
  s.value = Tensor::from_floats(random_values(t * row, rng), {num_tokens, dims.kv_heads, dims.head_size},
                                DType::BF16);
  s.num_blocks = 1 + blocks_needed + kSpareBlocks;
  s.block_ids.resize(static_cast<std::size_t>(s.num_blocks - 1));
  std::iota(s.block_ids.begin(), s.block_ids.end(), 1);  // block 0 stays the null block
  std::shuffle(s.block_ids.begin(), s.block_ids.end(), rng);
  return s;
}

Result run_rank(const Step& s, const DcpConfig& dcp, Communicator* comm, const AttentionBackend& backend,
                Device device, DcpRunOptions options) {
  const DcpStepDims& d = s.dims;
  ModelContext model({.dtype = DType::BF16, .device = device});
  AttentionOptions opts;
  opts.num_kv_heads = d.kv_heads;
  opts.cache_config = CacheConfig{.block_size = kDcpBlockSize};
  opts.prefix = "model.layers.0.self_attn.attn";
  opts.attn_backend = &backend;
  Attention layer(model, d.heads, d.head_size, 1.0f / std::sqrt(float(d.head_size)), opts);
  allocate_kv_caches(model, {.num_blocks = s.num_blocks, .reserve_null_block = true});

  const std::vector<RequestSpec> requests = requests_of(s, kDcpBlockSize * dcp.size);
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const int context = requests[r].seq_len - requests[r].query_len;
    if (context == 0) continue;
    const std::vector<std::int64_t> slots =
        dcp_slots_for_positions(requests[r].blocks, kDcpBlockSize, 0, context, dcp);
    const Dims rows{context, d.kv_heads, d.head_size};
    reshape_and_cache(Tensor::from_floats(s.context_key[r], rows, DType::BF16).to(device),
                      Tensor::from_floats(s.context_value[r], rows, DType::BF16).to(device),
                      layer.kv_cache_view(0).key, layer.kv_cache_view(0).value,
                      Tensor::from_i64(slots, {context}).to(device), CacheDType::Auto,
                      layer.quant_state().k_scale, layer.quant_state().v_scale);
  }

  const std::int64_t num_tokens = s.query.size(0);
  const Tensor query = s.query.to(device);
  const Tensor key = s.key.to(device);
  const Tensor value = s.value.to(device);
  const Tensor output = Tensor::empty({num_tokens, d.heads, d.head_size}, DType::BF16, device);
  const Tensor lse = Tensor::empty({d.heads, num_tokens}, DType::F32, device);
  const MetadataOptions metadata_options{.block_size = kDcpBlockSize, .device = device};
  ModelMetadataBuilder builder(model);
  if (comm == nullptr) {
    ForwardContext ctx;
    ctx.layer_metadata = builder.build(make_common_metadata(requests, metadata_options));
    ForwardContextScope scope(std::move(ctx));
    layer.forward(query, key, value, output, lse);
  } else {
    const DcpLocalBatch batch = make_dcp_local_batch(requests, metadata_options, dcp);
    ForwardContext ctx;
    if (!batch.empty()) ctx.layer_metadata = builder.build(batch.metadata);
    ForwardContextScope scope(std::move(ctx));
    if (options.workspace_tokens == 0) {
      dcp_attention_forward(layer, batch, *comm, query, key, value, output, lse);
    } else {
      const DcpWorkspace ws = DcpWorkspace::allocate(layer, dcp.size, options.workspace_tokens, device);
      dcp_attention_forward(layer, batch, *comm, ws, query, key, value, output, lse);
    }
  }
  return {to_float_vector(output), to_float_vector(lse)};
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, Tolerance tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool both_neg_inf = std::isinf(want[i]) && want[i] < 0 && got[i] == want[i];
    if (both_neg_inf) continue;
    if (!(std::abs(got[i] - want[i]) <= tol.atol + tol.rtol * std::abs(want[i]))) {
      if (++bad <= 3) ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

void expect_ranks_match(const std::vector<Result>& ranks, const Result& want, const std::string& what) {
  ASSERT_FALSE(ranks.empty()) << what;
  expect_close(ranks[0].output, want.output, tolerance(CheckedQuantity::Output, DType::BF16),
               what + " output");
  expect_close(ranks[0].lse, want.lse, tolerance(CheckedQuantity::Lse, DType::BF16), what + " lse");
  for (std::size_t rank = 1; rank < ranks.size(); ++rank) {
    EXPECT_EQ(ranks[rank].output, ranks[0].output) << what << " rank " << rank;
    EXPECT_EQ(ranks[rank].lse, ranks[0].lse) << what << " rank " << rank;
  }
}

}  // namespace pagedattn::test
