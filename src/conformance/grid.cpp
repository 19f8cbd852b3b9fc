// The conformance grid: named batches, case ids, and the sweeps. Not a full
// Cartesian product: a base sweep over the shape axes (head size x heads x
// block size) with the other axes rotating, plus one sweep per feature.
#include <pagedattn/conformance.h>
#include <pagedattn/error.h>

#include <array>
#include <cmath>
#include <unordered_set>

namespace pagedattn {

namespace {

using Requests = std::vector<std::pair<int, int>>;

Requests repeat(std::pair<int, int> request, int times) {
  return Requests(static_cast<std::size_t>(times), request);
}

Requests concat(Requests a, const Requests& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<BatchSpec> make_batch_specs() {
  return {
      // vLLM's BATCH_SPECS (tests/v1/attention/test_attention_backends.py), real size.
      {"small_decode", {{1, 32}, {1, 40}}},
      {"small_prefill", {{8, 32}, {8, 40}}},
      {"mixed_small", {{1, 32}, {1, 40}, {5, 48}, {5, 56}}},
      {"medium_decode",
       concat({{1, 128}, {1, 256}, {1, 512}, {1, 1024}}, {{1, 128}, {1, 256}, {1, 512}, {1, 1024}})},
      {"medium_prefill", {{16, 256}, {16, 512}, {16, 1024}, {16, 2048}}},
      {"mixed_medium", {{1, 512}, {1, 1024}, {1, 2048}, {7, 512}, {7, 1024}, {7, 2048}}},
      {"single_decode", {{1, 1024}}},
      {"single_prefill", {{64, 1024}}},
      {"large_decode", repeat({1, 2048}, 32)},
      // The same shapes with sequence lengths divided, for a scalar oracle.
      {"medium_decode_div4",
       concat({{1, 32}, {1, 64}, {1, 128}, {1, 256}}, {{1, 32}, {1, 64}, {1, 128}, {1, 256}})},
      {"medium_prefill_div8", {{16, 32}, {16, 64}, {16, 128}, {16, 256}}},
      {"mixed_medium_div8", {{1, 64}, {1, 128}, {1, 256}, {7, 64}, {7, 128}, {7, 256}}},
      {"large_decode_div16", repeat({1, 128}, 32)},
      {"single_decode_div4", {{1, 256}}},
      {"single_prefill_div8", {{64, 128}}},
      // Prompts without context, and lengths on and around block boundaries.
      {"fresh_prefill", {{13, 13}, {40, 40}}},
      {"block_edges", {{1, 1}, {3, 16}, {2, 17}, {1, 33}, {32, 32}}},
      // Chunked local attention: prefills whose queries span chunk boundaries
      // (of 48, 64 and 128 tokens) beside decodes past the first chunk.
      {"chunk_edges", {{70, 130}, {1, 129}, {33, 96}, {1, 48}, {50, 200}}},
      // PrefixLM: a fresh prefill with two ranges (one ending on the 64-key
      // tile edge, one mid-tile); chunked prefills whose ranges cross the
      // context / new-token boundary (one starting right on it); a decode
      // past a range; a speculative step inside one that ends with the
      // sequence; a range reaching further back than a 64-key window.
      {"mm_edges",
       {{80, 80}, {40, 100}, {1, 120}, {4, 90}, {32, 160}, {16, 200}},
       {{{5, 64}, {70, 77}}, {{50, 90}}, {{10, 50}}, {{80, 90}}, {{128, 160}}, {{20, 196}}}},
      // A decode-only step: each token plain causal, inside a range or not.
      {"mm_decode", {{1, 120}, {1, 70}, {1, 33}, {1, 100}}, {{{10, 50}}, {{60, 70}}, {}, {{0, 30}, {40, 99}}}},
      // Ranges in requests past the split thresholds (split_edges): CPU_ATTN
      // splits the 8-token step's keys, CUDA_FLASH the 3-token one's.
      {"mm_split", {{8, 3073}, {3, 600}, {1, 1700}}, {{{3066, 3073}}, {{590, 600}}, {{1000, 1700}}}},
      // Cascade: 8 requests (decodes, speculative steps, a short prefill)
      // whose contexts all hold at least 256 tokens, for a shared prefix.
      {"shared_prefix", {{1, 300}, {1, 412}, {3, 290}, {1, 520}, {9, 280}, {1, 357}, {2, 333}, {1, 270}}},
      // Encoder / encoder-only: every request is a whole sequence.
      {"encoder_small", {{17, 17}, {40, 40}, {1, 1}}},
      {"encoder_long", {{100, 100}, {37, 37}}},
      // Cross-attention: (decoder query_len, encoder length); queries may outnumber keys.
      {"cross_small", {{1, 32}, {5, 48}}},
      {"cross_prefill", {{8, 32}, {20, 7}, {3, 130}}},
      // Large GQA groups and MQA: prefill tiles of 16 query tokens (16 x the
      // group rows in one item) beside a fresh prompt, and a decode, a
      // speculative step and a tile of 16 tokens plus one.
      {"gqa_prefill", {{16, 48}, {20, 20}}},
      {"gqa_mixed", {{1, 100}, {4, 60}, {17, 80}}},
      // Long contexts past the split thresholds: CPU_ATTN splits requests of
      // at most 8 query tokens every 1536 keys (kSplitKeys, on and around the
      // edges here; 9 tokens are not split); CUDA_FLASH splits from 512 keys
      // up to 64 ways (kMinKeysPerSplit, kMaxSplits: 32768 keys), beyond which
      // its splits grow longer.
      {"split_edges", {{1, 1536}, {1, 1537}, {8, 3073}, {9, 1540}}},
      {"split_gqa", {{1, 1700}, {1, 1600}}},
      {"long_mixed", {{1, 4000}, {4, 3100}, {16, 1600}}},
      {"long_decode", {{1, 33000}}},
  };
}

// Upper bound of (query, key, head, dim) products of a case: keeps every case
// cheap enough for the scalar oracle and the REFERENCE backend.
constexpr double kMaxCaseWork = 32e6;

double case_work(const ConformanceCase& c) {
  double pairs = 0.0;
  for (const auto& [q, s] : c.batch.requests) pairs += static_cast<double>(q) * s;
  return pairs * c.num_heads * c.head_size;
}

// Upper bound of K (or V) elements of a case: the harness keeps several
// copies (model values, dequantized values, cache and its expected image).
constexpr double kMaxCaseKvElements = 4.5e6;

double case_kv_elements(const ConformanceCase& c) {
  double keys = 0.0;
  for (const auto& [q, s] : c.batch.requests) keys += s;
  return keys * c.num_kv_heads * c.head_size;
}

std::string feature_id(const ConformanceCase& c) {
  std::string s = fmt::format("{},d{},h{}/{},bs{},{},{},kv={}", attention_type_name(c.attn_type), c.head_size,
                              c.num_heads, c.num_kv_heads, c.block_size, c.batch.name, dtype_name(c.dtype),
                              cache_dtype_name(c.kv_cache_dtype));
  if (c.per_head_kv_scales) s += "/head";
  s += fmt::format(",{}", kv_cache_layout_name(c.layout));
  if (!c.causal && c.attn_type == AttentionType::Decoder) s += ",noncausal";
  if (c.sliding_window) s += fmt::format(",win={}", *c.sliding_window);
  if (c.attention_chunk_size) s += fmt::format(",chunk={}", *c.attention_chunk_size);
  if (c.mm_prefix) s += ",mm_prefix";
  if (c.batch_invariant) s += ",batch_invariant";
  if (c.shared_prefix > 0) s += fmt::format(",prefix={}", c.shared_prefix);
  if (c.soft_cap) s += fmt::format(",cap={}", *c.soft_cap);
  if (c.scale) s += fmt::format(",scale={}", *c.scale);
  if (c.alibi) s += ",alibi";
  if (c.sinks) s += ",sinks";
  if (c.strided_qkv) s += ",strided";
  if (c.padded_slots) s += ",padded";
  if (c.want_lse) s += ",lse";
  return s;
}

// Stable per-case seed (FNV-1a of the features), so adding cases changes no other case's data.
std::uint32_t seed_of(std::string_view features) {
  std::uint32_t h = 2166136261u;
  for (const char ch : features) {
    h ^= static_cast<unsigned char>(ch);
    h *= 16777619u;
  }
  return h % 100000u;
}

struct Shape {
  int heads;
  int kv_heads;
  int head_size;
};

constexpr std::array kHeadSizes{32, 64, 80, 96, 112, 128, 192, 256};
constexpr std::array<std::pair<int, int>, 4> kHeads{{{4, 4}, {8, 2}, {5, 1}, {32, 8}}};
constexpr std::array kBlockSizes{1, 16, 32, 128};
constexpr std::array kDTypes{DType::BF16, DType::F16, DType::F32};
constexpr std::array kLayouts{KVCacheLayout::NHD, KVCacheLayout::HND};
// Shapes the feature sweeps rotate through.
constexpr std::array<Shape, 9> kFeatureShapes{{{8, 2, 64},
                                               {5, 1, 128},
                                               {4, 4, 80},
                                               {32, 8, 128},
                                               {8, 2, 256},
                                               {4, 4, 32},
                                               {5, 1, 112},
                                               {8, 2, 192},
                                               {4, 4, 96}}};
constexpr int kBasePasses = 3;
constexpr int kWindow = 64;
constexpr int kMinChunk = 48;
constexpr int kCascadePrefix = 256;  // kCascadeMinPrefixTokens: the least a cascade is planned for  // chunked local attention: a chunk under the long batches' contexts
constexpr float kSoftCap = 30.0f;
// With unit-variance q and k, scores have standard deviation scale * sqrt(D):
// 2.0 puts them at 16..32 for head sizes 64..256, where a cap of 30 bites.
constexpr float kSoftCapScale = 2.0f;

class GridBuilder {
 public:
  // Adds the case unless an identical one exists or it exceeds the budgets.
  bool add(ConformanceCase c) {
    if (case_work(c) > kMaxCaseWork || case_kv_elements(c) > kMaxCaseKvElements) return false;
    std::string features = feature_id(c);
    if (!seen_.insert(features).second) return false;
    c.seed = seed_of(features);
    cases_.push_back(std::move(c));
    return true;
  }

  // Adds `c` with the first batch of `batches` (from `start`, cyclically) that fits the budget.
  void add_rotating(ConformanceCase c, std::span<const char* const> batches, std::size_t start) {
    for (std::size_t k = 0; k < batches.size(); ++k) {
      c.batch = conformance_batch_spec(batches[(start + k) % batches.size()]);
      if (add(c)) return;
    }
  }

  std::vector<ConformanceCase> take() { return std::move(cases_); }

 private:
  std::vector<ConformanceCase> cases_;
  std::unordered_set<std::string> seen_;
};

ConformanceCase with_shape(const Shape& s, int block_size) {
  ConformanceCase c;
  c.num_heads = s.heads;
  c.num_kv_heads = s.kv_heads;
  c.head_size = s.head_size;
  c.block_size = block_size;
  return c;
}

constexpr std::array kDecoderBatches{"small_decode",       "small_prefill",       "mixed_small",
                                     "medium_decode_div4", "medium_prefill_div8", "mixed_medium_div8",
                                     "single_decode_div4", "single_prefill_div8", "fresh_prefill",
                                     "block_edges",        "large_decode_div16"};
// Batches long enough for a window of 64 to hide keys.
constexpr std::array kLongBatches{"mixed_medium_div8", "single_prefill_div8", "medium_prefill_div8",
                                  "medium_decode_div4"};
// Chunked local attention: boundaries inside prefills, and the long batches.
constexpr std::array kChunkBatches{"chunk_edges", "single_prefill_div8", "chunk_edges", "mixed_medium_div8"};
// PrefixLM: ranges on tile edges and across the context, decode-only, split.
constexpr std::array kMmPrefixBatches{"mm_edges", "mm_decode", "mm_split", "mm_edges"};
constexpr std::array kEncoderBatches{"encoder_small", "encoder_long"};
constexpr std::array kCrossBatches{"cross_small", "cross_prefill"};

// Head size x heads x block size, three times, with batch, dtype, layout, strides,
// padding and LSE rotating on co-prime periods so their combinations mix.
void base_sweep(GridBuilder& g) {
  std::size_t n = 0;
  for (int pass = 0; pass < kBasePasses; ++pass) {
    for (const int d : kHeadSizes) {
      for (const auto& [h, hkv] : kHeads) {
        for (const int bs : kBlockSizes) {
          ConformanceCase c = with_shape({h, hkv, d}, bs);
          c.dtype = kDTypes[n % kDTypes.size()];
          c.layout = kLayouts[(n / 2) % kLayouts.size()];
          c.strided_qkv = n % 5 == 1;
          c.padded_slots = n % 7 == 3;
          c.want_lse = n % 2 == 1;
          g.add_rotating(c, kDecoderBatches, n * 7 + static_cast<std::size_t>(pass));
          ++n;
        }
      }
    }
  }
}

// One decoder feature (window, soft cap, ALiBi, sinks or all of them) over
// dtypes x layouts x long batches, rotating shapes and block sizes.
template <typename Apply, typename Batches = decltype(kLongBatches)>
void feature_sweep(GridBuilder& g, std::size_t salt, Apply apply, const Batches& batches = kLongBatches) {
  std::size_t n = salt;
  for (int variant = 0; variant < 2; ++variant) {
    for (const DType dt : kDTypes) {
      for (const KVCacheLayout layout : kLayouts) {
        for (std::size_t b = 0; b < batches.size(); ++b) {
          ConformanceCase c =
              with_shape(kFeatureShapes[n % kFeatureShapes.size()], kBlockSizes[n % kBlockSizes.size()]);
          c.dtype = dt;
          c.layout = layout;
          c.want_lse = n % 2 == 0;
          c.strided_qkv = n % 3 == 0;
          c.padded_slots = variant == 1 && n % 2 == 1;
          apply(c);
          g.add_rotating(c, batches, b + static_cast<std::size_t>(variant));
          ++n;
        }
      }
    }
  }
}

// Cascade: a 256-token shared prefix (and 128 below the heuristic's 256,
// where no cascade may be planned) over dtypes x layouts x block sizes, plain,
// with soft cap or over fp8 (cascades), and with a window, ALiBi or sinks
// (the builder must decline them).
void cascade_sweep(GridBuilder& g) {
  constexpr std::array kPrefixBlockSizes{1, 16, 32, 128};
  std::size_t n = 0;
  for (const DType dt : kDTypes) {
    for (const KVCacheLayout layout : kLayouts) {
      for (int variant = 0; variant < 6; ++variant) {
        ConformanceCase c = with_shape(kFeatureShapes[n % kFeatureShapes.size()],
                                       kPrefixBlockSizes[n % kPrefixBlockSizes.size()]);
        c.dtype = dt;
        c.layout = layout;
        c.shared_prefix = variant == 5 ? 128 : kCascadePrefix;
        c.want_lse = n % 2 == 0;
        c.strided_qkv = n % 3 == 1;
        if (variant == 1) {
          c.soft_cap = kSoftCap;
          c.scale = kSoftCapScale;
        }
        if (variant == 2) c.kv_cache_dtype = dt == DType::F32 ? CacheDType::Auto : CacheDType::Fp8E4M3;
        if (variant == 3) c.sliding_window = kWindow;
        if (variant == 4) {
          c.alibi = layout == KVCacheLayout::NHD;
          c.sinks = layout == KVCacheLayout::HND;
        }
        g.add_rotating(c, std::array{"shared_prefix"}, 0);
        ++n;
      }
    }
  }
}

// A chunk shorter than the long batches' contexts, so that most queries see
// a chunk boundary: the smallest multiple of the block size >= kMinChunk.
int chunk_for(int block_size) { return (kMinChunk + block_size - 1) / block_size * block_size; }

void fp8_sweep(GridBuilder& g) {
  constexpr std::array kFp8{CacheDType::Fp8E4M3, CacheDType::Fp8E5M2, CacheDType::Fp8};
  constexpr std::array kFp8Batches{"mixed_small", "medium_decode_div4", "single_prefill_div8", "block_edges"};
  std::size_t n = 0;
  for (const CacheDType kv : kFp8) {
    for (const bool per_head : {false, true}) {
      for (const KVCacheLayout layout : kLayouts) {
        for (const DType dt : kDTypes) {
          for (int variant = 0; variant < 2; ++variant) {
            ConformanceCase c = with_shape(kFeatureShapes[(n + 3) % kFeatureShapes.size()],
                                           kBlockSizes[(n + 1) % kBlockSizes.size()]);
            c.dtype = dt;
            c.layout = layout;
            c.kv_cache_dtype = kv;
            c.per_head_kv_scales = per_head;
            c.want_lse = variant == 1;
            c.padded_slots = n % 4 == 2;
            // Every fourth case adds a decoder feature on top of the quantized cache.
            if (n % 4 == 1) c.sliding_window = kWindow;
            if (n % 4 == 3) c.sinks = true;
            g.add_rotating(c, kFp8Batches, n);
            ++n;
          }
        }
      }
    }
  }
}

// Per-token-head caches (int8 and fp8 with a scale per slot and KV head):
// dtypes x layouts over decodes, prefills and mixed batches of GQA shapes,
// some with a window, sinks or a soft cap; then a long split decode, a large
// group and cross-attention over each.
void token_head_sweep(GridBuilder& g) {
  constexpr std::array kTokenHead{CacheDType::Int8PerTokenHead, CacheDType::Fp8PerTokenHead};
  constexpr std::array kBatches{"mixed_small", "medium_decode_div4", "single_prefill_div8",
                                "gqa_mixed",   "block_edges",        "mixed_medium_div8"};
  std::size_t n = 0;
  for (const CacheDType kv : kTokenHead) {
    for (const KVCacheLayout layout : kLayouts) {
      for (const DType dt : kDTypes) {
        for (int variant = 0; variant < 2; ++variant) {
          ConformanceCase c = with_shape(kFeatureShapes[n % kFeatureShapes.size()],
                                         kBlockSizes[(n + 1) % kBlockSizes.size()]);
          c.dtype = dt;
          c.layout = layout;
          c.kv_cache_dtype = kv;
          c.want_lse = variant == 1;
          c.padded_slots = n % 4 == 2;
          c.strided_qkv = n % 3 == 1;
          if (n % 6 == 1) c.sliding_window = kWindow;
          if (n % 6 == 3) c.sinks = true;
          if (n % 6 == 5) {
            c.soft_cap = kSoftCap;
            c.scale = kSoftCapScale;
          }
          g.add_rotating(c, kBatches, n);
          ++n;
        }
      }
    }
    ConformanceCase split = with_shape({8, 2, 64}, 16);
    split.kv_cache_dtype = kv;
    split.want_lse = true;
    split.batch = conformance_batch_spec("long_decode");
    g.add(split);
    ConformanceCase group = with_shape({32, 1, 128}, 32);
    group.kv_cache_dtype = kv;
    group.layout = KVCacheLayout::HND;
    group.want_lse = true;
    group.batch = conformance_batch_spec("gqa_prefill");
    g.add(group);
    ConformanceCase cross = with_shape({8, 2, 64}, 16);
    cross.attn_type = AttentionType::EncoderDecoder;
    cross.kv_cache_dtype = kv;
    cross.dtype = DType::F16;
    cross.batch = conformance_batch_spec("cross_prefill");
    g.add(cross);
  }
}

// Strided inputs, padded slots and LSE against each other.
void io_sweep(GridBuilder& g) {
  std::size_t n = 0;
  for (const bool strided : {false, true}) {
    for (const bool padded : {false, true}) {
      for (const bool lse : {false, true}) {
        for (const DType dt : kDTypes) {
          ConformanceCase c = with_shape(kFeatureShapes[(n + 5) % kFeatureShapes.size()],
                                         kBlockSizes[(n + 2) % kBlockSizes.size()]);
          c.dtype = dt;
          c.layout = kLayouts[n % kLayouts.size()];
          c.strided_qkv = strided;
          c.padded_slots = padded;
          c.want_lse = lse;
          g.add_rotating(c, kDecoderBatches, n * 3);
          ++n;
        }
      }
    }
  }
}

// Encoder and encoder-only (keys are the batch's own rows), with and without
// the bidirectional window, plus a few scoring features.
void encoder_sweep(GridBuilder& g) {
  std::size_t n = 0;
  for (int variant = 0; variant < 2; ++variant) {
    for (const AttentionType t : {AttentionType::Encoder, AttentionType::EncoderOnly}) {
      for (const bool window : {false, true}) {
        for (const DType dt : kDTypes) {
          for (std::size_t b = 0; b < kEncoderBatches.size(); ++b) {
            ConformanceCase c = with_shape(kFeatureShapes[(n + 4 * variant) % kFeatureShapes.size()], 16);
            c.attn_type = t;
            c.dtype = dt;
            c.strided_qkv = n % 2 == 1;
            c.padded_slots = n % 5 == 2;
            c.want_lse = n % 3 != 0;
            if (window) c.sliding_window = kWindow;
            if (n % 6 == 4) c.alibi = true;
            if (n % 6 == 5) c.sinks = true;
            if (n % 7 == 3) {
              c.soft_cap = kSoftCap;
              c.scale = kSoftCapScale;
            }
            c.batch = conformance_batch_spec(kEncoderBatches[b]);
            g.add(c);
            ++n;
          }
        }
      }
    }
  }
}

// Cross-attention: encoder K/V cached in a first step, read in a second.
void cross_sweep(GridBuilder& g) {
  constexpr std::array kCrossKv{CacheDType::Auto, CacheDType::Fp8E4M3, CacheDType::Fp8E5M2};
  std::size_t n = 0;
  for (const CacheDType kv : kCrossKv) {
    for (const KVCacheLayout layout : kLayouts) {
      for (const DType dt : kDTypes) {
        for (std::size_t b = 0; b < kCrossBatches.size(); ++b) {
          ConformanceCase c = with_shape(kFeatureShapes[(n + 1) % kFeatureShapes.size()],
                                         kBlockSizes[n % kBlockSizes.size()]);
          c.attn_type = AttentionType::EncoderDecoder;
          c.kv_cache_dtype = kv;
          c.per_head_kv_scales = kv != CacheDType::Auto && n % 2 == 1;
          c.layout = layout;
          c.dtype = dt;
          c.strided_qkv = n % 3 == 1;
          c.want_lse = n % 2 == 0;
          c.batch = conformance_batch_spec(kCrossBatches[b]);
          g.add(c);
          ++n;
        }
      }
    }
  }
}

void noncausal_decoder_sweep(GridBuilder& g) {
  constexpr std::array kBatches{"small_prefill", "mixed_small", "single_prefill_div8"};
  std::size_t n = 0;
  for (const DType dt : kDTypes) {
    for (const KVCacheLayout layout : kLayouts) {
      for (std::size_t b = 0; b < kBatches.size(); ++b) {
        ConformanceCase c = with_shape(kFeatureShapes[(n + 2) % kFeatureShapes.size()],
                                       kBlockSizes[(n + 3) % kBlockSizes.size()]);
        c.causal = false;
        c.dtype = dt;
        c.layout = layout;
        c.want_lse = n % 2 == 1;
        c.batch = conformance_batch_spec(kBatches[b]);
        g.add(c);
        ++n;
      }
    }
  }
}

// Large GQA groups (17 and more query heads per KV head), MQA and
// Llama-70B's 64 / 8 at head sizes 128 and 256, three ways: bf16 prefill
// tiles (the AVX512-BF16 prefill paths), f16 / f32 mixed batches with a
// scoring feature, and a bf16 model over an fp8 cache.
void large_group_sweep(GridBuilder& g) {
  constexpr std::array<std::pair<int, int>, 5> kGroups{{{17, 1}, {32, 1}, {48, 1}, {64, 1}, {64, 8}}};
  constexpr std::array kSizes{128, 256};
  constexpr std::array kFp8{CacheDType::Fp8E4M3, CacheDType::Fp8E5M2};
  std::size_t n = 0;
  for (int variant = 0; variant < 3; ++variant) {
    for (const int d : kSizes) {
      for (const auto& [h, hkv] : kGroups) {
        ConformanceCase c = with_shape({h, hkv, d}, kBlockSizes[n % kBlockSizes.size()]);
        c.layout = kLayouts[n % kLayouts.size()];
        c.want_lse = true;
        if (variant == 0) {
          c.batch = conformance_batch_spec("gqa_prefill");
        } else {
          c.batch = conformance_batch_spec("gqa_mixed");
        }
        if (variant == 1) {
          c.dtype = n % 2 == 0 ? DType::F16 : DType::F32;
          switch (n % 4) {
            case 0:
              c.alibi = true;
              break;
            case 1:
              c.sinks = true;
              break;
            case 2:
              c.sliding_window = kWindow;
              break;
            default:
              c.soft_cap = kSoftCap;
              c.scale = kSoftCapScale;
          }
        }
        if (variant == 2) {
          c.kv_cache_dtype = kFp8[n % kFp8.size()];
          c.per_head_kv_scales = n % 3 == 0;
        }
        g.add(c);
        ++n;
      }
    }
  }
}

// Head sizes of real models that are not powers of two (72, 80, 88, 96, 112,
// 192) and 256, with decodes and prefills: a group of 4 (decode rows in the
// chunked paths) and one of 16 (every item in the prefill paths).
void head_size_sweep(GridBuilder& g) {
  constexpr std::array kSizes{72, 80, 88, 96, 112, 192, 256};
  constexpr std::array<std::pair<int, int>, 2> kShapeHeads{{{8, 2}, {16, 1}}};
  constexpr std::array kBatches{"mixed_small",   "medium_prefill_div8", "gqa_mixed",         "block_edges",
                                "fresh_prefill", "mixed_medium_div8",   "large_decode_div16"};
  std::size_t n = 0;
  for (int variant = 0; variant < 2; ++variant) {
    for (const int d : kSizes) {
      for (const auto& [h, hkv] : kShapeHeads) {
        ConformanceCase c = with_shape({h, hkv, d}, kBlockSizes[(n + 1) % kBlockSizes.size()]);
        c.dtype = kDTypes[n % kDTypes.size()];
        c.layout = kLayouts[(n / 2) % kLayouts.size()];
        c.want_lse = n % 2 == 0;
        c.strided_qkv = n % 5 == 2;
        if (variant == 1 && n % 2 == 1) {
          c.kv_cache_dtype = n % 4 == 1 ? CacheDType::Fp8E4M3 : CacheDType::Fp8E5M2;
          c.per_head_kv_scales = n % 3 == 0;
        }
        g.add_rotating(c, kBatches, n);
        ++n;
      }
    }
  }
}

// Long contexts past every split threshold (the batches' comments), each
// batch with shapes it fits the budget with: a plain case, one with a window
// that leaves most splits of a request without a visible key, one with sinks
// (counted once over the splits) and one over an fp8 cache.
void long_context_sweep(GridBuilder& g) {
  struct LongContext {
    const char* batch;
    std::array<Shape, 4> shapes;
  };
  const std::array<LongContext, 4> kLongContexts{{
      {"split_edges", {{{4, 1, 128}, {8, 2, 64}, {4, 2, 80}, {8, 1, 72}}}},
      {"long_mixed", {{{8, 2, 64}, {4, 1, 128}, {6, 2, 88}, {4, 2, 96}}}},
      {"long_decode", {{{8, 2, 64}, {4, 1, 128}, {12, 1, 64}, {8, 1, 128}}}},
      {"split_gqa", {{{32, 1, 128}, {64, 8, 128}, {17, 1, 256}, {64, 1, 128}}}},
  }};
  constexpr std::array kFp8{CacheDType::Fp8E4M3, CacheDType::Fp8E5M2};
  std::size_t n = 0;
  for (std::size_t b = 0; b < kLongContexts.size(); ++b) {
    for (std::size_t variant = 0; variant < 4; ++variant) {
      ConformanceCase c =
          with_shape(kLongContexts[b].shapes[variant], kBlockSizes[(variant + b) % kBlockSizes.size()]);
      c.batch = conformance_batch_spec(kLongContexts[b].batch);
      c.dtype = kDTypes[n % kDTypes.size()];
      c.layout = kLayouts[(variant + b) / 2 % kLayouts.size()];
      c.want_lse = true;
      if (variant == 1) c.sliding_window = kWindow;
      if (variant == 2) c.sinks = true;
      if (variant == 3) {
        c.kv_cache_dtype = kFp8[b % kFp8.size()];
        c.per_head_kv_scales = n % 3 == 0;
      }
      g.add(c);
      ++n;
    }
  }
}

// vLLM's batches at their real size, on small head counts (and Llama-3-8B's
// heads where the budget allows).
void real_size_sweep(GridBuilder& g) {
  constexpr std::array kRealBatches{"medium_decode", "medium_prefill", "mixed_medium",
                                    "single_decode", "single_prefill", "large_decode"};
  constexpr std::array<Shape, 3> kShapes{{{4, 4, 64}, {8, 2, 32}, {32, 8, 128}}};
  std::size_t n = 0;
  for (const char* batch : kRealBatches) {
    for (const Shape& s : kShapes) {
      ConformanceCase c = with_shape(s, 16);
      c.batch = conformance_batch_spec(batch);
      c.dtype = kDTypes[n % kDTypes.size()];
      c.layout = kLayouts[n % kLayouts.size()];
      c.want_lse = true;
      if (n % 4 == 1) c.sliding_window = kWindow;
      if (n % 4 == 2) {
        c.kv_cache_dtype = CacheDType::Fp8E4M3;
        c.per_head_kv_scales = true;
      }
      g.add(c);
      ++n;
    }
  }
}

}  // namespace

const std::vector<BatchSpec>& conformance_batch_specs() {
  static const std::vector<BatchSpec> specs = make_batch_specs();
  return specs;
}

const BatchSpec& conformance_batch_spec(std::string_view name) {
  for (const BatchSpec& b : conformance_batch_specs()) {
    if (b.name == name) return b;
  }
  throw_invalid("conformance_batch_spec", "name", "a known batch spec", name);
}

std::string ConformanceCase::id() const { return fmt::format("[{},seed={}]", feature_id(*this), seed); }

std::vector<ConformanceCase> conformance_grid() {
  GridBuilder g;
  base_sweep(g);
  feature_sweep(g, 0, [](ConformanceCase& c) { c.sliding_window = kWindow; });
  feature_sweep(g, 1, [](ConformanceCase& c) {
    c.soft_cap = kSoftCap;
    c.scale = kSoftCapScale;
  });
  feature_sweep(g, 2, [](ConformanceCase& c) { c.alibi = true; });
  feature_sweep(g, 3, [](ConformanceCase& c) { c.sinks = true; });
  feature_sweep(g, 4, [](ConformanceCase& c) {
    c.sliding_window = kWindow;
    c.soft_cap = kSoftCap;
    c.scale = kSoftCapScale;
    c.alibi = true;
    c.sinks = true;
  });
  // Chunked local attention, alone and with every scoring feature on top.
  feature_sweep(
      g, 5, [](ConformanceCase& c) { c.attention_chunk_size = chunk_for(c.block_size); }, kChunkBatches);
  feature_sweep(g, 6, [](ConformanceCase& c) {
    c.attention_chunk_size = chunk_for(c.block_size);
    c.sliding_window = kWindow;
    c.soft_cap = kSoftCap;
    c.scale = kSoftCapScale;
    c.alibi = true;
    c.sinks = true;
  }, kChunkBatches);
  // PrefixLM ranges, alone and with every scoring feature on top.
  feature_sweep(g, 7, [](ConformanceCase& c) { c.mm_prefix = true; }, kMmPrefixBatches);
  feature_sweep(g, 8, [](ConformanceCase& c) {
    c.mm_prefix = true;
    c.sliding_window = kWindow;
    c.soft_cap = kSoftCap;
    c.scale = kSoftCapScale;
    c.alibi = true;
    c.sinks = true;
  }, kMmPrefixBatches);
  cascade_sweep(g);
  fp8_sweep(g);
  token_head_sweep(g);
  io_sweep(g);
  encoder_sweep(g);
  cross_sweep(g);
  noncausal_decoder_sweep(g);
  real_size_sweep(g);
  large_group_sweep(g);
  head_size_sweep(g);
  long_context_sweep(g);
  // Batch-invariant plans (last, so the cases above keep their seeds).
  feature_sweep(g, 9, [](ConformanceCase& c) { c.batch_invariant = true; });
  return g.take();
}

}  // namespace pagedattn
