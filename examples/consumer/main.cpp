// One decoder layer on the CPU: prefill five tokens of one request into the
// paged KV cache, then decode one more. Exits non-zero unless every output is
// finite and the first prefill token, which sees only itself, gets its own
// value row back.
#include <pagedattn/attention.h>

#include <cmath>
#include <cstdio>
#include <exception>
#include <vector>

namespace pa = pagedattn;

namespace {

constexpr int kHeads = 4;
constexpr int kKVHeads = 2;
constexpr int kHeadSize = 64;
constexpr int kBlockSize = 16;

// Deterministic values in [-1, 1).
std::vector<float> values(int n, int seed) {
  std::vector<float> out(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = static_cast<float>((i * 37 + seed * 101) % 200) / 100.0f - 1.0f;
  return out;
}

// Runs one step of `query_len` new tokens for a request of `seq_len` tokens; returns the output.
std::vector<float> step(pa::Attention& attn, pa::ModelMetadataBuilder& builder, int query_len, int seq_len,
                        const std::vector<float>& v_rows) {
  const pa::RequestSpec request{.query_len = query_len, .seq_len = seq_len, .blocks = {1}};
  pa::ForwardContext ctx;
  ctx.layer_metadata = builder.build(pa::make_common_metadata({&request, 1}, {.block_size = kBlockSize}));
  pa::ForwardContextScope scope(std::move(ctx));
  const pa::Tensor q = pa::Tensor::from_floats(values(query_len * kHeads * kHeadSize, seq_len),
                                               {query_len, kHeads * kHeadSize}, pa::DType::F32);
  const pa::Tensor k = pa::Tensor::from_floats(values(query_len * kKVHeads * kHeadSize, seq_len + 7),
                                               {query_len, kKVHeads * kHeadSize}, pa::DType::F32);
  const pa::Tensor v = pa::Tensor::from_floats(v_rows, {query_len, kKVHeads * kHeadSize}, pa::DType::F32);
  return pa::to_float_vector(attn.forward(q, k, v));
}

}  // namespace

int main() try {
  pa::ModelContext model({.dtype = pa::DType::F32});
  pa::AttentionOptions options;
  options.num_kv_heads = kKVHeads;
  options.cache_config = pa::CacheConfig{.block_size = kBlockSize};
  options.prefix = "model.layers.0.self_attn.attn";
  pa::Attention attn(model, kHeads, kHeadSize, 1.0f / std::sqrt(static_cast<float>(kHeadSize)), options);
  pa::allocate_kv_caches(model, {.num_blocks = 4, .reserve_null_block = true});
  pa::ModelMetadataBuilder builder(model);

  constexpr int kPrompt = 5;
  const std::vector<float> prompt_v = values(kPrompt * kKVHeads * kHeadSize, 3);
  const std::vector<float> prefill = step(attn, builder, kPrompt, kPrompt, prompt_v);
  const std::vector<float> decode = step(attn, builder, 1, kPrompt + 1, values(kKVHeads * kHeadSize, 5));

  bool ok = true;
  for (float x : prefill) ok = ok && std::isfinite(x);
  for (float x : decode) ok = ok && std::isfinite(x);
  float worst = 0.0f;
  for (int h = 0; h < kHeads; ++h) {
    const int kv_head = h / (kHeads / kKVHeads);
    for (int d = 0; d < kHeadSize; ++d) {
      const float got = prefill[static_cast<std::size_t>(h * kHeadSize + d)];
      const float want = prompt_v[static_cast<std::size_t>(kv_head * kHeadSize + d)];
      worst = std::fmax(worst, std::fabs(got - want));
    }
  }
  ok = ok && worst < 1e-5f;
  std::printf("consumer: %s, prefill %d tokens + decode 1 with %.*s: first token error %.2g, outputs %s\n",
              ok ? "ok" : "FAILED", kPrompt, static_cast<int>(attn.backend().name().size()),
              attn.backend().name().data(), static_cast<double>(worst), ok ? "finite" : "checked");
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "consumer: %s\n", e.what());
  return 1;
}
