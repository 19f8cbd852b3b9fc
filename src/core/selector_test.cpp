#include <gtest/gtest.h>
#include <pagedattn/backend/registry.h>
#include <pagedattn/selector.h>

#include <cstdlib>

namespace pagedattn {
namespace {

// A capability-only backend for selector tests; never runs.
class FakeBackend : public AttentionBackend {
 public:
  FakeBackend(std::string name, DeviceType device, std::vector<int> head_sizes, bool sinks = false)
      : name_(std::move(name)), device_(device), head_sizes_(std::move(head_sizes)), sinks_(sinks) {}
  std::string_view name() const override { return name_; }
  DeviceType device_type() const override { return device_; }
  std::string_view description() const override { return "selector test backend"; }
  std::vector<int> supported_head_sizes() const override { return head_sizes_; }
  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override { return {MultipleOf{16}, 8}; }
  bool supports_sink() const override { return sinks_; }
  bool supports_compute_capability(DeviceCapability cap) const override {
    return device_ == DeviceType::CPU || cap.major >= 8;
  }
  ProblemSupport problem_support(const AttentionProblem&) const override { return {}; }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams&) const override { return nullptr; }
  std::unique_ptr<AttentionMetadataBuilder> make_builder(const BuilderParams&) const override { return nullptr; }

