// Attention::forward through the forward context: flat and headed inputs,
// caller buffers, strided q/k/v, rejected calls leaving the cache untouched,
// KV sharing, virtual engines, slot-mapping overrides, cache updates, scales.
#include <gtest/gtest.h>
#include <pagedattn/attention.h>
#include <pagedattn/ops.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/attention_test_util.h"
#include "testing/expect_error.h"

namespace pagedattn::test {
namespace {

TEST(AttentionForward, FlatAndHeadedInputs) {
  const FakeBackend backend;
  OneLayer f(backend);
  const CommonAttentionMetadata batch = small_batch();
  ForwardContextScope scope(context_with(batch));
  const Tensor q = make_tensor({kBatchTokens, kHeads * kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads * kHeadSize}, 2);
  const Tensor v = make_tensor({kBatchTokens, kKVHeads * kHeadSize}, 3);

  const Tensor out = f.layer->forward(q, k, v);
  EXPECT_EQ(out.shape(), (Dims{kBatchTokens, kHeads * kHeadSize}));
  EXPECT_EQ(out.dtype(), DType::F32);
  EXPECT_EQ(to_float_vector(out), to_float_vector(q));
  FakeImpl& impl = fake_impl(*f.layer);
  EXPECT_EQ(impl.update_calls, 1);
  EXPECT_EQ(impl.last_kv_key, f.layer->kv_cache_view(0).key.data());
  // The decode token (position 5) went to block 6, offset 1: slot 25.
  const TensorView k3 = k.view({kBatchTokens, kKVHeads, kHeadSize});
  const TensorView v3 = v.view({kBatchTokens, kKVHeads, kHeadSize});
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25), token_row(k3, 0));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).value, 25), token_row(v3, 0));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 18), token_row(k3, 3));

  const Tensor q3 = make_tensor({kBatchTokens, kHeads, kHeadSize}, 4);
  const Tensor k3b = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 5);
  const Tensor v3b = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 6);
  const Tensor out3 = f.layer->forward(q3, k3b, v3b);
  EXPECT_EQ(out3.shape(), (Dims{kBatchTokens, kHeads * kHeadSize}));
  EXPECT_EQ(to_float_vector(out3), to_float_vector(q3));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25), token_row(k3b, 0));
}

TEST(AttentionForward, CallerOutputBuffer) {
  const FakeBackend backend;
  OneLayer f(backend);
  ForwardContextScope scope(context_with(small_batch()));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  const Tensor v = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 3);
  const Tensor flat_out = Tensor::zeros({kBatchTokens, kHeads * kHeadSize}, DType::F32);
  const Tensor result = f.layer->forward(q, k, v, flat_out);
  EXPECT_EQ(result.data(), flat_out.data());
  EXPECT_EQ(result.shape(), (Dims{kBatchTokens, kHeads * kHeadSize}));
  EXPECT_EQ(to_float_vector(flat_out), to_float_vector(q));

  const Tensor headed_out = Tensor::zeros({kBatchTokens, kHeads, kHeadSize}, DType::F32);
  const Tensor lse = Tensor::empty({kHeads, kBatchTokens}, DType::F32);
  const Tensor result3 = f.layer->forward(q, k, v, headed_out, lse);
  EXPECT_EQ(result3.data(), headed_out.data());
  EXPECT_EQ(to_float_vector(headed_out), to_float_vector(q));
}

TEST(AttentionForward, StridedRowsOfAFusedQKV) {
  const FakeBackend backend;
  OneLayer f(backend);
  ForwardContextScope scope(context_with(small_batch()));
  constexpr std::int64_t kQWidth = kHeads * kHeadSize;
  constexpr std::int64_t kKVWidth = kKVHeads * kHeadSize;
  const Tensor qkv = make_tensor({kBatchTokens, kQWidth + 2 * kKVWidth}, 7);
  const Tensor q = qkv.slice(1, 0, kQWidth);
  const Tensor k = qkv.slice(1, kQWidth, kQWidth + kKVWidth);
  const Tensor v = qkv.slice(1, kQWidth + kKVWidth, kQWidth + 2 * kKVWidth);
  const Tensor out = f.layer->forward(q, k, v);
  EXPECT_EQ(to_float_vector(out), to_float_vector(q));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25),
            token_row(k.view({kBatchTokens, kKVHeads, kHeadSize}), 0));
}

