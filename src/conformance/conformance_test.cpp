#include <gtest/gtest.h>
#include <pagedattn/cascade.h>
#include <pagedattn/conformance.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cuda_flash/flash_planner.h"
#include "backends/reference/reference_backend.h"

namespace pagedattn {
namespace {

constexpr std::size_t kMinGridSize = 500;

const ReferenceBackend kReference;

const std::vector<ConformanceCase>& grid() {
  static const std::vector<ConformanceCase> cases = conformance_grid();
  return cases;
}

const ConformanceCase& first_case_with(std::string_view fragment) {
  for (const ConformanceCase& c : grid()) {
    if (c.id().find(fragment) != std::string::npos) return c;
  }
  throw std::runtime_error(fmt::format("no grid case contains '{}'", fragment));
}

TEST(ConformanceGridTest, IsLargeAndIdsAreUniqueAndBracketed) {
  const auto& cases = grid();
  EXPECT_GE(cases.size(), kMinGridSize);
  std::set<std::string> ids;
  for (const ConformanceCase& c : cases) {
    const std::string id = c.id();
    EXPECT_TRUE(ids.insert(id).second) << "duplicate id " << id;
    // Bracketed with no inner brackets: no id is a substring of another, so an id filter selects one case.
    ASSERT_GE(id.size(), 2u);
    EXPECT_EQ(id.front(), '[');
    EXPECT_EQ(id.back(), ']');
    EXPECT_EQ(id.find_first_of("[]", 1), id.size() - 1) << id;
  }
}

TEST(ConformanceGridTest, CoversTheRequiredAxes) {
  const auto& cases = grid();
  auto any = [&](auto pred) { return std::any_of(cases.begin(), cases.end(), pred); };
  for (const int d : {32, 64, 80, 96, 112, 128, 192, 256}) {
    EXPECT_TRUE(any([&](const ConformanceCase& c) { return c.head_size == d; })) << d;
  }
  for (const auto& [h, hkv] : {std::pair{4, 4}, {8, 2}, {5, 1}, {32, 8}}) {
    EXPECT_TRUE(any([&](const ConformanceCase& c) { return c.num_heads == h && c.num_kv_heads == hkv; }));
  }
  for (const int bs : {1, 16, 32, 128}) {
    EXPECT_TRUE(any([&](const ConformanceCase& c) { return c.block_size == bs; })) << bs;
  }
  for (const char* batch : {"small_decode", "medium_decode", "small_prefill", "medium_prefill", "mixed_small",
                            "mixed_medium", "single_decode", "single_prefill"}) {
    EXPECT_TRUE(any([&](const ConformanceCase& c) { return c.batch.name.starts_with(batch); })) << batch;
  }
  for (const DType dt : {DType::F32, DType::F16, DType::BF16}) {
    EXPECT_TRUE(any([&](const ConformanceCase& c) { return c.dtype == dt; }));
  }
  for (const CacheDType kv : {CacheDType::Auto, CacheDType::Fp8E4M3, CacheDType::Fp8E5M2}) {
    for (const bool per_head : {false, true}) {
      EXPECT_TRUE(any([&](const ConformanceCase& c) {
        return c.kv_cache_dtype == kv && (kv == CacheDType::Auto || c.per_head_kv_scales == per_head);
      }));
    }
  }
  for (const AttentionType t : {AttentionType::Decoder, AttentionType::Encoder, AttentionType::EncoderOnly,
                                AttentionType::EncoderDecoder}) {
    EXPECT_TRUE(any([&](const ConformanceCase& c) { return c.attn_type == t; }));
  }
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.layout == KVCacheLayout::HND; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.sliding_window == 64; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) {
    return c.attn_type == AttentionType::EncoderOnly && c.sliding_window;
  }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.soft_cap == 30.0f; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.alibi; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.sinks; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.strided_qkv; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.padded_slots; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.want_lse; }));
  EXPECT_TRUE(
      any([](const ConformanceCase& c) { return !c.causal && c.attn_type == AttentionType::Decoder; }));
}

