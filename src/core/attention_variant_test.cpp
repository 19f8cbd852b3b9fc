// visible_keys and visible_keys_of_rows (attention_variant.h), the one
// statement of which keys a query sees, against docs/semantics.md's rules
// written out key by key.
#include <gtest/gtest.h>
#include <pagedattn/backend/attention_variant.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace pagedattn {
namespace {

constexpr int kNumKeys = 40;
constexpr int kWindows[] = {0, 1, 5, 12};  // 0: none

// One request's ranges as the kernels read them: offsets {0, n}, pairs.
struct Ranges {
  std::vector<std::int32_t> offsets;
  std::vector<std::int32_t> pairs;
  MmPrefixRanges view() const { return {offsets.data(), pairs.data()}; }
};

Ranges ranges(std::vector<std::int32_t> pairs) {
  return {{0, static_cast<std::int32_t>(pairs.size() / 2)}, std::move(pairs)};
}

// The rule key by key: (causal and window) or (query and key in one range).
bool literal_visible(const AttentionVariant& v, const Ranges& r, int pos, int j) {
  bool base = j >= 0 && j < kNumKeys;
  if (v.mask == MaskKind::Causal) base = base && j <= pos;
  if (v.window == WindowKind::Left) base = base && j > pos - v.window_size && j <= pos;
  if (v.window == WindowKind::Bidirectional)
    base = base && j > pos - v.window_size && j < pos + v.window_size;
  if (base) return true;
  if (v.mm_prefix.start_loc == nullptr) return false;
  for (std::size_t i = 0; i + 1 < r.pairs.size(); i += 2) {
    if (r.pairs[i] <= pos && pos < r.pairs[i + 1] && r.pairs[i] <= j && j < r.pairs[i + 1]) return true;
  }
  return false;
}

std::vector<AttentionVariant> variants(const Ranges& r) {
  std::vector<AttentionVariant> out;
  for (const int w : kWindows) {
    for (const bool with_ranges : {false, true}) {
      AttentionVariant v;
      v.mask = MaskKind::Causal;
      if (w > 0) {
        v.window = WindowKind::Left;
        v.window_size = w;
      }
      if (with_ranges) v.mm_prefix = r.view();
      out.push_back(v);
    }
    AttentionVariant encoder;
    if (w > 0) {
      encoder.window = WindowKind::Bidirectional;
      encoder.window_size = w;
    }
    out.push_back(encoder);
  }
  return out;
}

TEST(VisibleKeys, OneIntervalThatIsExactlyTheRule) {
  for (const Ranges& r : {ranges({}), ranges({3, 9}), ranges({0, 4, 4, 10, 20, 39}), ranges({30, 40})}) {
    for (const AttentionVariant& v : variants(r)) {
      for (int pos = 0; pos < kNumKeys; ++pos) {
        const KeyInterval keys = visible_keys(v, 0, pos, kNumKeys);
        for (int j = -2; j < kNumKeys + 2; ++j) {
          EXPECT_EQ(j >= keys.lo && j < keys.hi, literal_visible(v, r, pos, j))
              << "pos " << pos << " key " << j << " window " << v.window_size;
        }
      }
    }
  }
}

TEST(VisibleKeys, RowsSpanTheUnionOfTheirIntervals) {
  for (const Ranges& r : {ranges({3, 9}), ranges({0, 4, 4, 10, 20, 39}), ranges({12, 13, 15, 30})}) {
    for (const AttentionVariant& v : variants(r)) {
      for (int lo = 0; lo < kNumKeys; ++lo) {
        for (int hi = lo; hi < kNumKeys; ++hi) {
          std::optional<int> first;
          int last = 0;
          for (int pos = lo; pos <= hi; ++pos) {
            const KeyInterval k = visible_keys(v, 0, pos, kNumKeys);
            if (k.lo >= k.hi) continue;
            first = std::min(first.value_or(k.lo), k.lo);
            last = std::max(last, k.hi);
          }
          const KeyInterval rows = visible_keys_of_rows(v, 0, lo, hi, kNumKeys);
          ASSERT_TRUE(first.has_value());
          EXPECT_EQ(rows.lo, *first) << lo << ".." << hi;
          EXPECT_EQ(rows.hi, last) << lo << ".." << hi;
        }
      }
    }
  }
}

TEST(VisibleKeys, RangesAreLookedUpPerRequest) {
  // Request 0 has no range, request 1 has [2, 6).
  const std::vector<std::int32_t> offsets{0, 0, 1};
  const std::vector<std::int32_t> pairs{2, 6};
  AttentionVariant v;
  v.mask = MaskKind::Causal;
  v.mm_prefix = {offsets.data(), pairs.data()};
  EXPECT_EQ(visible_keys(v, 0, 3, 10).hi, 4);
  EXPECT_EQ(visible_keys(v, 1, 3, 10).hi, 6);
  EXPECT_EQ(visible_keys(v, 1, 6, 10).hi, 7);  // the end is exclusive
  EXPECT_EQ(mm_prefix_range_at(v.mm_prefix, 1, 1).hi, 0);
}

}  // namespace
}  // namespace pagedattn