TEST(AttentionForward, NeedsAForwardContextAndLayerMetadata) {
  const FakeBackend backend;
  OneLayer f(backend);
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  expect_invalid([&] { f.layer->forward(q, k, k); }, "no forward context is set");
  ForwardContext other;
  other.layer_metadata.emplace("layers.9.attn", as_backend_metadata(small_batch()));
  ForwardContextScope scope(std::move(other));
  expect_invalid([&] { f.layer->forward(q, k, k); }, "no attention metadata for layer 'layers.0.attn'");
}

TEST(AttentionForward, RejectedCallsLeaveTheCacheUntouched) {
  const FakeBackend backend({.returns_lse = false});
  OneLayer f(backend, 1, [](AttentionOptions& o) { o.cache_config->calculate_kv_scales = true; });
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  const Tensor v = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 3);
  const std::vector<std::uint8_t> before = to_byte_vector(f.layer->kv_cache(0));
  FakeImpl& impl = fake_impl(*f.layer);
  {
    ForwardContextScope scope(context_with(small_batch()));
    const Tensor q_bad_width = make_tensor({kBatchTokens, kHeads * kHeadSize + 1}, 1);
    expect_invalid([&] { f.layer->forward(q_bad_width, k, v); }, "query size(1) must be 32");
    const Tensor q_bad_heads = make_tensor({kBatchTokens, kHeads + 1, kHeadSize}, 1);
    expect_invalid([&] { f.layer->forward(q_bad_heads, k, v); }, "query size(1) must be 4");
    const Tensor q_rank4 = make_tensor({1, kBatchTokens, kHeads, kHeadSize}, 1);
    expect_invalid([&] { f.layer->forward(q_rank4, k, v); },
                   "query rank must be 2 ([T, 32]) or 3 ([T, 4, 8])");
    const Tensor q_bf16 = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1, DType::BF16);
    expect_invalid([&] { f.layer->forward(q_bf16, k, v); }, "query dtype must be f32, got bf16");
    const Tensor k_f16 = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2, DType::F16);
    expect_invalid([&] { f.layer->forward(q, k_f16, v); }, "key dtype must be f32, got f16");
    const Tensor k_short = make_tensor({kBatchTokens - 1, kKVHeads, kHeadSize}, 2);
    expect_invalid([&] { f.layer->forward(q, k_short, k_short); }, "key size(0) must be 4");
    expect_invalid([&] { f.layer->forward(q, k, TensorView{}); },
                   "key and value must be both given or both undefined");
    const Tensor out_short = Tensor::zeros({kBatchTokens - 1, kHeads * kHeadSize}, DType::F32);
    expect_invalid([&] { f.layer->forward(q, k, v, out_short); }, "output size(0) must be 4");
    const Tensor out_bf16 = Tensor::zeros({kBatchTokens, kHeads * kHeadSize}, DType::BF16);
    expect_invalid([&] { f.layer->forward(q, k, v, out_bf16); }, "output dtype must be f32, got bf16");
    const Tensor lse = Tensor::zeros({kHeads, kBatchTokens}, DType::F32);
    expect_invalid([&] { f.layer->forward(q, k, v, {}, lse); }, "backend FAKE cannot return it");
    const Tensor q_few = make_tensor({kBatchTokens - 1, kHeads, kHeadSize}, 1);
    expect_invalid([&] { f.layer->forward(q_few, k_short, k_short); },
                   "metadata num_actual_tokens must be <= query tokens (3), got 4");
  }
  {
    ForwardContextScope scope(context_with(small_batch(), 1));
    expect_invalid([&] { f.layer->forward(q, k, v); },
                   "forward context virtual_engine must be in [0, 1), got 1");
  }
  {
    ForwardContext bad_slots = context_with(small_batch());
    bad_slots.slot_mappings.emplace("layers.0.attn",
                                    Tensor::from_i32(std::vector<std::int32_t>{0, 1, 2, 3}, {4}));
    ForwardContextScope scope(std::move(bad_slots));
    expect_invalid([&] { f.layer->forward(q, k, v); }, "slot_mapping dtype must be i64, got i32");
  }
  {
    MetadataOptions other_block;
    other_block.block_size = 2 * kBlock;
    ForwardContextScope scope(
        context_with(make_common_metadata(std::vector<RequestSpec>{{4, 4, {1}}}, other_block)));
    expect_invalid([&] { f.layer->forward(q, k, v); },
                   "metadata block_size must be the layer's block size (4), got 8");
  }
  EXPECT_EQ(to_byte_vector(f.layer->kv_cache(0)), before);
  EXPECT_EQ(impl.update_calls, 0);
  EXPECT_EQ(impl.forward_calls, 0);
  EXPECT_TRUE(f.layer->calculate_kv_scales());
}