// The shapes of real models: large GQA groups and MQA at head sizes 128 and
// 256 with bf16 prefill tiles of at least 16 query tokens (an item's rows are
// its tokens x the group), and the head sizes that are not powers of two.
TEST(ConformanceGridTest, CoversRealModelShapes) {
  const auto& cases = grid();
  auto any = [&](auto pred) { return std::any_of(cases.begin(), cases.end(), pred); };
  const auto has_tile = [](const ConformanceCase& c) {
    return std::any_of(c.batch.requests.begin(), c.batch.requests.end(),
                       [](const auto& r) { return r.first >= cpu_attn::kQueryTileTokens; });
  };
  for (const auto& [h, hkv] : {std::pair{17, 1}, {32, 1}, {48, 1}, {64, 1}, {64, 8}}) {
    for (const int d : {128, 256}) {
      const bool covered = any([&](const ConformanceCase& c) {
        return c.num_heads == h && c.num_kv_heads == hkv && c.head_size == d && c.dtype == DType::BF16 &&
               c.kv_cache_dtype == CacheDType::Auto && has_tile(c);
      });
      EXPECT_TRUE(covered) << h << "/" << hkv << " d" << d;
    }
  }
  for (const int d : {72, 80, 88, 96, 112, 192, 256}) {
    for (const bool prefill : {false, true}) {
      EXPECT_TRUE(any([&](const ConformanceCase& c) { return c.head_size == d && has_tile(c) == prefill; }))
          << d << (prefill ? " prefill" : " decode");
    }
  }
}

// Chunked local attention where it matters: a prefill whose queries span a
// chunk boundary and a decode past the first chunk, each plain and with the
// scoring features, at every dtype.
TEST(ConformanceGridTest, CoversChunkedLocalAttentionAcrossChunkBoundaries) {
  const auto& cases = grid();
  const auto covered = [&](auto pred) {
    return std::any_of(cases.begin(), cases.end(), [&](const ConformanceCase& c) {
      if (!c.attention_chunk_size) return false;
      const int chunk = *c.attention_chunk_size;
      return std::any_of(c.batch.requests.begin(), c.batch.requests.end(), [&](const auto& r) {
        const auto [q, k] = r;
        return q > 0 && pred(c, q, (k - q) / chunk != (k - 1) / chunk, k > chunk);
      });
    });
  };
  for (const DType dt : {DType::F32, DType::F16, DType::BF16}) {
    for (const bool features : {false, true}) {
      const auto with = [&](const ConformanceCase& c) { return c.dtype == dt && (c.alibi && c.sinks) == features; };
      EXPECT_TRUE(covered([&](const ConformanceCase& c, int q, bool spans, bool) { return with(c) && q > 1 && spans; }))
          << dtype_name(dt) << (features ? " with features" : "") << ": prefill across a chunk boundary";
      EXPECT_TRUE(covered([&](const ConformanceCase& c, int q, bool, bool past) { return with(c) && q == 1 && past; }))
          << dtype_name(dt) << (features ? " with features" : "") << ": decode past the first chunk";
    }
  }
}