 private:
  std::string name_;
  DeviceType device_;
  std::vector<int> head_sizes_;
  bool sinks_;
};

SelectorConfig cpu_config(int head_size) {
  SelectorConfig cfg;
  cfg.head_size = head_size;
  cfg.dtype = DType::BF16;
  return cfg;
}

TEST(SelectorTest, ValidateConfigurationUsesVllmReasonStringsInOrder) {
  FakeBackend b("FAKE", DeviceType::CUDA, {64, 128});
  SelectorConfig cfg = cpu_config(77);
  cfg.dtype = DType::F32;
  cfg.kv_cache_dtype = CacheDType::Fp8E5M2;
  cfg.block_size = 12;
  cfg.use_mm_prefix = true;
  cfg.use_mla = true;
  cfg.has_sink = true;
  cfg.use_sparse = true;
  cfg.use_per_head_quant_scales = true;
  cfg.capability = {7, 5};
  cfg.attn_type = AttentionType::EncoderOnly;
  cfg.use_non_causal = true;
  cfg.use_batch_invariant = true;
  const std::vector<std::string> expected = {"head_size not supported",
                                             "dtype not supported",
                                             "kv_cache_dtype not supported",
                                             "block_size not supported",
                                             "partial multimodal token full attention not supported",
                                             "MLA not supported",
                                             "attention sinks not supported",
                                             "sparse not supported",
                                             "per-head quant scales not supported",
                                             "compute capability not supported",
                                             "attention type encoder_only not supported",
                                             "non-causal attention not supported",
                                             "batch invariance not supported"};
  EXPECT_EQ(b.validate_configuration(cfg), expected);
}

TEST(SelectorTest, BlockSizeAcceptsMultiplesOfKernelSizes) {
  FakeBackend b("FAKE", DeviceType::CPU, {});
  EXPECT_TRUE(b.supports_block_size(std::nullopt));
  EXPECT_TRUE(b.supports_block_size(16));
  EXPECT_TRUE(b.supports_block_size(128));
  EXPECT_TRUE(b.supports_block_size(8));
  EXPECT_TRUE(b.supports_block_size(24));  // multiple of the exact size 8
  EXPECT_FALSE(b.supports_block_size(12));
  EXPECT_FALSE(b.supports_block_size(0));
  EXPECT_EQ(b.preferred_block_size(16), 16);
  EXPECT_EQ(b.preferred_block_size(12), 8);
}

TEST(SelectorTest, KvCacheShapeAndStrideOrders) {
  FakeBackend b("FAKE", DeviceType::CPU, {});
  EXPECT_EQ(b.kv_cache_shape(10, 16, 8, 128, CacheDType::Auto), (Dims{2, 10, 16, 8, 128}));
  EXPECT_EQ(b.kv_cache_stride_order(KVCacheLayout::NHD), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(b.kv_cache_stride_order(KVCacheLayout::HND), (std::vector<int>{0, 1, 3, 2, 4}));
  EXPECT_THROW(b.kv_cache_shape(0, 16, 8, 128, CacheDType::Auto), Error);
}

TEST(SelectorTest, AutoPicksFirstValidInPriorityOrderAndExplainsTheRest) {
  BackendRegistry registry;
  registry.add(std::make_unique<FakeBackend>("FAST", DeviceType::CPU, std::vector<int>{64, 128}), 0);
  registry.add(std::make_unique<FakeBackend>("SLOW", DeviceType::CPU, std::vector<int>{}), 1);
  registry.add(std::make_unique<FakeBackend>("ORACLE", DeviceType::CPU, std::vector<int>{}), kOnlyWhenAsked);
  registry.add(std::make_unique<FakeBackend>("GPU", DeviceType::CUDA, std::vector<int>{}), 0);

  SelectionReport r = explain_selection(registry, cpu_config(128));
  ASSERT_NE(r.chosen, nullptr);
  EXPECT_EQ(r.chosen->name(), "FAST");

  r = explain_selection(registry, cpu_config(80));
  ASSERT_NE(r.chosen, nullptr);
  EXPECT_EQ(r.chosen->name(), "SLOW");
  ASSERT_EQ(r.verdicts.size(), 4u);
  EXPECT_EQ(r.verdicts[0].name, "FAST");
  EXPECT_EQ(r.verdicts[0].reasons, std::vector<std::string>{"head_size not supported"});
  EXPECT_TRUE(r.verdicts[1].reasons.empty());
  EXPECT_EQ(r.verdicts[2].name, "ORACLE");
  EXPECT_FALSE(r.verdicts[2].auto_selectable);
  EXPECT_EQ(r.verdicts[2].reasons.front(), "selected only when requested by name");
  EXPECT_EQ(r.verdicts[3].name, "GPU");
  EXPECT_EQ(r.verdicts[3].reasons.front(), "runs on cuda, not cpu");
}

TEST(SelectorTest, NothingFitsGivesNullChoiceWithEveryReason) {
  BackendRegistry registry;
  registry.add(std::make_unique<FakeBackend>("FAST", DeviceType::CPU, std::vector<int>{64}), 0);
  SelectorConfig cfg = cpu_config(77);
  cfg.has_sink = true;
  const SelectionReport r = explain_selection(registry, cfg);
  EXPECT_EQ(r.chosen, nullptr);
  ASSERT_EQ(r.verdicts.size(), 1u);
  EXPECT_EQ(r.verdicts[0].reasons,
            (std::vector<std::string>{"head_size not supported", "attention sinks not supported"}));
  EXPECT_EQ(format_verdicts(r.verdicts), "FAST: [head_size not supported, attention sinks not supported]");
}

TEST(SelectorTest, ExplicitRequestIsValidatedNeverSilentlyReplaced) {
  BackendRegistry registry;
  registry.add(std::make_unique<FakeBackend>("FAST", DeviceType::CPU, std::vector<int>{64}), 0);
  registry.add(std::make_unique<FakeBackend>("ORACLE", DeviceType::CPU, std::vector<int>{}), kOnlyWhenAsked);
  SelectionReport r = explain_selection(registry, cpu_config(77), "oracle");
  ASSERT_NE(r.chosen, nullptr);
  EXPECT_EQ(r.chosen->name(), "ORACLE");
  EXPECT_TRUE(r.explicit_request);

  r = explain_selection(registry, cpu_config(77), "FAST");
  EXPECT_EQ(r.chosen, nullptr);
  EXPECT_EQ(r.verdicts.size(), 1u);

  r = explain_selection(registry, cpu_config(64), "AUTO");
  ASSERT_NE(r.chosen, nullptr);
  EXPECT_EQ(r.chosen->name(), "FAST");
  EXPECT_FALSE(r.explicit_request);

  try {
    explain_selection(registry, cpu_config(64), "NOPE");
    FAIL() << "unknown backend accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'NOPE'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("FAST, ORACLE"), std::string::npos);
  }
}

TEST(SelectorTest, GlobalSelectHonoursExplicitRequestAndEnvironment) {
  // REFERENCE is never auto-selected, but can be requested by argument or environment.
  const SelectorConfig cfg = cpu_config(77);
  EXPECT_EQ(select_backend(cfg, "REFERENCE").name(), "REFERENCE");
  ::setenv("PAGEDATTN_BACKEND", "reference", 1);
  EXPECT_EQ(select_backend(cfg).name(), "REFERENCE");
  ::setenv("PAGEDATTN_BACKEND", "NO_SUCH_BACKEND", 1);
  EXPECT_THROW(select_backend(cfg), Error);
  ::unsetenv("PAGEDATTN_BACKEND");

  SelectorConfig mla = cfg;
  mla.use_mla = true;
  try {
    select_backend(mla, "REFERENCE");
    FAIL() << "invalid explicit request accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
    EXPECT_NE(std::string(e.what()).find("MLA not supported"), std::string::npos);
  }
}

TEST(SelectorTest, NamesRoundTrip) {
  for (auto t : {AttentionType::Decoder, AttentionType::Encoder, AttentionType::EncoderOnly,
                 AttentionType::EncoderDecoder}) {
    EXPECT_EQ(parse_attention_type(attention_type_name(t)), t);
  }
  for (auto t : {CacheDType::Auto, CacheDType::Float16, CacheDType::BFloat16, CacheDType::Fp8, CacheDType::Fp8E4M3,
                 CacheDType::Fp8E5M2}) {
    EXPECT_EQ(parse_cache_dtype(cache_dtype_name(t)), t);
  }
  EXPECT_EQ(kv_cache_storage_dtype(CacheDType::Fp8, DType::BF16), DType::FP8_E4M3);
  EXPECT_EQ(kv_cache_storage_dtype(CacheDType::Auto, DType::F16), DType::F16);
  EXPECT_EQ(parse_kv_cache_layout("hnd"), KVCacheLayout::HND);
  EXPECT_FALSE(parse_cache_dtype("int4").has_value());
}

}  // namespace
}  // namespace pagedattn