TEST(AttentionForward, UnboundCacheIsAnError) {
  const FakeBackend backend;
  ModelContext model(f32_model());
  Attention layer(model, kHeads, kHeadSize, kScale, options_for("layers.0.attn", backend));
  ForwardContextScope scope(context_with(small_batch()));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  expect_invalid([&] { layer.forward(q, k, k); },
                 "kv_cache[0] must be bound (allocate_kv_caches), got unbound");
}

TEST(AttentionForward, KVSharingLayerNeverWritesTheCache) {
  const FakeBackend backend;
  ModelContext model(f32_model());
  Attention owner(model, kHeads, kHeadSize, kScale, options_for("layers.0.attn", backend));
  AttentionOptions sharing = options_for("layers.1.attn", backend);
  sharing.kv_sharing_target_layer_name = "layers.0.attn";
  Attention reader(model, kHeads, kHeadSize, kScale, sharing);
  allocate_kv_caches(model, {.num_blocks = kNumBlocks});
  ForwardContextScope scope(context_with(small_batch()));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  owner.forward(q, k, k);
  const std::vector<std::uint8_t> snapshot = to_byte_vector(owner.kv_cache(0));
  const Tensor other_k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 9);
  reader.forward(q, other_k, other_k);
  EXPECT_EQ(to_byte_vector(owner.kv_cache(0)), snapshot);
  EXPECT_EQ(fake_impl(reader).update_calls, 0);
  EXPECT_EQ(fake_impl(reader).forward_calls, 1);
  EXPECT_EQ(fake_impl(reader).last_kv_key, owner.kv_cache_view(0).key.data());
}

TEST(AttentionForward, EachVirtualEngineUsesItsOwnCache) {
  const FakeBackend backend;
  OneLayer f(backend, 2);
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  {
    ForwardContextScope scope(context_with(small_batch(), 1));
    f.layer->forward(q, k, k);
  }
  EXPECT_EQ(fake_impl(*f.layer).last_kv_key, f.layer->kv_cache_view(1).key.data());
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(1).key, 25), token_row(k, 0));
  const std::vector<std::uint8_t> engine0 = to_byte_vector(f.layer->kv_cache(0));
  EXPECT_TRUE(std::all_of(engine0.begin(), engine0.end(), [](std::uint8_t b) { return b == 0; }));
  {
    ForwardContextScope scope(context_with(small_batch(), 0));
    f.layer->forward(q, k, k);
  }
  EXPECT_EQ(fake_impl(*f.layer).last_kv_key, f.layer->kv_cache_view(0).key.data());
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25), token_row(k, 0));
}

TEST(AttentionForward, PerLayerSlotMappingOverridesTheMetadata) {
  const FakeBackend backend;
  OneLayer f(backend);
  ForwardContext context = context_with(small_batch());
  context.slot_mappings.emplace("layers.0.attn",
                                Tensor::from_i64(std::vector<std::int64_t>{30, -1, -1, 7}, {4}));
  ForwardContextScope scope(std::move(context));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  f.layer->forward(q, k, k);
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 30), token_row(k, 0));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 7), token_row(k, 3));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25), std::vector<float>(kKVHeads * kHeadSize, 0.0f));
}

TEST(AttentionForward, CacheUpdateIsSkippedWhenNotTheLayersJob) {
  const FakeBackend writes_in_forward({.writes_in_forward = true});
  OneLayer f(writes_in_forward);
  const FakeBackend backend;
  ModelContext model(f32_model());
  AttentionOptions encoder_only = options_for("encoder", backend);
  encoder_only.attn_type = AttentionType::EncoderOnly;
  Attention encoder(model, kHeads, kHeadSize, kScale, encoder_only);
  allocate_kv_caches(model, {.num_blocks = kNumBlocks});

  ForwardContextScope scope(context_with(small_batch()));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  f.layer->forward(q, k, k);
  EXPECT_EQ(fake_impl(*f.layer).update_calls, 0);
  EXPECT_EQ(fake_impl(*f.layer).forward_calls, 1);
  // Key and value absent: nothing to store, attention still runs.
  OneLayer g(backend);
  g.layer->forward(q, TensorView{}, TensorView{});
  EXPECT_EQ(fake_impl(*g.layer).update_calls, 0);
  EXPECT_EQ(fake_impl(*g.layer).forward_calls, 1);

  encoder.forward(q, k, k);
  EXPECT_EQ(fake_impl(encoder).update_calls, 0);
  EXPECT_EQ(fake_impl(encoder).last_kv_key, nullptr);
  expect_invalid([&] { encoder.forward(q, TensorView{}, TensorView{}); },
                 "key must be given for encoder attention");
}