// PrefixLM ranges where they matter, at every dtype, plain and with the
// scoring features: prefill queries inside a range that reaches past their
// diagonal, two ranges in one request, a range crossing the context /
// new-token boundary, ranges ending on a key-tile edge and mid-tile, a
// decode-only step with ranges, and a split request with one.
TEST(ConformanceGridTest, CoversPrefixLmRanges) {
  struct Ranged {
    int q, k;
    const std::vector<MmPrefixRange>& ranges;
  };
  const auto covered = [&](auto pred) {
    return std::any_of(grid().begin(), grid().end(), [&](const ConformanceCase& c) {
      if (!c.mm_prefix) return false;
      for (std::size_t r = 0; r < c.batch.requests.size(); ++r) {
        const auto [q, k] = c.batch.requests[r];
        if (pred(c, Ranged{q, k, c.batch.mm_prefix_ranges[r]})) return true;
      }
      return false;
    });
  };
  const auto any_range = [](const Ranged& r, auto pred) {
    return std::any_of(r.ranges.begin(), r.ranges.end(), pred);
  };
  const auto decode_only = [](const ConformanceCase& c) {
    return std::all_of(c.batch.requests.begin(), c.batch.requests.end(), [](const auto& r) { return r.first == 1; });
  };
  constexpr int kTile = cuda_flash::kBlockN;
  for (const DType dt : {DType::F32, DType::F16, DType::BF16}) {
    for (const bool features : {false, true}) {
      const auto with = [&](const ConformanceCase& c) {
        return c.dtype == dt && (c.sliding_window && c.alibi && c.sinks) == features;
      };
      const std::string what = fmt::format("{}{}: ", dtype_name(dt), features ? " with features" : "");
      EXPECT_TRUE(covered([&](const ConformanceCase& c, const Ranged& r) {
        return with(c) && r.q > 1 && any_range(r, [&](const MmPrefixRange& m) { return m.end > r.k - r.q + 1; });
      })) << what << "prefill queries inside a range past their diagonal";
      EXPECT_TRUE(covered([&](const ConformanceCase& c, const Ranged& r) { return with(c) && r.ranges.size() >= 2; }))
          << what << "two ranges in a request";
      EXPECT_TRUE(covered([&](const ConformanceCase& c, const Ranged& r) {
        return with(c) && r.q > 1 && r.q < r.k &&
               any_range(r, [&](const MmPrefixRange& m) { return m.start < r.k - r.q && m.end > r.k - r.q; });
      })) << what << "a range across the context boundary";
      EXPECT_TRUE(covered([&](const ConformanceCase& c, const Ranged& r) {
        return with(c) && any_range(r, [](const MmPrefixRange& m) { return m.end % kTile == 0; });
      })) << what << "a range ending on a key-tile edge";
      EXPECT_TRUE(covered([&](const ConformanceCase& c, const Ranged& r) {
        return with(c) && any_range(r, [](const MmPrefixRange& m) { return m.end % kTile != 0; });
      })) << what << "a range ending mid-tile";
      EXPECT_TRUE(covered([&](const ConformanceCase& c, const Ranged& r) {
        return with(c) && decode_only(c) && !r.ranges.empty();
      })) << what << "a decode-only step with ranges";
      EXPECT_TRUE(covered([&](const ConformanceCase& c, const Ranged& r) {
        return with(c) && r.q <= cpu_attn::kSplitMaxQueryTokens && r.k > cpu_attn::kSplitKeys && !r.ranges.empty();
      })) << what << "a split request with a range";
    }
  }
}

// Cascade: for every dtype, shared prefixes that are planned as cascades
// (plain and with a soft cap) and ones the builder must decline (a window,
// ALiBi or sinks; a prefix under the heuristic's minimum).
TEST(ConformanceGridTest, CoversCascadesAndTheStepsThatMustNotCascade) {
  const auto& cases = grid();
  const auto any = [&](auto pred) { return std::any_of(cases.begin(), cases.end(), pred); };
  for (const DType dt : {DType::F32, DType::F16, DType::BF16}) {
    EXPECT_TRUE(any([&](const ConformanceCase& c) {
      return c.dtype == dt && c.shared_prefix >= kCascadeMinPrefixTokens && !c.sliding_window && !c.alibi &&
             !c.sinks && c.soft_cap;
    })) << dtype_name(dt) << ": cascade with a soft cap";
    EXPECT_TRUE(any([&](const ConformanceCase& c) {
      return c.dtype == dt && c.shared_prefix >= kCascadeMinPrefixTokens && c.sliding_window;
    })) << dtype_name(dt) << ": declined for a window";
    EXPECT_TRUE(any([&](const ConformanceCase& c) {
      return c.dtype == dt && c.shared_prefix > 0 && c.shared_prefix < kCascadeMinPrefixTokens;
    })) << dtype_name(dt) << ": declined for a short prefix";
  }
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.shared_prefix > 0 && c.sinks; }));
  EXPECT_TRUE(any([](const ConformanceCase& c) { return c.shared_prefix > 0 && is_quantized_kv_cache(c.kv_cache_dtype); }));
}

