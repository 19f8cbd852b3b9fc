// A forward that the layer or its backend rejects leaves every byte of the KV
// cache as it was, whichever path the bad metadata or slot mapping took:
// metadata placed in the forward context by hand, or a per-layer slot-mapping
// override; and edits to the caller's metadata after the builder ran change
// nothing. Runs on every registered CPU
// backend through the registry (core never includes a backend).
#include <gtest/gtest.h>
#include <pagedattn/attention.h>
#include <pagedattn/backend/registry.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "testing/expect_error.h"

namespace pagedattn {
namespace {

constexpr int kHeads = 4;
constexpr int kKVHeads = 2;
constexpr int kBlock = 16;
constexpr std::int64_t kNumBlocks = 8;
constexpr float kScale = 0.25f;
constexpr char kLayerName[] = "layers.0.attn";

// Two requests: a decode at position 20 (blocks 3, 5) and a 4-token prefill (block 2).
std::vector<RequestSpec> two_requests() { return {RequestSpec{1, 21, {3, 5}}, RequestSpec{4, 4, {2}}}; }
constexpr std::int64_t kTokens = 5;

struct Config {
  const char* backend;
  DType dtype;
  int head_size;
  bool cuda;
};

bool have_cuda() {
  BackendRegistry::instance();
  const DeviceAllocator* a = find_device_allocator(DeviceType::CUDA);
  return a != nullptr && a->device_count() > 0;
}

class RejectedForward : public ::testing::TestWithParam<Config> {
 protected:
  void SetUp() override {
    const Config& c = GetParam();
    if (c.cuda && !have_cuda()) GTEST_SKIP() << "no CUDA device";
    const AttentionBackend* backend = BackendRegistry::instance().find(c.backend);
    if (backend == nullptr) GTEST_SKIP() << c.backend << " is not compiled in";
    device_ = c.cuda ? Device::cuda(0) : Device::cpu();
    model_ = std::make_unique<ModelContext>(ModelOptions{.dtype = c.dtype, .device = device_});
    AttentionOptions o;
    o.num_kv_heads = kKVHeads;
    o.cache_config = CacheConfig{};
    o.cache_config->block_size = kBlock;
    o.prefix = kLayerName;
    o.attn_backend = backend;
    layer_ = std::make_unique<Attention>(*model_, kHeads, c.head_size, kScale, o);
    allocate_kv_caches(*model_, {.num_blocks = kNumBlocks});
    builder_ = std::make_unique<ModelMetadataBuilder>(*model_);
    q_ = filled({kTokens, kHeads, c.head_size}, 0.5f);
    k_ = filled({kTokens, kKVHeads, c.head_size}, 1.5f);
    v_ = filled({kTokens, kKVHeads, c.head_size}, -2.5f);
  }

  Tensor filled(Dims shape, float value) const {
    Tensor t = Tensor::empty(shape, GetParam().dtype, device_);
    fill_tensor(t, value);
    return t;
  }

  CommonAttentionMetadata common() const {
    return make_common_metadata(two_requests(), {.block_size = kBlock, .device = device_});
  }

  // Runs forward under `context` and expects it rejected with `message`,
  // the cache bytes unchanged.
  void expect_rejected(ForwardContext context, const std::string& message) {
    const std::vector<std::uint8_t> before = to_byte_vector(layer_->kv_cache(0));
    ForwardContextScope scope(std::move(context));
    test::expect_invalid([&] { (void)layer_->forward(q_, k_, v_); }, message);
    EXPECT_EQ(to_byte_vector(layer_->kv_cache(0)), before) << message;
  }

  // The builder's metadata for two_requests(); `edit` then changes the
  // caller's metadata (its host tensors) after the builder ran.
  ForwardContext built_context(const std::function<void(CommonAttentionMetadata&)>& edit) {
    CommonAttentionMetadata caller = common();
    ForwardContext context;
    context.layer_metadata = builder_->build(caller);
    if (edit) edit(caller);
    return context;
  }

  Device device_ = Device::cpu();
  std::unique_ptr<ModelContext> model_;
  std::unique_ptr<Attention> layer_;
  std::unique_ptr<ModelMetadataBuilder> builder_;
  Tensor q_;
  Tensor k_;
  Tensor v_;
};

// The builder validated the step and the plan holds its own copy of the host
// arrays: editing the caller's tensors afterwards changes nothing, so forward
// needs no second walk of the block table.
TEST_P(RejectedForward, EditsAfterTheBuilderRanChangeNothing) {
  Tensor expected;
  {
    ForwardContextScope scope(built_context({}));
    expected = layer_->forward(q_, k_, v_);
  }
  ForwardContextScope scope(built_context([](CommonAttentionMetadata& common) {
    common.block_table_cpu.data_as<std::int32_t>()[1] = static_cast<std::int32_t>(kNumBlocks);
    common.seq_lens_cpu.data_as<std::int32_t>()[1] = 2;  // query_len 4
  }));
  const Tensor out = layer_->forward(q_, k_, v_);
  EXPECT_EQ(to_byte_vector(out), to_byte_vector(expected));
}

// Metadata placed in the context by hand, which no builder validated: every
// backend rejects it (CPU_ATTN and CUDA_FLASH for its type as well).
TEST_P(RejectedForward, HandPlacedMetadataIsRejected) {
  auto hand_made = std::make_shared<BackendMetadata>();
  hand_made->common = common();
  ForwardContext context;
  context.metadata = hand_made;
  expect_rejected(std::move(context), "metadata");
}

TEST_P(RejectedForward, SlotMappingOverridePastTheCache) {
  ForwardContext context = built_context({});
  std::vector<std::int64_t> slots = slots_for_positions(std::vector<std::int32_t>{3, 5}, kBlock, 20, 1);
  const std::vector<std::int64_t> prefill = slots_for_positions(std::vector<std::int32_t>{2}, kBlock, 0, 4);
  slots.insert(slots.end(), prefill.begin(), prefill.end());
  slots.back() = kNumBlocks * kBlock;  // one past the last slot
  context.slot_mappings.emplace(kLayerName, Tensor::from_i64(slots, {kTokens}, device_));
  expect_rejected(std::move(context), "slot_mapping[4] must be -1 or in [0, 128), got 128");
}

TEST_P(RejectedForward, ValidStepStillWritesAndRuns) {
  ForwardContextScope scope(built_context({}));
  const std::vector<std::uint8_t> before = to_byte_vector(layer_->kv_cache(0));
  const Tensor out = layer_->forward(q_, k_, v_);
  EXPECT_NE(to_byte_vector(layer_->kv_cache(0)), before);
  EXPECT_EQ(out.shape(), (Dims{kTokens, kHeads * GetParam().head_size}));
}

INSTANTIATE_TEST_SUITE_P(Backends, RejectedForward,
                         ::testing::Values(Config{"REFERENCE", DType::F32, 16, false},
                                           Config{"CPU_ATTN", DType::F32, 16, false},
                                           Config{"CPU_ATTN", DType::BF16, 64, false},
                                           Config{"CUDA_FLASH", DType::BF16, 64, true}),
                         [](const ::testing::TestParamInfo<Config>& info) {
                           return std::string(info.param.backend) + "_" +
                                  std::string(dtype_name(info.param.dtype)) + "_d" +
                                  std::to_string(info.param.head_size);
                         });

}  // namespace
}  // namespace pagedattn