TEST(AttentionForward, CalcKVScalesRunsOnce) {
  const FakeBackend backend;
  OneLayer f(backend, 1, [](AttentionOptions& o) {
    o.cache_config->cache_dtype = CacheDType::Fp8;
    o.cache_config->calculate_kv_scales = true;
  });
  ASSERT_TRUE(f.layer->calculate_kv_scales());
  ForwardContextScope scope(context_with(small_batch()));
  std::vector<float> qv(kBatchTokens * kHeads * kHeadSize, 0.5f);
  std::vector<float> kv(kBatchTokens * kKVHeads * kHeadSize, 0.25f);
  std::vector<float> vv(kBatchTokens * kKVHeads * kHeadSize, -0.5f);
  qv[3] = -4.0f;
  kv[7] = 2.0f;
  vv[1] = -5.0f;
  const Tensor q = Tensor::from_floats(qv, {kBatchTokens, kHeads, kHeadSize}, DType::F32);
  const Tensor k = Tensor::from_floats(kv, {kBatchTokens, kKVHeads, kHeadSize}, DType::F32);
  const Tensor v = Tensor::from_floats(vv, {kBatchTokens, kKVHeads, kHeadSize}, DType::F32);
  f.layer->forward(q, k, v);
  const LayerQuantState& s = f.layer->quant_state();
  EXPECT_FLOAT_EQ(s.q_scale_float, 4.0f / kQScaleRange);
  EXPECT_FLOAT_EQ(s.k_scale_float, 2.0f / kKScaleRange);
  EXPECT_FLOAT_EQ(s.v_scale_float, 5.0f / kVScaleRange);
  EXPECT_FLOAT_EQ(to_float_vector(s.k_scale)[0], 2.0f / kKScaleRange);
  EXPECT_FALSE(f.layer->calculate_kv_scales());
  // The cache stores sat(x / k_scale) in e4m3; element 7 of token 0 is the 2.0.
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25)[7],
            fp8_e4m3_to_float(float_to_fp8_e4m3(2.0f / s.k_scale_float)));

  const Tensor big = Tensor::from_floats(std::vector<float>(kBatchTokens * kKVHeads * kHeadSize, 40.0f),
                                         {kBatchTokens, kKVHeads, kHeadSize}, DType::F32);
  f.layer->forward(q, big, big);
  EXPECT_FLOAT_EQ(f.layer->quant_state().k_scale_float, 2.0f / kKScaleRange);
}

TEST(AttentionForward, ProcessWeightsAfterLoading) {
  const FakeBackend backend;
  OneLayer calculated(backend, 1, [](AttentionOptions& o) {
    o.cache_config->cache_dtype = CacheDType::Fp8;
    o.cache_config->calculate_kv_scales = true;
  });
  const Tensor x = Tensor::from_floats(std::vector<float>(kBatchTokens * kKVHeads * kHeadSize, 3.0f),
                                       {kBatchTokens, kKVHeads, kHeadSize}, DType::F32);
  calculated.layer->calc_kv_scales(x, x, x);
  EXPECT_NE(calculated.layer->quant_state().k_scale_float, 1.0f);
  calculated.layer->process_weights_after_loading(DType::F32);
  EXPECT_EQ(calculated.layer->quant_state().k_scale_float, 1.0f);
  EXPECT_EQ(to_float_vector(calculated.layer->quant_state().v_scale), std::vector<float>{1.0f});
  EXPECT_EQ(fake_impl(*calculated.layer).processed_dtype, DType::F32);

  OneLayer checkpoint(backend, 1, [](AttentionOptions& o) {
    o.quant_config = QuantConfig{.has_kv_cache_scheme = true,
                                 .per_head_scales = true,
                                 .k_scale = std::vector<float>{0.5f, 0.25f},
                                 .v_scale = std::vector<float>{0.125f, 0.0625f},
                                 .q_scale = 2.0f};
  });
  checkpoint.layer->process_weights_after_loading(DType::F32);
  const LayerQuantState& s = checkpoint.layer->quant_state();
  EXPECT_EQ(to_float_vector(s.k_scale), (std::vector<float>{0.5f, 0.25f}));
  EXPECT_EQ(to_float_vector(s.v_scale), (std::vector<float>{0.125f, 0.0625f}));
  EXPECT_EQ(s.k_scale_float, 0.5f);
  EXPECT_EQ(s.v_scale_float, 0.125f);
  EXPECT_EQ(s.q_scale_float, 2.0f);
}

}  // namespace
}  // namespace pagedattn::test