// Requests past the backends' split thresholds: CPU_ATTN splits requests of
// at most kSplitMaxQueryTokens tokens every kSplitKeys keys; CUDA_FLASH
// splits into at most kMaxSplits parts of at least kMinKeysPerSplit keys.
TEST(ConformanceGridTest, CoversLongContextsPastTheSplitThresholds) {
  const auto& cases = grid();
  const auto has_request = [&](auto pred) {
    return std::any_of(cases.begin(), cases.end(), [&](const ConformanceCase& c) {
      return c.attn_type == AttentionType::Decoder &&
             std::any_of(c.batch.requests.begin(), c.batch.requests.end(),
                         [&](const auto& r) { return pred(r.first, r.second); });
    });
  };
  constexpr int kSplitTokens = cpu_attn::kSplitMaxQueryTokens;
  constexpr int kSplit = cpu_attn::kSplitKeys;
  EXPECT_TRUE(has_request([](int q, int k) { return q == 1 && k == kSplit; }));
  EXPECT_TRUE(has_request([](int q, int k) { return q == 1 && k == kSplit + 1; }));
  EXPECT_TRUE(has_request([](int q, int k) { return q == kSplitTokens && k > 2 * kSplit; }));
  EXPECT_TRUE(has_request([](int q, int k) { return q == kSplitTokens + 1 && k > kSplit; }));
  EXPECT_TRUE(
      has_request([](int q, int k) { return q > 1 && q <= cuda_flash::kDecodeMaxTokens && k > kSplit; }));
  EXPECT_TRUE(has_request([](int q, int k) { return q >= cpu_attn::kQueryTileTokens && k > kSplit; }));
  EXPECT_TRUE(has_request(
      [](int q, int k) { return q == 1 && k > cuda_flash::kMaxSplits * cuda_flash::kMinKeysPerSplit; }));
  // A window over a split decode: splits that see no key.
  EXPECT_TRUE(std::any_of(cases.begin(), cases.end(), [](const ConformanceCase& c) {
    return c.sliding_window &&
           std::any_of(c.batch.requests.begin(), c.batch.requests.end(),
                       [](const auto& r) { return r.first <= kSplitTokens && r.second > 2 * kSplit; });
  }));
}

// One case per feature, against REFERENCE.
TEST(ConformanceReferenceTest, FeatureSamplesPass) {
  for (const char* fragment : {"[decoder,", "bs1,",           "bs128,",
                               "HND",       "kv=fp8_e4m3,",   "kv=fp8_e5m2/head",
                               "kv=fp8,",   "win=64",         "cap=30",
                               "alibi",     "sinks",          "strided",
                               "padded",    ",lse",           "noncausal",
                               "[encoder,", "[encoder_only,", "[encoder_decoder,",
                               "h32/8",     "block_edges",    "large_decode_div16",
                               "mm_prefix",   "batch_invariant"}) {
    const ConformanceCase& c = first_case_with(fragment);
    const CaseResult r = run_conformance_case(kReference, c);
    EXPECT_EQ(r.status, CaseStatus::Passed) << c.id() << ": " << r.message;
  }
}

TEST(ConformanceReferenceTest, FilteredRunReportsInGridOrder) {
  std::vector<std::string> seen;
  const ConformanceSummary summary = run_conformance(
      kReference, "small_decode,", Device::cpu(), [&](const ConformanceCase& c, const CaseResult& r) {
        EXPECT_EQ(r.status, CaseStatus::Passed) << c.id() << ": " << r.message;
        seen.push_back(c.id());
      });
  std::vector<std::string> expected;
  for (const ConformanceCase& c : grid()) {
    if (c.id().find("small_decode,") != std::string::npos) expected.push_back(c.id());
  }
  EXPECT_FALSE(expected.empty());
  EXPECT_EQ(seen, expected);
  EXPECT_EQ(summary.passed, static_cast<int>(expected.size()));
  EXPECT_TRUE(summary.ok());
  EXPECT_EQ(format_summary(summary),
            fmt::format("conformance: {} passed, 0 failed, 0 skipped", expected.size()));
}

TEST(ConformanceReferenceTest, AnIdReproducesExactlyOneCase) {
  const ConformanceCase& c = grid()[grid().size() / 2];
  int calls = 0;
  const ConformanceSummary s = run_conformance(kReference, c.id(), Device::cpu(),
                                               [&](const ConformanceCase&, const CaseResult&) { ++calls; });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(s.passed + s.failed + s.skipped, 1);
}

TEST(ConformanceReferenceTest, SeveralIdsRunExactlyThoseCases) {
  const std::vector<std::string> ids{grid()[1].id(), grid()[grid().size() - 1].id()};
  std::vector<std::string> seen;
  const ConformanceSummary s = run_conformance(
      kReference, std::span<const std::string>(ids), Device::cpu(),
      [&](const ConformanceCase& c, const CaseResult&) { seen.push_back(c.id()); });
  EXPECT_EQ(seen, ids);
  EXPECT_EQ(s.passed, 2);
  EXPECT_TRUE(matches_any(grid()[0], {}));
  EXPECT_FALSE(matches_any(grid()[0], ids));
}

// ---- a deliberately broken backend must be caught ----

enum class Defect {
  PerturbOneElement,    // one output element off by far more than the tolerance
  SkipLastRow,          // the last real row is never written
  WriteGuardRow,        // writes the row before the output
  WritePaddedRow,       // writes a row past num_actual_tokens
  Nondeterministic,     // the second call differs by one ulp
  WriteNullBlock,       // stores into block 0 of the cache
  CorruptLse,           // wrong LSE
  NoSinks,              // declares no sink support
  PowerOfTwoHeadSizes,  // declares head sizes 64, 128 and 256 only
};

class BrokenImpl final : public AttentionImpl {
 public:
  BrokenImpl(std::unique_ptr<AttentionImpl> inner, Defect defect)
      : AttentionImpl(inner->params()), inner_(std::move(inner)), defect_(defect) {}

  void check_forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                     const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                     const TensorView& output, const TensorView& lse) const override {
    inner_->check_forward(layer, query, key, value, kv_cache, metadata, output, lse);
  }
  void forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
               const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
               const TensorView& output, const TensorView& lse) override {
    inner_->forward(layer, query, key, value, kv_cache, metadata, output, lse);
    const int tokens = metadata.common.num_actual_tokens;
    const DType t = output.dtype();
    auto element = [&](std::int64_t row) {
      return static_cast<std::byte*>(output.data()) +
             row * output.stride(0) * static_cast<std::int64_t>(dtype_size(t));
    };
    switch (defect_) {
      case Defect::PerturbOneElement:
        store_from_float(element(tokens / 2), t, load_as_float(element(tokens / 2), t) + 1.0f);
        break;
      case Defect::SkipLastRow:
        fill_tensor(output.select(0, tokens - 1), std::numeric_limits<float>::quiet_NaN());
        break;
      case Defect::WriteGuardRow:
        store_from_float(element(-1), t, 0.0f);
        break;
      case Defect::WritePaddedRow:
        store_from_float(element(tokens), t, 0.0f);
        break;
      case Defect::Nondeterministic:
        if (++calls_ == 2) {
          auto* p = element(0);
          std::uint8_t byte;
          std::memcpy(&byte, p, 1);
          byte ^= 1u;
          std::memcpy(p, &byte, 1);
        }
        break;
      case Defect::WriteNullBlock:
        store_from_float(kv_cache.key.data(), kv_cache.key.dtype(), 0.0f);
        break;
      case Defect::CorruptLse:
        if (lse.defined()) *static_cast<float*>(lse.data()) += 1.0f;
        break;
      case Defect::NoSinks:
      case Defect::PowerOfTwoHeadSizes:
        break;
    }
  }

  void do_kv_cache_update(const LayerQuantState& layer, const TensorView& key, const TensorView& value,
                          const KVCacheView& kv_cache, const TensorView& slot_mapping) override {
    inner_->do_kv_cache_update(layer, key, value, kv_cache, slot_mapping);
  }

  std::string_view class_name() const override { return "BrokenImpl"; }

 private:
  std::unique_ptr<AttentionImpl> inner_;
  Defect defect_;
  int calls_ = 0;
};

class BrokenBackend final : public ReferenceBackend {
 public:
  explicit BrokenBackend(Defect defect) : defect_(defect) {}
  std::string_view name() const override { return "BROKEN"; }
  bool supports_sink() const override { return defect_ != Defect::NoSinks; }
  std::optional<std::string> head_size_rule(int head_size) const override {
    if (defect_ == Defect::PowerOfTwoHeadSizes && head_size != 64 && head_size != 128 && head_size != 256) {
      return "head_size must be 64, 128 or 256";
    }
    return ReferenceBackend::head_size_rule(head_size);
  }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override {
    return std::make_unique<BrokenImpl>(ReferenceBackend::make_impl(params), defect_);
  }

 private:
  Defect defect_;
};

CaseResult run_broken(Defect defect, std::string_view fragment) {
  return run_conformance_case(BrokenBackend(defect), first_case_with(fragment));
}

TEST(ConformanceCheckerTest, CatchesBrokenBackends) {
  struct Expectation {
    Defect defect;
    const char* case_fragment;
    const char* message_fragment;
  };
  const Expectation expectations[] = {
      {Defect::PerturbOneElement, "mixed_small,", "outside atol"},
      {Defect::SkipLastRow, "small_prefill,", "output elements outside"},
      {Defect::WriteGuardRow, "small_decode,", "guard row"},
      {Defect::WritePaddedRow, "padded", "padded row"},
      {Defect::Nondeterministic, "fresh_prefill,", "different bits"},
      {Defect::WriteNullBlock, "block_edges,", "slot outside the written ones"},
      {Defect::CorruptLse, ",lse", "lse"},
  };
  for (const Expectation& e : expectations) {
    const CaseResult r = run_broken(e.defect, e.case_fragment);
    EXPECT_EQ(r.status, CaseStatus::Failed) << e.message_fragment;
    EXPECT_NE(r.message.find(e.message_fragment), std::string::npos) << r.message;
  }
}

// The digest tells two builds' bits apart: equal for the same bits, unequal
// when one output element moves, and 0 when no forward ran.
TEST(ConformanceCheckerTest, DigestIsTheOutputBits) {
  const ConformanceCase& c = first_case_with("mixed_small,");
  const CaseResult first = run_conformance_case(kReference, c);
  const CaseResult again = run_conformance_case(kReference, c);
  ASSERT_EQ(first.status, CaseStatus::Passed) << first.message;
  EXPECT_NE(first.digest, 0u);
  EXPECT_EQ(first.digest, again.digest);
  EXPECT_NE(run_broken(Defect::PerturbOneElement, "mixed_small,").digest, first.digest);
  EXPECT_NE(run_conformance_case(kReference, first_case_with("small_decode,")).digest, first.digest);
  EXPECT_EQ(run_broken(Defect::NoSinks, "sinks").digest, 0u);
}

TEST(ConformanceCheckerTest, UnsupportedCasesAreSkipped) {
  const CaseResult r = run_broken(Defect::NoSinks, "sinks");
  EXPECT_EQ(r.status, CaseStatus::Skipped);
  EXPECT_NE(r.message.find("attention sinks not supported"), std::string::npos) << r.message;
  const CaseResult narrow = run_broken(Defect::PowerOfTwoHeadSizes, ",d88,");
  EXPECT_EQ(narrow.status, CaseStatus::Skipped);
  EXPECT_NE(narrow.message.find("head_size"), std::string::npos) << narrow.message;
  const CaseResult elsewhere = run_conformance_case(kReference, grid().front(), Device::cuda(0));
  EXPECT_EQ(elsewhere.status, CaseStatus::Skipped);
  EXPECT_NE(elsewhere.message.find("runs on cpu"), std::string::npos) << elsewhere.message;
}

TEST(ConformanceCheckerTest, InvalidCasesFail) {
  ConformanceCase c;
  c.num_kv_heads = 3;
  c.batch = conformance_batch_spec("small_decode");
  const CaseResult r = run_conformance_case(kReference, c);
  EXPECT_EQ(r.status, CaseStatus::Failed);
  EXPECT_NE(r.message.find("invalid case"), std::string::npos) << r.message;
}

}  // namespace
}  // namespace pagedattn
